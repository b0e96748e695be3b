"""
GRPO for multi-turn agents, with TRUST-SQL's dual-track masked advantages (plain PyTorch + torch.distributed).

    adv_full   = group_advantages(full rewards)     -> every sampled token of the trajectory
    adv_schema = group_advantages(schema rewards)   -> only sampled tokens in turns <= the last propose_schema turn
    loss       = L_full + λ·L_schema                (TRUST-SQL eqs. 4-6; λ = 0 is plain single-track GRPO)

Each L is the clip-higher PPO surrogate, by default a token-mean over the track's active tokens normalised by the
GLOBAL count of those tokens (all ranks, all micro-batches), so the update does not depend on how the batch is split.

    python grpo.py            # one dual-track GRPO step on the tiny model with synthetic trajectories

Under torch.distributed pass the bare model (no DDP wrapper: it would average what must be summed) or an FSDP2
fully_shard'ed one: grpo_step makes each rank's gradient the global one itself.
"""
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from distributed import fsdp_fillers, is_fsdp, over_ranks, stats_over_ranks, sum_grads_over_ranks
from model import predicting_logits

TRUNCATED = ("max_tokens", "context")  # stop reasons that cut a turn mid-generation; max_turns is a real ending

# -----------------------------------------------------------------------------
# advantages and masks

def group_advantages(rewards, group_size, eps=1e-6, scale_std=True, keep=None):
    """(r - mean_g) / (std_g + eps) within each group of `group_size` consecutive rows; unbiased std like verl/TRL.
    scale_std=False skips the division (Dr. GRPO). `keep` (N,) bool leaves rows out of the group statistics
    (MTIR's trajectory filter); they get advantage 0. A group with zero variance (or one member) gets zeros."""
    r = torch.as_tensor(rewards, dtype=torch.float64).reshape(-1, group_size)  # (num_groups, G)
    k = torch.ones_like(r, dtype=torch.bool) if keep is None else torch.as_tensor(keep).reshape(-1, group_size)
    n = k.sum(1, keepdim=True)
    mean = torch.where(k, r, 0).sum(1, keepdim=True) / n.clamp(min=1)
    centred = torch.where(k, r - mean, 0)
    var = centred.pow(2).sum(1, keepdim=True) / (n - 1).clamp(min=1)
    flat = (var <= 1e-12) | (n < 2)  # nothing to learn from: all equal (or a lone survivor)
    adv = centred / (var.sqrt() + eps) if scale_std else centred
    return torch.where(flat | ~k, 0, adv).reshape(-1).float()


def schema_track_mask(loss_mask, turn_ids, propose_turn):
    """Sampled tokens in turns <= the last propose_schema turn (B, T); a row with propose_turn < 0 is empty."""
    propose_turn = torch.as_tensor(propose_turn, device=turn_ids.device).reshape(-1, 1)  # (B, 1)
    return loss_mask * ((turn_ids <= propose_turn) & (propose_turn >= 0)).to(loss_mask.dtype)

# -----------------------------------------------------------------------------
# the clipped surrogate

def policy_loss(logp, old_logp, adv, mask, eps_low=0.2, eps_high=0.28, agg="token_mean", denom=None):
    """-min(ratio·A, clip(ratio, 1-eps_low, 1+eps_high)·A), ratio = exp(logp - old_logp); all (B, T).

    agg (how token losses become one number):
      "token_mean" sum / active tokens (DAPO; long sequences weigh more, every token counts the same)
      "seq_mean"   mean over sequences of each sequence's token mean (original GRPO)
      "dr_grpo"    sum / (sequences · a constant length) (Dr. GRPO; no length bias); pass that constant as denom
    denom: the normaliser (active tokens / active sequences / sequences·length) over the WHOLE step. When None it is
    this call's count summed over ranks (all-reduce), so per-rank losses add up to the single-process loss.
    Returns (loss, stats) with clip counts summed over active tokens."""
    ratio = torch.exp(logp - old_logp)
    surrogate = torch.min(ratio * adv, ratio.clamp(1 - eps_low, 1 + eps_high) * adv)
    per_token = -surrogate * mask  # (B, T)
    if agg == "token_mean":
        total = per_token.sum()
        count = mask.sum()
    elif agg == "seq_mean":
        tokens = mask.sum(1)
        total = (per_token.sum(1) / tokens.clamp(min=1)).sum()
        count = (tokens > 0).sum().to(mask.dtype)
    elif agg == "dr_grpo":
        if denom is None:
            raise ValueError("agg='dr_grpo' needs denom = num_sequences * max_len (a constant, e.g. the token budget)")
        total = per_token.sum()
        count = None
    else:
        raise ValueError(f"unknown agg {agg!r}; use token_mean, seq_mean or dr_grpo")
    if denom is None:
        denom = over_ranks(count.detach())
    loss = total / torch.as_tensor(denom, dtype=total.dtype).clamp(min=1)
    with torch.no_grad():
        active = mask > 0
        ratios = ratio[active]  # before clipping
        stats = {
            "clip_high": (active & (adv > 0) & (ratio > 1 + eps_high)).sum().item(),  # no gradient: ratio capped
            "clip_low": (active & (adv < 0) & (ratio < 1 - eps_low)).sum().item(),
            "approx_kl": (((ratio - 1) - (logp - old_logp)) * mask).sum().item(),  # k3(old || new), summed
            "ratio_sum": ratios.sum().item(),
            "ratio_min": ratios.min().item() if ratios.numel() else float("inf"),
            "ratio_max": ratios.max().item() if ratios.numel() else float("-inf"),
        }
    return loss, stats

# -----------------------------------------------------------------------------
# batch building and log-probs

def build_batch(trajs, pad_id=0, device="cpu"):
    """Right-padded (B, T) tensors from trajectories: input_ids, loss_mask, turn_ids (-1 = prompt/pad), old_logp."""
    T = max(len(t.token_ids) for t in trajs)

    def pad(xs, v):
        return list(xs) + [v] * (T - len(xs))
    return {
        "input_ids": torch.tensor([pad(t.token_ids, pad_id) for t in trajs], dtype=torch.long, device=device),
        "loss_mask": torch.tensor([pad(t.loss_mask, 0) for t in trajs], dtype=torch.float32, device=device),
        "turn_ids": torch.tensor([pad(t.turn_ids, -1) for t in trajs], dtype=torch.long, device=device),
        "old_logp": torch.tensor([pad(t.sample_logprobs, 0.0) for t in trajs], dtype=torch.float32, device=device),
    }


def token_logprobs(model, input_ids, mask, temperature=1.0, with_entropy=False):
    """log π(x_t | x_<t) at the sampling temperature, (B, T), 0 where mask == 0 (incl. t = 0); the LM head runs on
    the positions that predict an active token only (model.predicting_logits)."""
    target = mask[:, 1:] > 0  # position t-1 predicts token t
    logp = torch.zeros(mask.shape, dtype=torch.float32, device=input_ids.device)
    entropy = torch.zeros_like(logp) if with_entropy else None
    logits, tokens = predicting_logits(model, input_ids, mask, full_forward=is_fsdp(model))  # (N, V), (N,)
    logits = logits / temperature
    logz = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(1, tokens.unsqueeze(1)).squeeze(1) - logz
    logp[:, 1:][target] = picked
    if with_entropy:
        with torch.no_grad():
            p = torch.softmax(logits, dim=-1)
            entropy[:, 1:][target] = logz - (p * logits).sum(-1)
    return logp, entropy

# -----------------------------------------------------------------------------
# one GRPO update

@dataclass
class GRPOConfig:
    group_size: int = 8
    schema_lambda: float = 0.0        # λ of TRUST-SQL eq. 6 (0.25 in the trust recipe); 0 = single track
    naive_schema_weight: float = 0.0  # ablation: full += w·schema in ONE track (TRUST §5.1 uses 0.25)
    eps_low: float = 0.2
    eps_high: float = 0.28            # clip-higher (DAPO): > eps_low lets unlikely good tokens grow
    agg: str = "token_mean"           # token_mean | seq_mean | dr_grpo (see policy_loss)
    dr_grpo_len: int = 4096           # Dr. GRPO's constant length normaliser (the token budget)
    scale_std: bool = True            # False = Dr. GRPO advantages (no std division)
    adv_eps: float = 1e-6
    kl_beta: float = 0.0              # k3 KL to a frozen reference model; 0 = off (SQL-Trail, MTIR)
    temperature: float = 1.0          # sampling temperature: log-probs are recomputed at it
    micro_batch_size: int = 4
    ppo_epochs: int = 1               # passes over the same rollouts
    mini_batches: int = 1             # optimizer steps per pass, each on 1/mini_batches of the groups (verl's
                                      # ppo_mini_batch_size); >1 step per batch is what makes the clip act
    grad_clip: float = 1.0
    dynamic_sampling: bool = False    # DAPO: drop groups whose rewards are all equal (zero advantage everywhere)
    trajectory_filter: bool = False   # MTIR: drop bad-format / unanswered / truncated trajectories
    mask_truncated: bool = False      # keep truncated trajectories out of the loss (still in group statistics)
    recompute_old_logp: bool = True   # old policy = current weights before the update (else the sampler's logprobs)
    pad_id: int = 0


@dataclass
class Tracks:
    """The rewards and advantages of both tracks; schema is all zeros unless the schema track is on (dual)."""
    r_full: torch.Tensor      # (N,) float64, with --naive-schema-weight's share of the schema reward folded in
    r_schema: torch.Tensor    # (N,)
    adv_full: torch.Tensor    # (N,)
    adv_schema: torch.Tensor  # (N,)
    keep: torch.Tensor        # (N,) bool: rows MTIR's trajectory filter keeps (all without it)
    dual: bool

    def rows(self, index):
        """These rows' rewards and advantages (whole groups: advantages are per group)."""
        return Tracks(self.r_full[index], self.r_schema[index], self.adv_full[index], self.adv_schema[index],
                      self.keep[index], self.dual)

    @staticmethod
    def cat(parts):
        """One Tracks of the rows of parts, in order (DAPO's refill joins groups of several rollout rounds)."""
        return Tracks(*(torch.cat([getattr(p, name) for p in parts])
                        for name in ("r_full", "r_schema", "adv_full", "adv_schema", "keep")),
                      any(p.dual for p in parts))


def advantages(trajs, rewards, cfg: GRPOConfig) -> Tracks:
    """Group advantages of the terminal track and, when it is on, the schema track, over the rows the trajectory
    filter keeps."""
    N = len(trajs)
    r_full = torch.tensor([r["full"] for r in rewards], dtype=torch.float64)
    r_schema = torch.tensor([r.get("schema") or 0.0 for r in rewards], dtype=torch.float64)
    has_schema = any(r.get("schema") is not None for r in rewards)
    if cfg.naive_schema_weight:  # single track: the schema reward joins the terminal reward
        r_full = r_full + cfg.naive_schema_weight * r_schema
        has_schema = False
    dual = has_schema and cfg.schema_lambda > 0
    keep = torch.tensor([trajectory_ok(t) for t in trajs] if cfg.trajectory_filter else [True] * N, dtype=torch.bool)
    adv_full = group_advantages(r_full, cfg.group_size, cfg.adv_eps, cfg.scale_std, keep)
    adv_schema = torch.zeros(N)
    if dual:
        adv_schema = group_advantages(r_schema, cfg.group_size, cfg.adv_eps, cfg.scale_std, keep)
    return Tracks(r_full, r_schema, adv_full, adv_schema, keep, dual)


def grpo_step(model, optimizer, trajs, rewards, cfg: GRPOConfig, ref_model=None, tracks=None):
    """One GRPO update on group-major trajectories (group g = rows g·G .. g·G+G-1) and their reward dicts
    (REWARDS output: "full" and "schema"); tracks: their advantages where the caller has computed them already
    (practice.rollout_with_signal). Under torch.distributed every rank calls it with its own whole groups (any
    number, even none left after filtering); the returned metrics are global over ranks."""
    G = cfg.group_size
    N = len(trajs)
    if N % G or len(rewards) != N:
        raise ValueError(f"{N} trajectories / {len(rewards)} rewards do not form groups of {G}; rollout returns "
                         "group_size rows per example, group-major")
    if (N // G) % cfg.mini_batches:
        raise ValueError(f"{N // G} groups on this rank do not split into {cfg.mini_batches} mini-batches")
    if cfg.kl_beta > 0 and ref_model is None:
        raise ValueError("kl_beta > 0 needs ref_model (a frozen copy of the initial policy)")
    device = next(model.parameters()).device

    # --- advantages, then the rows the loss uses (each filter counts what it removed, over all ranks)
    if tracks is None:
        tracks = advantages(trajs, rewards, cfg)
    rows, flat_groups, truncated = loss_rows(trajs, tracks, cfg)
    counts = over_ranks(torch.tensor([int((~tracks.keep).sum()), int(flat_groups.sum()), int(truncated.sum()),
                                      int(rows.sum()), N], device=device)).tolist()
    if counts[3] == 0:  # every rank filtered everything: nothing to learn this step
        return step_metrics(tracks, rows, counts, [], None, cfg)

    # --- mini-batches of whole groups (one optimizer step each), each split into micro-batches of similar length
    per_mini = (N // G) // cfg.mini_batches
    idx = rows.nonzero().flatten().tolist()
    minis = [mini_batch(model, trajs, [i for i in idx if i // G // per_mini == b], tracks, truncated, cfg, device)
             for b in range(cfg.mini_batches)]
    fixed_logprobs(model, ref_model, minis, cfg)

    # --- the update: every micro-batch's loss carries the global normaliser, so their gradients just add up
    was_training = model.training
    model.train()
    totals = dict(loss_full=0.0, loss_schema=0.0, kl_ref=0.0, clip_high=0.0, clip_low=0.0, approx_kl=0.0,
                  entropy=0.0, sampler_kl=0.0, ratio_sum=0.0, ratio_min=float("inf"), ratio_max=float("-inf"),
                  grad_norm=0.0, optimizer_steps=0)
    for epoch in range(cfg.ppo_epochs):
        for mb in minis:
            if mb.forwarded == 0:  # on no rank: an empty step would still move the weights (momentum, decay)
                continue
            optimizer.zero_grad(set_to_none=True)
            for j in range(len(mb.micro)):
                loss = micro_batch_loss(model, mb, j, epoch, tracks.dual, cfg, totals)
                if loss.requires_grad:
                    loss.backward()
            sum_grads_over_ranks(model)
            totals["grad_norm"] += torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip).item()
            optimizer.step()
            totals["optimizer_steps"] += 1
    model.train(was_training)
    return step_metrics(tracks, rows, counts, minis, totals, cfg)


def micro_batch_loss(model, mb, j, epoch, dual, cfg, totals):
    """Micro-batch j's loss: the full track's clipped surrogate, plus λ times the schema track's, plus β times the KL
    to the reference; adds its statistics to totals. On the first pass its own log-probs are the old policy's when
    no earlier step has moved the weights."""
    filler = j >= len(mb.micro) - mb.fillers  # FSDP: forward and backward, zero loss
    m = mb.micro[j]
    mask = mb.loss_mask[m] * (not filler)
    logp, ent = token_logprobs(model, mb.input_ids[m], mask, cfg.temperature, with_entropy=epoch == 0)
    if mb.old[j] is None:
        mb.old[j] = logp.detach() if cfg.recompute_old_logp else mb.old_logp[m]
    if epoch == 0:
        totals["entropy"] += (ent * mask).sum().item()
        totals["sampler_kl"] += (k3_kl(mb.old_logp[m], logp.detach()) * mask).sum().item()  # KL(sampler || π)
    loss_full, st = policy_loss(logp, mb.old[j], mb.adv_full[m], mask, cfg.eps_low, cfg.eps_high, cfg.agg, mb.n_full)
    loss = loss_full
    totals["loss_full"] += loss_full.item()
    if dual:
        loss_schema, _ = policy_loss(logp, mb.old[j], mb.adv_schema[m], mb.schema_mask[m] * mask, cfg.eps_low,
                                     cfg.eps_high, cfg.agg, mb.n_schema)
        loss = loss + cfg.schema_lambda * loss_schema
        totals["loss_schema"] += loss_schema.item()
    if cfg.kl_beta > 0:
        kl = (k3_kl(logp, mb.ref[j]) * mask).sum() / max(mb.tokens, 1)  # token mean over the mini-batch
        loss = loss + cfg.kl_beta * kl
        totals["kl_ref"] += kl.item()
    for k in ("clip_high", "clip_low", "approx_kl", "ratio_sum"):
        totals[k] += st[k]
    totals["ratio_min"] = min(totals["ratio_min"], st["ratio_min"])
    totals["ratio_max"] = max(totals["ratio_max"], st["ratio_max"])
    return loss


def step_metrics(tracks, rows, counts, minis, totals, cfg):
    """The step's metrics, global over ranks: what the filters removed, rewards and advantages, and (unless the
    step was skipped, totals None) the losses, clipping, ratios, entropy and KLs per forwarded token or step."""
    N = len(rows)
    metrics = dict(zip(["filtered_trajectories", "filtered_groups", "masked_truncated", "rows", "trajectories"],
                       counts))
    metrics |= {"reward_full_mean": tracks.r_full.mean().item() if N else 0.0,
                "adv_full_abs_max": tracks.adv_full.abs().max().item() if N else 0.0,
                "adv_full_abs_mean": tracks.adv_full[rows].abs().mean().item() if rows.any() else 0.0}
    if tracks.dual:
        metrics |= {"reward_schema_mean": tracks.r_schema.mean().item(),
                    "adv_schema_abs_max": tracks.adv_schema.abs().max().item() if N else 0.0}
    if totals is None:
        return metrics | {"loss": 0.0, "tokens": 0, "skipped": True}
    metrics["schema_tokens"] = int(sum(mb.schema_tokens for mb in minis))
    lows = {"ratio_min": totals.pop("ratio_min")}
    highs = {"ratio_max": totals.pop("ratio_max")}
    steps = totals.pop("optimizer_steps")
    grad_norm = totals.pop("grad_norm")
    device = minis[0].input_ids.device
    total = stats_over_ranks(totals, lows, highs, device)
    forwarded = sum(mb.forwarded for mb in minis)
    passes = max(forwarded * cfg.ppo_epochs, 1)  # stats are over forwarded tokens
    per_step = max(steps, 1)
    metrics |= {
        "loss_full": total["loss_full"] / per_step, "loss_schema": total["loss_schema"] / per_step,
        "kl_ref": total["kl_ref"] / per_step, "grad_norm": grad_norm / per_step, "optimizer_steps": steps,
        "clip_frac_high": total["clip_high"] / passes, "clip_frac_low": total["clip_low"] / passes,
        "approx_kl": total["approx_kl"] / passes, "entropy": total["entropy"] / max(forwarded, 1),
        "sampler_kl": total["sampler_kl"] / max(forwarded, 1), "tokens": int(sum(mb.tokens for mb in minis)),
        "skipped": False, "forwarded_tokens": int(forwarded), "ratio_mean": total["ratio_sum"] / passes,
        "ratio_min": total["ratio_min"] if steps else 1.0, "ratio_max": total["ratio_max"] if steps else 1.0,
    }
    metrics["loss"] = metrics["loss_full"] + cfg.schema_lambda * metrics["loss_schema"]
    return metrics

# -----------------------------------------------------------------------------
# the variants: which rows the loss uses (MTIR's trajectory filter, DAPO's dynamic sampling, truncation
# masking) and the KL term; the aggregation modes are policy_loss's agg


def trajectory_ok(traj) -> bool:
    """MTIR-style quality rule: every turn well-formed, a final answer, not truncated."""
    ep = traj.episode
    return all(ep.turn_valid) and ep.final_sql is not None and traj.stop_reason not in TRUNCATED


def group_signal(tracks: Tracks, group_size):
    """(groups,) bool: does a group move the policy at all, some kept row with a nonzero advantage on a track the
    loss uses? DAPO's refill (practice.rollout_with_signal) asks this of fresh groups; grpo_step drops the rest."""
    return ((tracks.adv_full != 0) | (tracks.adv_schema != 0)).reshape(-1, group_size).any(1)


def loss_rows(trajs, tracks, cfg):
    """(N,) bool each: the rows the loss uses (kept by the trajectory filter, in a group with signal under dynamic
    sampling), the groups dynamic sampling drops (groups,), the kept rows whose truncation masks them out."""
    G = cfg.group_size
    rows = tracks.keep.clone()
    flat_groups = torch.zeros(len(trajs) // G, dtype=torch.bool)
    if cfg.dynamic_sampling:  # DAPO: a group with no signal on any track only dilutes the token mean
        flat_groups = ~group_signal(tracks, G)
        rows &= ~flat_groups.repeat_interleave(G)
    truncated = torch.tensor([t.stop_reason in TRUNCATED for t in trajs], dtype=torch.bool)
    truncated &= rows if cfg.mask_truncated else torch.zeros_like(rows)
    return rows, flat_groups, truncated


def k3_kl(logp, ref_logp):
    """Per-token k3 estimator of KL(π || π_ref): exp(ref - logp) - (ref - logp) - 1 >= 0."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1

# -----------------------------------------------------------------------------
# mini-batches: the rows of one optimizer step, their micro-batches and normalisers


@dataclass
class MiniBatch:
    input_ids: torch.Tensor    # (B, T) right-padded rows that carry a signal (or one placeholder row)
    loss_mask: torch.Tensor    # (B, T) the sampled tokens the loss uses
    schema_mask: torch.Tensor  # (B, T) those of turns up to the last propose_schema (dual track)
    adv_full: torch.Tensor     # (B, T) each token's advantage, 0 where masked
    adv_schema: torch.Tensor   # (B, T)
    old_logp: torch.Tensor     # (B, T) the sampler's log-probs
    micro: list                # [(rows, columns)] slices of each micro-batch, right padding cut; FSDP fillers last
    fillers: int               # trailing micro-batches that forward row 0 with a zero loss (FSDP)
    n_full: float              # the surrogate's normaliser over the mini-batch on all ranks (policy_loss's denom)
    n_schema: float
    tokens: float              # active tokens, all ranks
    schema_tokens: float
    forwarded: float           # active tokens of the rows that carry a signal, all ranks
    old: list = None           # per micro-batch: the old policy's log-probs (None: the first pass's own)
    ref: list = None           # per micro-batch: the reference's log-probs (KL only)


def mini_batch(model, trajs, idx, tracks, truncated, cfg, device):
    """The MiniBatch of rows idx: right-padded tensors, micro-batches of rows of similar length (each cut to its
    longest row), and the mini-batch's global normalisers (all micro-batches, all ranks)."""
    idx = sorted(idx, key=lambda i: len(trajs[i].token_ids))
    b = build_batch([trajs[i] for i in idx] or [_placeholder_row(cfg.pad_id)], cfg.pad_id, device)
    loss_mask = b["loss_mask"] * ((~truncated[idx]).float().to(device).unsqueeze(1) if idx else 0.0)
    propose = torch.tensor([trajs[i].episode.propose_turn for i in idx] or [-1], device=device)
    schema_mask = schema_track_mask(loss_mask, b["turn_ids"], propose) if tracks.dual else torch.zeros_like(loss_mask)

    def per_row(adv):  # (B, 1)
        return (adv[idx] if idx else torch.zeros(1)).to(device).unsqueeze(1)
    adv_full = per_row(tracks.adv_full) * loss_mask  # (B, T)
    adv_schema = per_row(tracks.adv_schema) * schema_mask

    def denom(mask):
        if cfg.agg == "token_mean":
            return mask.sum()
        if cfg.agg == "seq_mean":
            return (mask.sum(1) > 0).sum().float()
        return torch.tensor(float(mask.shape[0] * cfg.dr_grpo_len), device=device) if idx else mask.sum() * 0
    # a row with no active token, or (without a KL term) whose tokens all have advantage 0 on both tracks, adds
    # nothing to the gradient: it counts in the normalisers but is never forwarded (in a group of 4 mostly-wrong
    # rollouts, most rows; the advantages are already masked)
    live = loss_mask.any(1) if cfg.kl_beta > 0 else ((adv_full != 0) | (adv_schema != 0)).any(1)
    counts = [denom(loss_mask), denom(schema_mask), loss_mask.sum(), schema_mask.sum(), loss_mask[live].sum()]
    n_full, n_schema, tokens, schema_tokens, forwarded = over_ranks(torch.stack(counts).float()).tolist()
    kept = live.nonzero().flatten().tolist()
    idx = [idx[j] for j in kept]
    tensors = [x[kept or [0]] for x in (b["input_ids"], loss_mask, schema_mask, adv_full, adv_schema, b["old_logp"])]
    if not idx:  # one placeholder row (FSDP's filler passes forward it) with nothing to learn
        tensors[1:5] = [torch.zeros_like(x) for x in tensors[1:5]]
    lengths = [len(trajs[i].token_ids) for i in idx]
    micro = [(slice(s, s + cfg.micro_batch_size), slice(0, max(lengths[s: s + cfg.micro_batch_size])))
             for s in range(0, len(idx), cfg.micro_batch_size)]  # (rows, columns): right padding is cut off
    fillers = fsdp_fillers(model, len(micro), device)  # each forwards row 0 with a zero loss
    micro += [(slice(0, 1), slice(None))] * fillers
    return MiniBatch(*tensors, micro=micro, fillers=fillers, n_full=n_full, n_schema=n_schema, tokens=tokens,
                     schema_tokens=schema_tokens, forwarded=forwarded)


def fixed_logprobs(model, ref_model, minis, cfg):
    """Each micro-batch's log-probs that stay fixed through the update: the reference's (KL), and the old policy's
    where a pass runs on weights an earlier optimizer step already moved (the old policy is the weights before the
    first step); elsewhere the first pass's own log-probs stand in (micro_batch_loss)."""
    lagged = cfg.mini_batches * cfg.ppo_epochs > 1
    with torch.no_grad():
        for mb in minis:
            mb.old = [None] * len(mb.micro)
            mb.ref = []
            if cfg.kl_beta > 0:
                mb.ref = [token_logprobs(ref_model, mb.input_ids[m], mb.loss_mask[m], cfg.temperature)[0]
                          for m in mb.micro]
            if lagged and cfg.recompute_old_logp:
                mb.old = [token_logprobs(model, mb.input_ids[m], mb.loss_mask[m], cfg.temperature)[0]
                          for m in mb.micro]


def _placeholder_row(pad_id):
    """What a rank left with no row forwards: one pad token with nothing to learn (FSDP's filler passes need a row)."""
    return SimpleNamespace(token_ids=[pad_id], loss_mask=[0], turn_ids=[-1], sample_logprobs=[0.0])

# -----------------------------------------------------------------------------

if __name__ == "__main__":
    from cli import ArgumentParser
    from model import load_model
    parser = ArgumentParser(description=__doc__)
    parser.add_argument("--group-size", type=int, default=4, help="rows per group")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per synthetic trajectory")
    parser.add_argument("--seed", type=int, default=0, help="model init and token ids")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    model, tok = load_model("tiny", seed=args.seed)
    G = args.group_size
    T = args.seq_len
    P = T // 4  # prompt tokens
    turn = [-1] * P + [0] * ((T - P) // 2) + [1] * (T - P - (T - P) // 2)  # turn 0 proposes a schema, turn 1 answers
    ep = SimpleNamespace(propose_turn=0, turn_valid=[True, True], final_sql="SELECT 1")
    trajs = [SimpleNamespace(token_ids=torch.randint(0, len(tok), (T,)).tolist(), turn_ids=turn, episode=ep,
                             loss_mask=[int(t >= 0) for t in turn], sample_logprobs=[0.0] * T, stop_reason="answer")
             for _ in range(2 * G)]
    rewards = [{"full": float(i % 3 == 0) + 0.1, "schema": float(i % 2)} for i in range(2 * G)]
    metrics = grpo_step(model, torch.optim.AdamW(model.parameters(), lr=1e-5), trajs, rewards,
                        GRPOConfig(group_size=G, schema_lambda=0.25))
    print({k: round(v, 4) if isinstance(v, float) else v for k, v in metrics.items()})
