"""
Train a text-to-SQL agent: SFT warm-up on multi-turn trajectories, then multi-turn GRPO against a live database.

    python train.py                                   # the demo: SmolLM2-135M-Instruct on the gym, SFT, GRPO, eval
    python train.py --quick --model tiny              # a few steps of everything on the test model (the tests)
    python train.py --recipe trail --model Qwen/Qwen2.5-Coder-3B-Instruct --data data/spider/train.jsonl \\
        --sft-data out/teacher/spider_trail.jsonl --dev-data data/spider/dev.jsonl
    torchrun --nproc_per_node=8 train.py --recipe trust --model Qwen/Qwen3-4B --data ... --fsdp

A recipe (--recipe trust|trail|mtir|skyrl) is a dict of flag defaults taken from its paper, a preset (--preset demo)
the sizes of a setting; explicit flags win (config.py).
Checkpoints (out/<run-name>/ckpt-XXXXXX; the default run name is run-<date>-<time>) are save_pretrained folders plus
optimizer/scheduler/RNG/data position; --resume continues the latest one exactly. A new run refuses a folder that
holds checkpoints (pass --resume, another --run-name or --overwrite): it never deletes what it did not write.
"""
import copy
import functools
import json
import math
import os
import random
import shutil
import sys
import textwrap
import time
import warnings
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm
from transformers.utils import logging as hf_logging

import cli
import config
import env
import memory
import protocols
import rollout
from data.spider.prepare import spider_sample
from distributed import all_ranks, barrier, distribute, over_ranks, setup_distributed, shard
from eval import evaluate_ex, run_agent, trained_settings
from grpo import GRPOConfig, advantages, group_signal, grpo_step
from model import (TORCH_DTYPES, checkpoint_dir, latest_checkpoint, load_model, load_trainer_state, load_weights,
                   replaceable_checkpoints, resolve, resolve_dtype, save_checkpoint, write_state)
from report import Logger, report, trajectory_record
from rewards import REWARDS, difficulty_score, turn_budget
from sft import AgentTokenLoss, agent_tokens, load_sft_data, pad_batch

hf_logging.disable_progress_bar()  # save_pretrained's shard bar would interleave with ours

# -----------------------------------------------------------------------------
# data order, the optimizer and its schedule, the KL reference


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


def rl_batch(n, args, step):
    """The pool indices of RL's prompts at this step, all ranks' (rank r takes [r::world]), from a pool of n."""
    return take(n, args.rl_batch_size, args.seed + 1, step * args.rl_batch_size)


def make_optimizer(model, lr, steps, args):
    """AdamW (betas 0.9/0.95, SQL-Trail A.5) with linear warmup then cosine decay."""
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95))
    warm = max(1, int(args.warmup_ratio * steps))

    def cosine(s):  # linear warm-up, then cosine to 0
        return min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / max(1, steps))))
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, cosine)


def refresh_sampler(sampler, model):
    """The weights to decode with: the model's, copied by name into its full decode copy (bf16 under bf16; FSDP:
    gathered from every rank's shards), or the model itself where it is its own sampler. Decoding under autocast
    would cast every fp32 weight again at each step (docs/training.md, precision)."""
    model.zero_grad(set_to_none=True)  # every update starts from none: gradients are not needed across rollouts
    memory.release_freed_memory()  # what training freed, before the KV cache is allocated
    if sampler is not model:
        weights = dict(model.named_parameters())
        with torch.no_grad():
            for name, s in sampler.named_parameters():  # FSDP: all-gathers, every rank
                p = weights[name]
                s.copy_(p.full_tensor() if hasattr(p, "full_tensor") else p)
    return sampler.eval()


def reference_model(policy, run_dir, rank, fsdp=False, resumed=False):
    """KL's frozen reference: the (full, decodable) policy RL starts from, in the compute dtype, saved to <run>/ref
    when RL starts so that a resumed run loads the same weights back; sharded like the policy under FSDP."""
    path = Path(run_dir) / "ref"
    if resumed and (path / "config.json").exists():  # only a resume reads it: no rank reads what rank 0 writes
        ref = type(policy).from_pretrained(path, dtype=next(policy.parameters()).dtype)
    else:
        ref = copy.deepcopy(policy)
        if rank == 0:
            ref.save_pretrained(path)
        barrier()
    ref = ref.to(next(policy.parameters()).device).eval().requires_grad_(False)
    return shard(ref) if fsdp else ref

# -----------------------------------------------------------------------------
# RL: rollouts -> rewards -> GRPO, with the difficulty filter in front


def rollout_kwargs(args, **over):
    return dict(group_size=args.group_size, max_turns=args.max_turns, max_new_tokens=args.max_new_tokens,
                max_total_tokens=args.max_total_tokens, temperature=args.temperature, top_p=args.top_p,
                schema_mode=args.schema_mode) | over


def pass_rates(model, tokenizer, examples, reward_fn, rank, world, k, *, batch_size, desc="filter", **rollout_kw):
    """{id: fraction of k sampled rollouts that reward_fn scores correct} over all ranks' examples: the difficulty
    filters' pass@k estimate (TRUST App. A.3, SQL-Trail eq. 13), one continuous batch per rank. Also this rank's
    trajectories and reward dicts (group-major, k per example), which are on-policy groups RL can train on."""
    with torch.no_grad():
        trajs, _ = run_agent(model, tokenizer, examples, desc=desc, batch_size=batch_size, **rollout_kw)
    rewards = [reward_fn(t, t.example) for t in trajs]
    rates = {ex["id"]: float(np.mean([r["correct"] for r in rewards[i * k:(i + 1) * k]]))
             for i, ex in enumerate(examples)}
    rates = {i: r for part in all_ranks(rates) for i, r in part.items()}
    return rates, trajs, rewards


def difficulty_filter(policy, tokenizer, examples, args, rank, world):
    """Pass rate of each candidate over --filter-k rollouts of the current policy (each rank one continuous batch of
    a strided share; rates gathered so every rank holds the same pool), then the recipe's rule (select_rl_pool).
    Returns the pool and this rank's share of RL's first batch: each rank's kept groups ranked by S(q), which are
    on-policy groups of the same sampler, so when --filter-k equals --group-size they need not be rolled out again.
    The pool comes in the order that makes RL's data order open with that batch (rl_order)."""
    mine = examples[rank::world]
    k = args.filter_k
    rates, trajs, rewards = pass_rates(policy, tokenizer, mine, REWARDS[args.reward], rank, world, k,
                                       batch_size=args.eval_batch_size, seed=args.seed * 7919 + rank,
                                       protocol=args.protocol, **rollout_kwargs(args, group_size=k))
    pool = select_rl_pool(examples, rates, args)
    rule = f"{'0 < ' if args.filter_solved_once else ''}pass rate < {args.filter_pass_rate}"
    if args.filter_top_n:
        rule = f"S(q) top {args.filter_top_n} + {args.filter_unsolved_n} unsolved"
    if rank == 0:
        print(f"difficulty filter: kept {len(pool)}/{len(examples)} by {rule} over {args.filter_k} rollouts")
    if not pool:
        raise ValueError("the difficulty filter kept no question: raise --filter-pass-rate or --filter-top-n")
    kept = {ex["id"] for ex in pool}
    share = args.rl_batch_size // world
    firsts = [sorted([ex["id"] for ex in examples[r::world] if ex["id"] in kept],
                     key=lambda q: difficulty_score(rates[q]))[:share] for r in range(world)]  # every rank's
    if any(len(f) < share for f in firsts) or k != args.group_size or args.adaptive_turns:
        return pool, None  # not the batch RL would sample: RL rolls out its own
    first = [firsts[p % world][p // world] for p in range(args.rl_batch_size)]  # rank r's share is first[r::world]
    groups = {ex["id"]: range(i * k, (i + 1) * k) for i, ex in enumerate(mine)}
    first_rows = [j for q in firsts[rank] for j in groups[q]]
    warm = ([trajs[j] for j in first_rows], [rewards[j] for j in first_rows])
    return rl_order(pool, first, args), warm


def rl_order(pool, first, args):
    """The pool rearranged so that RL's data order (rl_batch) visits the questions of `first` (ids) at its first
    positions; the others fill the remaining places in their pool order. RL's first step is then the batch the filter
    already rolled out, and its first epoch still visits every question once."""
    by_id = {ex["id"]: ex for ex in pool}
    slots = [None] * len(pool)
    for i, q in zip(rl_batch(len(pool), args, 0), first):
        slots[i] = by_id[q]
    chosen = set(first)
    rest = iter(ex for ex in pool if ex["id"] not in chosen)
    return [ex if ex is not None else next(rest) for ex in slots]


PRACTICE_KEYS = 2 ** 40  # the practice measurement's draw keys start here, past any row index a rollout has


def measure_practice(policy, tokenizer, pool, args, rank, world, tag):
    """pass@1 of each of RL's questions, {id: fraction of --practice-k samples at the RL temperature that are correct},
    and this rank's trajectory records for rollouts.jsonl. Sample j of pool question i draws with key PRACTICE_KEYS +
    i * k + j under the run's seed, whatever rank or row decodes it: after SFT and after RL the same draws (a paired
    measurement), and no draw of the filter's or RL's, whose keys are row indices."""
    k = args.practice_k
    keys = [PRACTICE_KEYS + i * k + j for i in range(rank, len(pool), world) for j in range(k)]
    rates, trajs, rewards = pass_rates(policy, tokenizer, pool[rank::world], REWARDS[args.reward], rank, world, k,
                                       batch_size=args.eval_batch_size, desc=f"practice ({tag})", seed=args.seed,
                                       draw_keys=keys, protocol=args.protocol, **rollout_kwargs(args, group_size=k))
    records = [trajectory_record(t, r, tokenizer, stage="practice", after=tag, sample=j % k)
               for j, (t, r) in enumerate(zip(trajs, rewards))]
    return rates, records


def select_rl_pool(examples, rates, args):
    """TRUST App. A.3: keep pass rate < --filter-pass-rate (and > 0 with --filter-solved-once). SQL-Trail A.6
    (--filter-top-n N): rank by the difficulty score S(q) = rate if 0 < rate < 1 else 1 (eq. 13), keep the N lowest
    (hard but solvable), plus the first --filter-unsolved-n never-solved questions as its exploration set."""
    if not args.filter_top_n:
        kept = [ex for ex in examples if rates[ex["id"]] < args.filter_pass_rate]
        if args.filter_solved_once:
            kept = [ex for ex in kept if rates[ex["id"]] > 0]
        return kept
    ranked = sorted(examples, key=lambda ex: difficulty_score(rates[ex["id"]]))  # stable sort: ties keep data order
    keep = {ex["id"] for ex in ranked[: args.filter_top_n]}
    unsolved = [ex["id"] for ex in examples if rates[ex["id"]] == 0 and ex["id"] not in keep]
    keep |= set(unsolved[: args.filter_unsolved_n])
    return [ex for ex in examples if ex["id"] in keep]


# -----------------------------------------------------------------------------
# the two stages


def train_sft(model, tokenizer, rows, args, ctx, state, ckpt):
    """Masked-NLL SFT for args.sft_steps steps of args.sft_batch_size trajectories (all ranks together)."""
    rank = ctx["rank"]
    world = ctx["world"]
    device = ctx["device"]
    log = ctx["log"]
    opt, sched = make_optimizer(model, args.sft_lr, args.sft_steps, args)
    if ckpt is not None:
        load_trainer_state(ckpt, model, opt, sched, args, rank)
    wrapped = ctx["wrap"](AgentTokenLoss(model, full_forward=args.fsdp))
    micro = args.micro_batch_size or args.sft_batch_size
    model.train()
    bar = tqdm(range(state["step"], args.sft_steps), desc="sft", disable=rank != 0, initial=state["step"],
               total=args.sft_steps)
    for step in bar:
        t0 = time.perf_counter()
        idx = take(len(rows), args.sft_batch_size, args.seed, step * args.sft_batch_size)
        mine = sorted((rows[i] for i in idx[rank::world]), key=lambda r: len(r[0]))  # similar lengths: less padding
        tokens = over_ranks(torch.tensor(agent_tokens(mine), dtype=torch.float64)).item()  # exact past 2^24
        loss_sum = 0.0
        chunks = [mine[i: i + micro] for i in range(0, len(mine), micro)]  # global normaliser: split-invariant
        for j, chunk in enumerate(chunks):
            ids, mask = pad_batch(chunk, tokenizer.pad_token_id, device)
            sync = j == len(chunks) - 1 or not hasattr(wrapped, "no_sync")
            with (ctx["autocast"]()), (wrapped.no_sync() if not sync else nullcontext()):
                loss = wrapped(ids, mask, tokens, world)
                loss.backward()
            loss_sum += loss.item() / world
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip).item()
        lr = sched.get_last_lr()[0]  # this step's: after sched.step() it would be the next one's
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        loss_all = over_ranks(torch.tensor(loss_sum, dtype=torch.float64)).item()
        state["step"] = step + 1
        state["gstep"] += 1
        memory.release_freed_memory()
        log.log({"stage": "sft", "step": step + 1, "gstep": state["gstep"], "loss": loss_all, "grad_norm": grad_norm,
                 "lr": lr, "tokens": tokens, "time_update": time.perf_counter() - t0})
        bar.set_postfix(loss=f"{loss_all:.3f}")
        ctx["maybe_save"](opt, sched, final=step + 1 == args.sft_steps)
    model.eval()


def rollout_with_signal(model, tokenizer, prompts, protocol, reward_fn, cfg, *, refill=None, rounds=3, seed,
                        **rollout_kw):
    """Rollouts and rewards of prompts, group-major, and stats. With refill (DAPO's dynamic sampling: n -> n fresh
    prompts), a group that would not move the policy (grpo.group_signal: every advantage the loss uses is zero) is
    set aside and fresh prompts are rolled, at most `rounds` more times, until len(prompts) groups have signal; the
    set-aside groups fill the batch only when that cap is hit."""
    G = rollout_kw["group_size"]
    if cfg.group_size != G:
        raise ValueError(f"GRPO's group size {cfg.group_size} is not the rollout's {G}")
    kept = []    # groups with signal
    flat = []    # groups without
    done = 0     # rounds rolled out
    batch = prompts
    while True:
        trajs = rollout.rollout(model, tokenizer, batch, protocol, seed=seed + 7 * done, **rollout_kw)
        rewards = [reward_fn(t, t.example) for t in trajs]
        signal = group_signal(advantages(trajs, rewards, cfg), G).tolist()
        for g in range(len(batch)):
            group = (trajs[g * G:(g + 1) * G], rewards[g * G:(g + 1) * G])
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
    return [t for g in groups for t in g[0]], [r for g in groups for r in g[1]], stats


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


def train_rl(model, tokenizer, pool, args, ctx, state, ckpt, warm=None):
    """Multi-turn GRPO: each rank rolls out its share of prompts (whole groups), rewards, one grpo_step. warm: the
    first step's (trajectories, rewards) when the difficulty filter already sampled them."""
    rank = ctx["rank"]
    world = ctx["world"]
    log = ctx["log"]
    opt, sched = make_optimizer(model, args.rl_lr, args.rl_steps, args)
    if ckpt is not None:
        load_trainer_state(ckpt, model, opt, sched, args, rank)
    cfg = grpo_config(args, tokenizer.pad_token_id)
    ref = reference_model(ctx["policy"](), ctx["run_dir"], rank, args.fsdp and world > 1,
                          resumed=ckpt is not None) if args.kl_beta else None

    def refill(n):  # DAPO's fresh prompts: their own stream, its position checkpointed, so a resume draws the same
        idx = take(len(pool), n, args.seed + 2 + 1000 * rank, state["refill"])
        state["refill"] += n
        return [pool[i] for i in idx]
    bar = tqdm(range(state["step"], args.rl_steps), desc="rl", disable=rank != 0, initial=state["step"],
               total=args.rl_steps)
    for step in bar:
        idx = rl_batch(len(pool), args, step)
        mine = [pool[i] for i in idx[rank::world]]  # whole groups stay on one rank
        t0 = time.perf_counter()
        reused = step == 0 and warm is not None  # the filter's own rollouts of these questions
        if reused:
            trajs, rewards = warm
            ds = {}
        else:
            trajs, rewards, ds = rollout_with_signal(
                ctx["policy"](), tokenizer, mine, args.protocol, REWARDS[args.reward], cfg, refill=refill if
                args.dynamic_sampling else None, rounds=args.dynamic_sampling_rounds,
                seed=(args.seed * 100_003 + step) * 1009 + rank, max_rows=args.eval_batch_size, **rollout_kwargs(args))
        t1 = time.perf_counter()
        lr = sched.get_last_lr()[0]  # the lr this step uses
        model.train()
        gm = memory.on_training_thread(ctx["device"], update, model, opt, trajs, rewards, cfg, ref, ctx["autocast"])
        with warnings.catch_warnings():  # a step with no signal skips the update, yet the schedule counts RL steps
            warnings.filterwarnings("ignore", "Detected call of `lr_scheduler", UserWarning)
            sched.step()
        # rollout = generation + its tool calls + the rewards (executing each final SQL against gold)
        times = {"rollout": t1 - t0, "update": time.perf_counter() - t1}
        state["step"] = step + 1
        state["gstep"] += 1
        records = [trajectory_record(t, r, tokenizer, stage="rl", step=step + 1, gstep=state["gstep"],
                                     reused_filter_draws=reused) for t, r in zip(trajs, rewards)]
        log.rollouts([r for part in all_ranks(records) for r in part])
        row = {"stage": "rl", "step": step + 1, "gstep": state["gstep"], "lr": lr, "reused_filter_draws": reused,
               **rollout_metrics(trajs, rewards), **{f"time_{k}": v for k, v in times.items()}, **ds,
               **{k: v for k, v in gm.items() if isinstance(v, (int, float, bool))}}  # grpo's: already global
        if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < args.rl_steps:
            row["dev_ex"] = evaluate_ex(ctx["policy"](), tokenizer, {"dev": ctx["dev"]}, args, rank, world)["dev"]["ex"]
        log.log(row)
        bar.set_postfix(reward=f"{row['reward_full']:.2f}", ex=f"{row['ex']:.2f}", turns=f"{row['turns']:.1f}")
        ctx["maybe_save"](opt, sched, final=step + 1 == args.rl_steps)


def update(model, opt, trajs, rewards, cfg, ref, autocast):
    """One grpo_step under autocast (autocast holds for the thread that enters it: memory.on_training_thread's)."""
    with autocast():
        return grpo_step(model, opt, trajs, rewards, cfg, ref_model=ref)


def grpo_config(args, pad_id):
    """GRPOConfig from the flags; an fp32 sampler has the model's own weights: its log-probs are the old policy's."""
    return GRPOConfig(group_size=args.group_size, schema_lambda=args.schema_lambda, eps_low=args.eps_low,
                      eps_high=args.eps_high, temperature=args.temperature, grad_clip=args.grad_clip,
                      micro_batch_size=args.micro_batch_size or args.rl_batch_size * args.group_size,
                      trajectory_filter=bool(args.traj_filter), dynamic_sampling=bool(args.dynamic_sampling),
                      ppo_epochs=args.ppo_epochs, mini_batches=args.ppo_mini_batches, kl_beta=args.kl_beta,
                      agg=args.agg, dr_grpo_len=args.max_total_tokens, scale_std=bool(args.scale_std),
                      mask_truncated=bool(args.mask_truncated), naive_schema_weight=args.naive_schema_weight,
                      recompute_old_logp=not (args.dtype == "fp32" and args.temperature > 0), pad_id=pad_id)


# -----------------------------------------------------------------------------


def main(argv=None):
    args, typed, saved = config.settings(argv)
    owns_group = not dist.is_initialized()  # a caller's process group outlives this run; one made here ends with it
    rank, world, device = setup_distributed(args)
    if torch.device(device).type == "cpu":
        memory.return_memory_on_free()
    args.dtype = resolve_dtype(args.dtype, device)  # saved resolved in config.json
    config.check_resume(args, typed, saved)
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)
    if args.run_name is None:
        if args.resume:
            raise cli.UserError("--resume needs --run-name: the folder under --out-dir of the run to continue")
        name = [time.strftime("run-%Y%m%d-%H%M%S")]  # a new folder per run, rank 0's name on every rank
        if dist.is_initialized():
            dist.broadcast_object_list(name, src=0)
        args.run_name = name[0]
    run_dir = Path(args.out_dir) / args.run_name
    stages = ["sft", "rl"] if args.stage == "both" else [args.stage]
    master = rank == 0
    if master:
        print(config.describe(args))
    trained = trained_settings(args.model)
    if master and trained:
        print("settings the checkpoint was trained in (a flag overrides): "
              + ", ".join(f"{k}={getattr(args, k)}" for k in trained))

    # --- checked before any work: the model can load, and a run never deletes what it did not write
    try:
        model_path = resolve(args.model)  # a missing folder, a Hub id neither cached nor reachable, smollm2's fetch
    except (OSError, RuntimeError) as e:
        raise cli.UserError(e) from None
    try:
        old = replaceable_checkpoints(run_dir, args.model, args.resume, args.overwrite)
    except ValueError as e:
        raise cli.UserError(e) from None
    mini = args.rl_batch_size // args.ppo_mini_batches  # prompts per optimizer step
    if args.rl_batch_size % args.ppo_mini_batches or mini % world:
        raise cli.UserError(f"--ppo-mini-batches {args.ppo_mini_batches} must divide --rl-batch-size "
                            f"{args.rl_batch_size} into shares that are a multiple of the world size {world}")

    # --- data: default to the gym (built once, by rank 0)
    if None in (args.data, args.dev_data, args.test_data):
        from data.gym.prepare import ensure_gym
        if master:
            ensure_gym(seed=0)
        barrier()
        gym = ensure_gym(seed=0)
        for flag, split in (("data", "train"), ("dev_data", "dev"), ("test_data", "test")):
            setattr(args, flag, getattr(args, flag) or str(gym / f"{split}.jsonl"))
    try:
        train = env.load_examples(args.data)
        dev = env.load_examples(args.dev_data)[: args.eval_limit or None]
        test = env.load_examples(args.test_data)[: args.eval_limit or None]
    except (FileNotFoundError, ValueError) as e:  # a bad record or a missing database
        raise cli.UserError(e) from None
    # --- model: fp32 master weights (the optimizer's); bf16 compute per --dtype; gradient checkpointing on GPU
    try:
        model, tokenizer = load_model(model_path, device=device, seed=args.seed)  # resolved once, above
    except ValueError as e:  # e.g. a tokenizer without a chat template
        raise cli.UserError(e) from None
    # --- memory: training's peak fits, or stop here; the rows decoded at once: --eval-batch-size, or as many as the KV
    # cache's memory holds beside what stays while decoding, the weights, AdamW's moments and the decode copy (said
    # on one line)
    kv_dtype = TORCH_DTYPES[args.dtype]
    bf16 = args.dtype == "bf16"
    budget = None
    reserve = memory.CACHE_HEADROOM
    if torch.device(device).type == "cpu":
        memory.check_training_memory(model, args, bf16, device)
        budget = args.kv_cache_gb * 2 ** 30
        reserve = memory.decoding_bytes(model, bf16)
    try:
        rows = memory.cache_rows(model, args.eval_batch_size, device, kv_dtype, args.max_total_tokens, budget, reserve)
    except ValueError as e:
        raise cli.UserError(e) from None
    if master:  # the layers, then the command line, then the memory: what this run uses
        if rows == args.eval_batch_size:  # else memory.cache_rows has said it
            kv = memory.kv_bytes_per_row(model.config, args.max_total_tokens, kv_dtype) * rows
            print(f"rollouts decode {rows} rows at once (KV cache up to {kv / 1e9:.2f} GB)")
    args.eval_batch_size = rows
    if master:
        print(textwrap.fill("config: " + ", ".join(f"{k}={v}" for k, v in sorted(vars(args).items())), 118,
                            subsequent_indent="  "))
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(json.dumps(vars(args), indent=1) + "\n")


    # --- resume: the latest checkpoint's state decides which stage and step we are at
    ckpt = latest_checkpoint(run_dir) if args.resume else None
    state = {"stage": stages[0], "step": 0, "gstep": 0, "evals": {}, "practice": {}, "rl_pool": None, "refill": 0,
             "log_lines": None, "rollout_lines": None}
    if ckpt is not None:
        saved = json.loads((ckpt / "state.json").read_text())
        state.update({k: v for k, v in saved.items() if k in state}, gstep=saved["global_step"])
        if master:
            print(f"resuming {ckpt} ({state['stage']} step {state['step']})")
    elif master and old:  # --overwrite (checked above)
        print(f"--overwrite: deleting the {len(old)} checkpoints of an earlier run in {run_dir}")
        for c in old:
            shutil.rmtree(c)
    barrier()

    spider = spider_sample(args.spider_dir, args.spider_limit) if args.spider_limit else []
    if master and args.spider_limit and not spider:
        print(f"spider: {args.spider_dir} has no dev.json; Spider evaluation skipped")
    base_protocol = args.protocol
    args.protocol = protocols.protocol_variant(args.protocol, args.brief_prompt, args.obs_rows, args.force_final_answer)
    try:
        evalsets = {"dev": dev, "test": test} | ({"spider": spider} if spider else {})
        return run(args, model, tokenizer, state, ckpt, stages, train, evalsets, run_dir, rank, world, device)
    finally:
        if args.protocol != base_protocol:  # leave the registry as we found it (in-process callers, tests)
            protocols.PROTOCOLS.pop(args.protocol, None)
        if owns_group and dist.is_initialized():
            dist.destroy_process_group()


def run(args, model, tokenizer, state, ckpt, stages, train, evalsets, run_dir, rank, world, device):
    """Both stages and the report, after setup (main)."""
    master = rank == 0
    if ckpt is not None:  # weights first; optimizer state is loaded by the stage that owns it
        model = load_weights(model, ckpt)
    bf16 = args.dtype == "bf16"
    fsdp = args.fsdp and world > 1
    # rollouts decode a full copy: in bf16 under bf16, unsharded under FSDP, uncompiled under --compile
    sampler = copy.deepcopy(model).to(TORCH_DTYPES[args.dtype]) if bf16 or fsdp or args.compile else model
    autocast = functools.partial(torch.autocast, torch.device(device).type, torch.bfloat16) if bf16 else nullcontext
    wrap = distribute(model, args.fsdp, world, device, bf16, args.compile)  # SFT's loss: wrap (DDP); RL: the model

    log = Logger(run_dir, args, rank, state["gstep"], state["log_lines"], state["rollout_lines"])

    def maybe_save(opt, sched, final=False):
        due = args.ckpt_every and state["gstep"] % args.ckpt_every == 0
        if due or final:
            state.update(log.counts())
            save_checkpoint(run_dir, state["gstep"], model, tokenizer, opt, sched, state, args, rank, world)
        if args.stop_after and state["gstep"] == args.stop_after:
            if master:
                print(f"--stop-after {args.stop_after}: stopping like a killed run")
            sys.exit(0)

    def policy():
        return refresh_sampler(sampler, model)

    times = {}

    def timed(name, fn, *a):
        t0 = time.perf_counter()
        out = fn(*a)
        times[name] = times.get(name, 0.0) + time.perf_counter() - t0
        return out

    ctx = dict(rank=rank, world=world, device=device, log=log, wrap=wrap, autocast=autocast, maybe_save=maybe_save,
               run_dir=run_dir, dev=evalsets["dev"], policy=policy)

    def record_eval(tag):
        if tag in state["evals"]:
            return
        # no torch.no_grad() needed: evaluate_ex only decodes, and rollout decodes in inference mode
        e = state["evals"][tag] = timed("eval", evaluate_ex, policy(), tokenizer, evalsets, args, rank, world)
        log.log({"stage": "eval", "after": tag, "step": state["step"], "gstep": state["gstep"],
                 **{f"{name}_ex": e[name]["ex"] for name in e}})
        if master:
            print(f"[{tag}] " + "  ".join(f"{name} EX {100 * e[name]['ex']:.1f}% ({e[name]['n']})" for name in e))
        keep_in_last_checkpoint()

    def keep_in_last_checkpoint():
        """The stage's last checkpoint keeps what was measured after it (its state is written again): a resume
        skips the measurement."""
        ckpt_dir = checkpoint_dir(run_dir, state["gstep"])
        if master and ckpt_dir.exists():
            state.update(log.counts())
            write_state(ckpt_dir, state, state["gstep"], args)

    def record_practice(tag, pool):
        """pass@1 of RL's questions after a stage (measure_practice), its records in rollouts.jsonl."""
        if tag in state["practice"]:
            return
        rates, records = timed("practice", measure_practice, policy(), tokenizer, pool, args, rank, world, tag)
        state["practice"][tag] = rates
        log.rollouts([r | {"gstep": state["gstep"]} for part in all_ranks(records) for r in part])
        pass1 = float(np.mean(list(rates.values())))
        log.log({"stage": "practice", "after": tag, "step": state["step"], "gstep": state["gstep"],
                 "practice_pass1": pass1})
        if master:
            print(f"[{tag}] practice pass@1 {pass1:.2f} ({len(rates)} questions x {args.practice_k} samples)")

    # --- stage 1: SFT on teacher (or any) trajectories
    if "sft" in stages and state["stage"] == "sft":
        sft_path = Path(args.sft_data) if args.sft_data else run_dir / f"teacher_{args.protocol}.jsonl"
        if args.sft_data is None and master and not (args.resume and sft_path.exists()):  # fresh run: fresh data
            from data.teacher import write_teacher_data
            write_teacher_data(train[: args.teacher_limit or None], sft_path, args.protocol, max_turns=args.max_turns,
                               schema_mode=args.schema_mode, seed=args.seed, max_probes=args.teacher_probes,
                               distractors=args.teacher_distractors, list_tables=bool(args.teacher_list_tables))
        barrier()
        rows = load_sft_data(sft_path, tokenizer, args.max_total_tokens, rank)
        if args.sft_epochs:
            args.sft_steps = math.ceil(args.sft_epochs * len(rows) / args.sft_batch_size)
            if master:
                print(f"sft: {args.sft_epochs:g} epochs of {len(rows):,} trajectories at batch {args.sft_batch_size}: "
                      f"{args.sft_steps} steps")
        timed("sft", memory.on_training_thread, device, train_sft, model, tokenizer, rows, args, ctx, state,
              ckpt if ckpt is not None and state["step"] else None)
        ckpt = None
    if "sft" in stages:
        record_eval("sft")

    # --- stage 2: GRPO on questions the policy does not already solve
    if "rl" in stages:
        if state["stage"] != "rl":
            state.update(stage="rl", step=0)
        warm = None
        if state["rl_pool"] is None:
            pool = train
            if args.filter_k:
                cands = train[: args.filter_limit or None]
                pool, warm = timed("filter", difficulty_filter, policy(), tokenizer, cands, args, rank, world)
                log.log({"stage": "filter", "step": 0, "gstep": state["gstep"], "filter_candidates": len(cands),
                         "filter_kept": len(pool)})
            state["rl_pool"] = [ex["id"] for ex in pool]
        by_id = {ex["id"]: ex | ({"max_turns": turn_budget(ex["difficulty"], args.max_turns)} if args.adaptive_turns
                                 else {}) for ex in train}
        pool = [by_id[i] for i in state["rl_pool"]]
        if args.rl_epochs:
            args.rl_steps = math.ceil(args.rl_epochs * len(pool) / args.rl_batch_size)
            if master:
                print(f"rl: {args.rl_epochs:g} epochs of {len(pool):,} questions at batch {args.rl_batch_size}: "
                      f"{args.rl_steps} steps")
        if args.practice_k and state["step"] == 0:  # after SFT; a resume from there measures again, the same draws
            record_practice("sft", pool)
        timed("rl", train_rl, model, tokenizer, pool, args, ctx, state,
              ckpt if ckpt is not None and state["step"] else None, warm)
        if args.practice_k:
            record_practice("rl", pool)
            keep_in_last_checkpoint()
        record_eval("rl")

    # --- report: the EX table, stage seconds, results.json and curves.png
    if master:
        report(run_dir, state["evals"], times, log, state["practice"])
    return state


if __name__ == "__main__":
    try:
        main()
    except cli.UserError as e:
        cli.die(e)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # DDP keeps gloo's worker threads alive past destroy_process_group; one that frees a tensor during interpreter
        # teardown takes the GIL and aborts (SIGABRT, ~1 run in 20), failing a finished run. Everything is written.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
