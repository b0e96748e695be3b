"""
What RL practises: the data order, the difficulty filter that picks RL's questions (the practice set), the batch of
groups a GRPO step trains on (with DAPO's refill), and the paired pass@1 of the practice set before and after RL.

    python train.py --preset demo --filter-limit 96 --practice-k 4     # train.py calls these between its stages

Every rollout here samples with the run's RolloutConfig; each function returns what it measured, and train.py logs it.
"""
import functools
from dataclasses import dataclass

import numpy as np
import torch

import rollout
from distributed import all_ranks, over_ranks
from eval import run_agent
from grpo import Tracks, advantages, group_signal
from report import trajectory_record
from rewards import difficulty_score

# -----------------------------------------------------------------------------
# the data order: endless epoch permutations, a function of the position only (SFT's batches, RL's prompts)


@functools.lru_cache(maxsize=4)
def epoch_order(n, seed, epoch):
    """A fixed permutation per (seed, epoch): the data order depends only on the position, so resume replays it."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g).tolist()


def take(n, batch_size, seed, position):
    """Indices [position, position + batch_size) of the endless sequence of epoch permutations."""
    out = []
    while len(out) < batch_size:
        epoch, i = divmod(position, n)
        out.append(epoch_order(n, seed, epoch)[i])
        position += 1
    return out


def rl_batch(n, batch_size, seed, step):
    """The pool indices of RL's prompts at this step, all ranks' (rank r takes [r::world]), from a pool of n."""
    return take(n, batch_size, seed + 1, step * batch_size)

# -----------------------------------------------------------------------------
# the difficulty filter: the questions RL practises


@dataclass(frozen=True)
class PoolRule:
    """Which filtered questions RL keeps (select_rl_pool)."""
    pass_rate: float = 1.0     # keep pass rate < this (TRUST App. A.3)
    solved_once: bool = False  # and > 0: the policy solves it sometimes
    top_n: int = 0             # instead: SQL-Trail A.6's N lowest difficulty scores S(q)
    unsolved_n: int = 0        # with top_n: this many never-solved questions as its exploration set

    def describe(self):
        if self.top_n:
            return f"S(q) top {self.top_n} + {self.unsolved_n} unsolved"
        return f"{'0 < ' if self.solved_once else ''}pass rate < {self.pass_rate}"


def pass_rates(model, tokenizer, examples, cfg, reward_fn, k, *, batch_size, seed, desc="filter", draw_keys=None):
    """{id: fraction of k sampled rollouts that reward_fn scores correct} over all ranks' examples: the difficulty
    filters' pass@k estimate (TRUST App. A.3, SQL-Trail eq. 13), one continuous batch per rank. Also this rank's
    trajectories and reward dicts (group-major, k per example), which are on-policy groups RL can train on."""
    with torch.no_grad():
        trajs, _ = run_agent(model, tokenizer, examples, cfg, group_size=k, batch_size=batch_size, desc=desc, seed=seed,
                             draw_keys=draw_keys)
    rewards = [reward_fn(t, t.example) for t in trajs]
    rates = {ex["id"]: float(np.mean([r["correct"] for r in rewards[i * k:(i + 1) * k]]))
             for i, ex in enumerate(examples)}
    rates = {i: r for part in all_ranks(rates) for i, r in part.items()}
    return rates, trajs, rewards


def select_rl_pool(examples, rates, rule):
    """TRUST App. A.3: keep pass rate < rule.pass_rate (and > 0 with rule.solved_once). SQL-Trail A.6 (rule.top_n N):
    rank by the difficulty score S(q) = rate if 0 < rate < 1 else 1 (eq. 13), keep the N lowest (hard but
    solvable), plus the first rule.unsolved_n never-solved questions as its exploration set."""
    if not rule.top_n:
        kept = [ex for ex in examples if rates[ex["id"]] < rule.pass_rate]
        if rule.solved_once:
            kept = [ex for ex in kept if rates[ex["id"]] > 0]
        return kept
    ranked = sorted(examples, key=lambda ex: difficulty_score(rates[ex["id"]]))  # stable sort: ties keep data order
    keep = {ex["id"] for ex in ranked[: rule.top_n]}
    unsolved = [ex["id"] for ex in examples if rates[ex["id"]] == 0 and ex["id"] not in keep]
    keep |= set(unsolved[: rule.unsolved_n])
    return [ex for ex in examples if ex["id"] in keep]


def difficulty_filter(policy, tokenizer, examples, cfg, reward_fn, rule, k, *, size=0, batch_size, rl_batch_size,
                      seed, reuse, rank, world):
    """Pass rate of each candidate over k rollouts of the current policy (each rank one continuous batch of a strided
    share; rates gathered so every rank holds the same pool), then the rule (select_rl_pool). size > 0: the
    candidates are looked at `size` at a time, the filter stops once `size` are kept, and the pool is those `size`
    (the practice set's size); a row draws with its running index, as in one batch, so where the filter stops changes
    no sample. Returns the pool, the rates of the candidates looked at, and with reuse this rank's share of RL's
    first batch: each rank's kept groups ranked by S(q), which are on-policy groups of the same sampler, so they need
    not be rolled out again (reuse: k is RL's group size and every question has the same turn budget). The pool then
    comes in the order that makes RL's data order open with that batch (rl_order)."""
    step = size or len(examples)
    shares = [[] for _ in range(world)]  # every rank's candidates, in the order it rolled them out
    rates = {}
    trajs = []
    rewards = []
    pool = []
    for start in range(0, len(examples), step):
        chunk = examples[start:start + step]
        for r in range(world):
            shares[r] += chunk[r::world]
        mine = chunk[rank::world]
        keys = list(range(len(trajs), len(trajs) + len(mine) * k))  # this rank's running row index
        chunk_rates, chunk_trajs, chunk_rewards = pass_rates(policy, tokenizer, mine, cfg, reward_fn, k,
                                                             batch_size=batch_size, seed=seed * 7919 + rank,
                                                             draw_keys=keys)
        rates |= chunk_rates
        trajs += chunk_trajs
        rewards += chunk_rewards
        pool = select_rl_pool(examples[:start + step], rates, rule)
        if size and len(pool) >= size:
            break
    if size:
        pool = pool[:size]
    kept = {ex["id"] for ex in pool}
    share = rl_batch_size // world
    firsts = [sorted([ex["id"] for ex in shares[r] if ex["id"] in kept],
                     key=lambda q: difficulty_score(rates[q]))[:share] for r in range(world)]  # every rank's
    if not pool or any(len(f) < share for f in firsts) or not reuse:
        return pool, rates, None  # not the batch RL would sample: RL rolls out its own
    first = [firsts[p % world][p // world] for p in range(rl_batch_size)]  # rank r's share is first[r::world]
    groups = {ex["id"]: range(i * k, (i + 1) * k) for i, ex in enumerate(shares[rank])}
    first_rows = [j for q in firsts[rank] for j in groups[q]]
    warm = ([trajs[j] for j in first_rows], [rewards[j] for j in first_rows])
    return rl_order(pool, first, rl_batch_size, seed), rates, warm


def rl_order(pool, first, rl_batch_size, seed):
    """The pool rearranged so that RL's data order (rl_batch) visits the questions of `first` (ids) at its first
    positions; the others fill the remaining places in their pool order. RL's first step is then the batch the filter
    already rolled out, and its first epoch still visits every question once."""
    by_id = {ex["id"]: ex for ex in pool}
    slots = [None] * len(pool)
    for i, q in zip(rl_batch(len(pool), rl_batch_size, seed, 0), first):
        slots[i] = by_id[q]
    chosen = set(first)
    rest = iter(ex for ex in pool if ex["id"] not in chosen)
    return [ex if ex is not None else next(rest) for ex in slots]

# -----------------------------------------------------------------------------
# a GRPO step's groups, and what its rollouts did


def rollout_with_signal(model, tokenizer, prompts, cfg, reward_fn, grpo_cfg, *, refill=None, rounds=3, seed,
                        max_rows):
    """Rollouts and rewards of prompts, group-major, the GRPO advantages (grpo.Tracks) of those rows, and stats.
    With refill (DAPO's dynamic sampling: n -> n fresh prompts), a group that would not move the policy
    (grpo.group_signal: every advantage the loss uses is zero) is set aside and fresh prompts are rolled, at most
    `rounds` more times, until len(prompts) groups have signal; the set-aside groups fill the batch only when that cap
    is hit. The advantages are computed here once, per round, and grpo_step uses them."""
    G = grpo_cfg.group_size
    kept = []    # groups with signal: (trajectories, rewards, their rows of the round's Tracks)
    flat = []    # groups without
    done = 0     # rounds rolled out
    batch = prompts
    while True:
        trajs = rollout.rollout(model, tokenizer, batch, **vars(cfg), group_size=G, seed=seed + 7 * done,
                                max_rows=max_rows)
        rewards = [reward_fn(t, t.example) for t in trajs]
        tracks = advantages(trajs, rewards, grpo_cfg)
        signal = group_signal(tracks, G).tolist()
        for g in range(len(batch)):
            rows = slice(g * G, (g + 1) * G)
            group = (trajs[rows], rewards[rows], tracks.rows(rows))
            if signal[g] or refill is None:
                kept.append(group)
            else:
                flat.append(group)
        done += 1
        if len(kept) >= len(prompts) or done > rounds or refill is None:
            break
        batch = refill(len(prompts))
    groups = (kept + flat)[:len(prompts)]
    stats = {}
    if refill is not None:
        stats = {"ds_rounds": done, "ds_signal_groups": min(len(kept), len(prompts)),
                 "ds_cap_hit": len(kept) < len(prompts)}
    trajs = [t for g in groups for t in g[0]]
    rewards = [r for g in groups for r in g[1]]
    return trajs, rewards, Tracks.cat([g[2] for g in groups]), stats


def rollout_metrics(trajs, rewards):
    """Means over a step's trajectories on all ranks: every numeric reward term, EX, turns, tool calls, tokens."""
    keys = sorted({k for r in rewards for k, v in r.items() if isinstance(v, (int, float))})
    local = {f"reward_{k}": sum(float(r.get(k) or 0.0) for r in rewards) for k in keys}
    local |= {"ex": sum(r["correct"] for r in rewards), "turns": sum(t.num_turns for t in trajs),
              "tool_calls": sum(t.num_tool_calls for t in trajs),
              "sampled_tokens": sum(sum(t.loss_mask) for t in trajs),
              "seq_tokens": sum(len(t.token_ids) for t in trajs),
              "answered": sum(t.episode.final_sql is not None for t in trajs), "n": len(trajs)}
    total = over_ranks(torch.tensor(list(local.values()), dtype=torch.float64))
    total = dict(zip(local, total.tolist()))
    n = max(total.pop("n"), 1)
    return {k: v / n for k, v in total.items()}

# -----------------------------------------------------------------------------
# the paired measurement of the practice set, after SFT and after RL


PRACTICE_KEYS = 2 ** 40  # the practice measurement's draw keys start here, past any row index a rollout has


def measure_practice(policy, tokenizer, pool, cfg, reward_fn, k, *, batch_size, seed, rank, world, tag):
    """pass@1 of each of RL's questions, {id: fraction of k samples at cfg's temperature that are correct}, and this
    rank's trajectory records for rollouts.jsonl. Sample j of pool question i draws with key PRACTICE_KEYS + i * k + j
    under the run's seed, whatever rank or row decodes it: after SFT and after RL the same draws (a paired
    measurement), and no draw of the filter's or RL's, whose keys are row indices."""
    keys = [PRACTICE_KEYS + i * k + j for i in range(rank, len(pool), world) for j in range(k)]
    rates, trajs, rewards = pass_rates(policy, tokenizer, pool[rank::world], cfg, reward_fn, k, batch_size=batch_size,
                                       seed=seed, desc=f"practice ({tag})", draw_keys=keys)
    records = [trajectory_record(t, r, tokenizer, stage="practice", after=tag, sample=j % k)
               for j, (t, r) in enumerate(zip(trajs, rewards))]
    return rates, records
