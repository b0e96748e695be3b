"""
The GPU check's parts 2-8, one subcommand each (tests/gpu_check.sh runs every part as its own command, so a part that
fails or hangs costs only itself): the collective paths forced at world 1, sampled rollouts at several row counts,
memory sizing after a cached 10 GB block, a 16k-token rollout beside a ballast tensor, a failed CUDA graph capture,
FSDP2 at world 1, and a 7B GRPO step with LoRA. Random weights throughout: the tiny fixture, or Qwen3-0.6B's shape
(model.SHAPES) where size matters. Each part prints one line per result and how long it took; it exits 1 when a result
fails, and 77 (skipped) when it needs CUDA and --device is cpu (the check's --dry-run runs the rest on the CPU,
small).

    python -u tests/gpu_parts.py collectives --device cuda
    python -u tests/gpu_parts.py --help            # the parts, in the order the check runs them
"""
import contextlib
import io
import os
import socket
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script, sys.path[0] is tests/ (test_rollout's helpers come from there)

from cli import ArgumentParser, positive_int  # noqa: E402  (the repository's root is on the path only now)

SKIPPED = 77  # the exit status that tells gpu_check.sh a part did not apply here (automake's convention)
SHAPE = "Qwen3-0.6B"  # the random model of the parts whose cost or memory depends on a real size


class Skip(Exception):
    """The part needs what this device lacks; its message says what."""

# -----------------------------------------------------------------------------
# shared pieces


def examples():
    """The gym's dev questions (built on first use: the GPU machine gets no data/gym, which git ignores)."""
    import env
    from data.gym.prepare import ensure_gym
    return env.load_examples(ensure_gym() / "dev.jsonl")


def tiny(device, dtype=None):
    """(model, tokenizer): the tiny test fixture on `device`, fp32 unless `dtype` says otherwise."""
    import torch
    from model import load_model
    return load_model("tiny", device=device, dtype=dtype or torch.float32)


def qwen_shape(device):
    """(model, tokenizer): a random Qwen3-0.6B-shaped model in bf16 with SmolLM2's tokenizer, as bench.py runs."""
    import torch
    from model import build_random, smollm2_tokenizer
    torch.manual_seed(0)
    return build_random(SHAPE, dtype=torch.bfloat16, device=device).eval(), smollm2_tokenizer()


def group_size(device):
    """Rollouts per question: 4 on a GPU, 2 on the CPU (the check's --dry-run, where decoding is slow)."""
    return 4 if device == "cuda" else 2


def sync(device):
    import torch
    if device == "cuda":
        torch.cuda.synchronize()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_rank_group(device):
    """A real process group of one rank with the backends train.py's group has on this device
    (distributed.group_backends: cpu:gloo,cuda:nccl on CUDA; two ranks cannot share one GPU under NCCL)."""
    import torch
    import torch.distributed as dist
    from distributed import group_backends
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group(group_backends(device), rank=0, world_size=1)
    print(f"process group: {dist.get_backend()} over {dist.get_world_size()} rank")


def close_group():
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()


def first_line(error):
    return (str(error).strip().splitlines() or [""])[0][:200]


def attempt(label, fn):
    """Run one check: print `label: ok (what it returned)` or `label: FAILED (the error)` with the traceback's last
    frames; True when it passed."""
    try:
        detail = fn()
    except Exception as e:  # every failure is a result to report; the next check still runs
        print(f"{label}: FAILED ({type(e).__name__}: {first_line(e)})")
        traceback.print_exc(limit=-4, file=sys.stdout)
        return False
    print(f"{label}: ok" + (f" ({detail})" if detail else ""))
    return True


def scripted_rollout(model, tokenizer, exs, *, group_size, temperature, seed=0, free=24, **kw):
    """rollout.rollout on scripted work: in turn 0 each row calls a tool (1-4 result rows: ragged observations), in
    turn 1 the model samples free + 4 * (row % 4) tokens and ends with eos, turn 2 is the model's own (on a GPU; the
    CPU, where decoding is slow, stops after turn 1)."""
    from rollout import rollout
    from test_rollout import scripted, trust_call
    rows = len(exs) * group_size
    scripts = {r: [trust_call(f"SELECT * FROM sqlite_master LIMIT {r % 4 + 1}", exs[r // group_size]["db_id"]),
                   free + 4 * (r % 4)] for r in range(rows)}
    turns = 2 if next(model.parameters()).device.type == "cpu" else 3
    settings = dict(max_turns=turns, max_new_tokens=96, max_total_tokens=2048, top_p=1.0, schema_mode="none") | kw
    return rollout(model, tokenizer, exs, "trust", group_size=group_size, temperature=temperature, seed=seed,
                   force=scripted(tokenizer, scripts), **settings)


def sampled_tokens(trajs):
    return sum(sum(t.loss_mask) for t in trajs)


def differing(trajs, reference):
    """(trajectories whose tokens differ from the reference's, sampled tokens that differ position by position)."""
    rows = sum(a.token_ids != b.token_ids for a, b in zip(trajs, reference))
    tokens = 0
    for a, b in zip(trajs, reference):
        mine = [tok for tok, m in zip(a.token_ids, a.loss_mask) if m]
        theirs = [tok for tok, m in zip(b.token_ids, b.loss_mask) if m]
        tokens += sum(x != y for x, y in zip(mine, theirs)) + abs(len(mine) - len(theirs))
    return rows, tokens

def agreement(trajs, reference):
    """The largest |log-prob difference| of the tokens before each trajectory's first differing token: rounding-sized
    means the numerics of another batch shape moved a draw that sat at a boundary of the inverse CDF (a random
    model's next-token distribution is near uniform over 49,152 tokens, full of such boundaries)."""
    worst = 0.0
    for a, b in zip(trajs, reference):
        same = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), len(a.token_ids))
        worst = max([worst] + [abs(x - y) for x, y in zip(a.sample_logprobs[:same], b.sample_logprobs[:same])])
    return worst

# -----------------------------------------------------------------------------
# 2. the collective paths of train.py, eval.py and grpo.py, forced at world 1


def part_collectives(args):
    """Each collective path of issue 113's item 1, called for real on a one-rank group with train.py's backends:
    distributed.world_size says 2 (over_ranks asks its own module), so over_ranks reduces over the group instead of
    returning its input. Host tensors go through gloo, device tensors through NCCL."""
    import torch
    import torch.distributed as dist

    import distributed
    import eval as evaluation
    import practice
    import train
    from distributed import over_ranks, stats_over_ranks
    from grpo import GRPOConfig, grpo_step
    from rewards import REWARDS
    from rollout import RolloutConfig
    from sft import agent_tokens
    device = args.device
    one_rank_group(device)

    def two_ranks():
        return 2

    def gather_over_group(obj):  # all_ranks (where it exists) sized by the real group: one slot, not world_size()'s 2
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, obj)
        return gathered
    real_world_size = distributed.world_size
    distributed.world_size = two_ranks
    gathers = {m: m.all_ranks for m in (distributed, evaluation, practice, train) if hasattr(m, "all_ranks")}
    for module in gathers:  # imported by name into eval, practice and train: patched where each one looks it up
        module.all_ranks = gather_over_group
    model, tokenizer = tiny(device)
    exs = examples()
    group = group_size(device)
    trajs = scripted_rollout(model, tokenizer, exs[:2], group_size=group, temperature=1.0, seed=1)
    results = []

    def same(reduced, x):
        """At one rank a sum, minimum or maximum is the input itself, on the input's device."""
        if reduced.device != x.device or not torch.equal(reduced, x):
            raise AssertionError(f"reduced {reduced.tolist()} on {reduced.device}, sent {x.tolist()} on {x.device}")
        return f"{x.dtype} on {x.device}"

    def sft_tokens():  # train.py's SFT loop: over_ranks(torch.tensor(agent_tokens(mine)))
        x = torch.tensor(agent_tokens([(t.token_ids, t.loss_mask) for t in trajs]))
        return same(over_ranks(x), x)

    def sft_loss():  # train.py's SFT loop: over_ranks(torch.tensor(loss_sum, dtype=torch.float64))
        x = torch.tensor(1.25, dtype=torch.float64)
        return same(over_ranks(x), x)

    def host_int():
        x = torch.tensor([3, 1, 4], dtype=torch.int64)
        return same(over_ranks(x), x)

    def metrics():
        rewards = [REWARDS["trust"](t, t.example) for t in trajs]
        out = practice.rollout_metrics(trajs, rewards)
        return f"{len(out)} means, turns {out['turns']:.2f}, sampled_tokens {out['sampled_tokens']:.1f}"

    def eval_counts():  # world=1 as the argument: it shards the questions by it, and the group has one rank
        cfg = RolloutConfig(protocol="trust", schema_mode="none", max_turns=2, max_new_tokens=16,
                            max_total_tokens=2048)
        out = evaluation.evaluate_ex(model, tokenizer, {"dev": exs[:2]}, cfg, 8, 0, 0, 1)["dev"]
        gathered = ", its per-question gather through all_ranks too" if evaluation in gathers else ""
        return f"dev EX {out['ex']:.2f} over {out['n']} questions{gathered}"

    def object_gather():  # what evaluate_ex's and the filter's per-question gathers call at world > 1
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, {ex["id"]: True for ex in exs[:2]})
        return f"{len(gathered[0])} entries back"

    def filter_rates():  # practice.pass_rates: the difficulty filter's and the practice set's per-question rates
        cfg = RolloutConfig(protocol="trust", schema_mode="none", max_turns=2, max_new_tokens=16,
                            max_total_tokens=2048, temperature=1.0)
        rates, _, _ = practice.pass_rates(model, tokenizer, exs[:2], cfg, REWARDS["trust"], 2, batch_size=8, seed=0)
        return f"{len(rates)} pass rates" + (", gathered through all_ranks" if practice in gathers else "")

    def records():  # what RL's loop and the practice measurement gather for rollouts.jsonl (rank 0 writes them)
        from report import trajectory_record
        rewards = [REWARDS["trust"](t, t.example) for t in trajs]
        mine = [trajectory_record(t, r, tokenizer, stage="rl", step=1) for t, r in zip(trajs, rewards)]
        parts = train.all_ranks(mine) if train in gathers else gather_over_group(mine)
        return f"{sum(map(len, parts))} trajectory records back"

    def device_counts():  # grpo_step's counts and normalisers
        x = torch.tensor([5, 0, 2], device=device)
        return same(over_ranks(x), x)

    def device_stats():
        out = stats_over_ranks({"loss": 1.5}, {"ratio_min": 0.5}, {"ratio_max": 2.0}, device)
        if out != {"loss": 1.5, "ratio_min": 0.5, "ratio_max": 2.0}:
            raise AssertionError(f"stats came back as {out}")
        return f"float64 on {device}"

    def update():  # every collective of an update, the gradient all-reduce (sum_grads_over_ranks) among them
        rewards = [{"full": float(i % group == 0), "schema": 0.0} for i in range(len(trajs))]
        cfg = GRPOConfig(group_size=group, schema_lambda=0.0, pad_id=tokenizer.pad_token_id, micro_batch_size=4)
        out = grpo_step(model, torch.optim.SGD(model.parameters(), lr=1e-3), trajs, rewards, cfg)
        return f"loss {out['loss']:.4f}, {out['tokens']} tokens, grad norm {out['grad_norm']:.3g}"

    checks = [("train SFT token count, host float32 over_ranks", sft_tokens),
              ("train SFT loss sum, host float64 over_ranks", sft_loss),
              ("host int64 over_ranks", host_int),
              ("practice.rollout_metrics, host float64", metrics),
              ("eval.evaluate_ex counts, host float64", eval_counts),
              ("object gather, dist.all_gather_object", object_gather),
              ("practice.pass_rates, the filter's and the practice set's rates", filter_rates),
              ("train's rollouts.jsonl records, object gather", records),
              ("grpo counts, device int64 over_ranks", device_counts),
              ("grpo stats_over_ranks, device float64", device_stats),
              ("grpo_step, device counts and gradient all-reduce", update)]
    try:
        for label, fn in checks:
            results.append(attempt(f"collective {label}", fn))
    finally:
        distributed.world_size = real_world_size
        for module, real in gathers.items():
            module.all_ranks = real
        close_group()
    return all(results)

# -----------------------------------------------------------------------------
# 3. sampled rollouts decoded at different row counts


def part_row_counts(args):
    """The same sampled rollouts (same seed) decoded max_rows at a time, against all rows at once. The draws hash
    (seed, row, position), so only the numerics of other batch shapes can change a token; the count is reported,
    not asserted."""
    import torch
    device = args.device
    model, tokenizer = tiny(device, torch.bfloat16 if device == "cuda" else None)  # bf16: what train.py decodes
    exs = examples()[:8 if device == "cuda" else 4]
    group = group_size(device)
    everything = len(exs) * group
    fewer = (everything // 2, 4 if device == "cuda" else 2)  # cuda: 32 rows, then 16 and 4 at a time
    runs = {}
    for max_rows in (everything, *fewer):
        sync(device)
        t0 = time.perf_counter()
        runs[max_rows] = scripted_rollout(model, tokenizer, exs, group_size=group, temperature=0.8, seed=7,
                                          max_rows=max_rows, top_p=0.95)
        sync(device)
        dt = time.perf_counter() - t0
        print(f"max_rows {max_rows:2d}: {len(runs[max_rows])} trajectories, {sampled_tokens(runs[max_rows]):,} "
              f"sampled tokens in {dt:.1f} s")
    for max_rows in fewer:
        rows, tokens = differing(runs[max_rows], runs[everything])
        print(f"max_rows {max_rows:2d} against all {everything} rows at once: {rows} of {everything} trajectories "
              f"differ ({tokens} of {sampled_tokens(runs[everything]):,} sampled tokens); the log-probs recorded "
              f"before each one's first difference agree to {agreement(runs[max_rows], runs[everything]):.1e}")
    return True

# -----------------------------------------------------------------------------
# 4. memory sizing after a 10 GB allocate-and-free


def part_memory_sizing(args):
    """memory.free_memory and memory.cache_rows before a 10 GB block, while it is held, after it is freed (PyTorch's
    allocator keeps it cached: mem_get_info no longer counts it) and after empty_cache. The cached block must count
    as free: cache_rows after the free must match cache_rows before."""
    if args.device != "cuda":
        raise Skip("sizing PyTorch's CUDA allocator cache needs a GPU; the CPU has no such cache")
    from types import SimpleNamespace

    import torch

    import memory
    from model import shape_config
    device = torch.device("cuda")
    holder = SimpleNamespace(config=shape_config(SHAPE))  # cache_rows reads the config alone
    per_row = memory.kv_bytes_per_row(holder.config, 16384, torch.bfloat16)

    def look(label):
        raw = torch.cuda.mem_get_info(device)[0]
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        with contextlib.redirect_stdout(io.StringIO()):  # its note repeats these numbers
            rows = memory.cache_rows(holder, 4096, device, torch.bfloat16, 16384)
        print(f"{label:22s} mem_get_info free {raw / 1e9:6.2f} GB, cached unused {cached / 1e9:5.2f} GB, "
              f"memory.free_memory {memory.free_memory(device) / 1e9:6.2f} GB, cache_rows {rows} "
              f"({SHAPE} bf16, 16,385 slots, {per_row / 1e9:.2f} GB a row)")
        return raw, rows
    torch.cuda.empty_cache()
    raw_before, before = look("before")
    block = torch.empty(10 * 10 ** 9, dtype=torch.uint8, device=device)
    look("10 GB held")
    del block
    raw_after, after = look("10 GB freed (cached)")
    torch.cuda.empty_cache()
    look("after empty_cache")
    cached = raw_before - raw_after > 9e9  # the allocator did keep the block
    print(f"the freed block {'stayed cached' if cached else 'went back to the driver'}; cache_rows {before} before, "
          f"{after} after the free: the cached block is {'counted' if after >= before else 'NOT counted'}")
    return after >= before

# -----------------------------------------------------------------------------
# 5. a 16k-token rollout with long observations beside a ballast


LONG_SQL = ("WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < {n}) "
            "SELECT x, (x * 982451653) % 1000000007 AS a, (x * 2654435761) % 998244353 AS b FROM c")


def part_long_context(args):
    """Rows that call a tool every turn and get about 3,700 tokens of digits back each time, until the 16,384-token
    limit ends them, decoded while a ballast tensor leaves only --free-gb free (CUDA): the cache takes the rows that
    fit beside memory.CACHE_HEADROOM, and everything else the rollout allocates (prefill forwards, logits,
    sampling) must stay within that headroom. Records the peak beyond the weights, the ballast and the KV cache."""
    import torch

    import memory
    import protocols
    from rollout import rollout
    from test_rollout import scripted, trust_call
    device = args.device
    on_cuda = device == "cuda"
    model, tokenizer = qwen_shape(device) if on_cuda else tiny(device)
    rows = args.rows if on_cuda else 2
    limit = 16384
    exs = examples()[:rows]
    variant = protocols.protocol_variant("trust", 0, 400, 0)  # 400 result rows: the 4,000-character cap binds
    scripts = {r: [trust_call(LONG_SQL.format(n=400 - 10 * r), ex["db_id"])] * 8 for r, ex in enumerate(exs)}
    dtype = next(model.parameters()).dtype
    ballast = None
    if on_cuda:
        torch.cuda.empty_cache()
        room = memory.free_memory(torch.device(device))
        ballast = torch.empty(max(0, int(room - args.free_gb * 1e9)), dtype=torch.uint8, device=device)
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        slots = memory.cache_rows(model, rows, device, dtype, limit)  # rollout's own sizing: nothing allocates between
        print(f"ballast {ballast.numel() / 1e9:.1f} GB leaves {memory.free_memory(torch.device(device)) / 1e9:.2f} GB "
              f"free; the KV cache takes {slots} of {rows} rows")
    t0 = time.perf_counter()
    try:
        trajs = rollout(model, tokenizer, exs, variant, group_size=1, max_turns=8, max_new_tokens=160,
                        max_total_tokens=limit, temperature=0.0, top_p=1.0, schema_mode="none", seed=0,
                        force=scripted(tokenizer, scripts))
    except torch.OutOfMemoryError as e:
        print(f"rollout ran out of memory: {first_line(e)}")
        return False
    sync(device)
    lengths = [len(t.token_ids) for t in trajs]
    print(f"{rows} rows, {sum(t.num_tool_calls for t in trajs)} tool calls in {time.perf_counter() - t0:.1f} s; "
          f"lengths {lengths}, stops {sorted({t.stop_reason for t in trajs})}")
    ok = max(lengths) > limit - 4000 and all(t.num_tool_calls >= 3 for t in trajs)
    if not ok:
        print("the rows did not fill the context as scripted")
    if not on_cuda:
        print("peak memory: not measured on the CPU (no ballast; the part's wiring only)")
        return ok
    cache = slots * memory.kv_bytes_per_row(model.config, limit, dtype)
    beyond = torch.cuda.max_memory_allocated() - base - cache
    within = beyond <= memory.CACHE_HEADROOM
    print(f"peak beyond the weights, the ballast and the KV cache ({cache / 1e9:.2f} GB): {beyond / 1e9:.2f} GB, "
          f"against CACHE_HEADROOM {memory.CACHE_HEADROOM / 1e9:.2f} GB: {'within' if within else 'OVER'}")
    del ballast
    return ok and within

# -----------------------------------------------------------------------------
# 6. a failed CUDA graph capture


def part_capture_fallback(args):
    """engine.capture made to raise, as a GPU or torch build without graph support would: which fallback line
    engine.make_decoder prints and its tokens/s, against the graphs it replaces; then the decode kernel made to
    fail too, which leaves masked SDPA. Greedy, so all three must decode the same tokens."""
    if args.device != "cuda":
        raise Skip("decode='graphs' captures CUDA graphs, which need a GPU")
    import engine
    device = args.device
    model, tokenizer = qwen_shape(device)
    exs = examples()[:8]

    def timed(label):
        engine._notes_said = set()  # the fallback's line prints once per process otherwise
        said = io.StringIO()
        sync(device)
        t0 = time.perf_counter()
        with contextlib.redirect_stdout(said):
            trajs = scripted_rollout(model, tokenizer, exs, group_size=2, temperature=0.0, free=40, decode="graphs")
        sync(device)
        dt = time.perf_counter() - t0
        lines = [line for line in said.getvalue().splitlines() if "capture failed" in line]
        print(f"{label}: {sampled_tokens(trajs) / dt:,.0f} tokens/s ({sampled_tokens(trajs):,} in {dt:.2f} s)")
        print(f"  printed: {lines[0] if lines else '(no fallback line)'}")
        return trajs, " ".join(lines)

    def broken_capture(model, cache, decoder):
        raise RuntimeError("injected: operation not permitted when stream is capturing")
    real_capture = engine.capture
    real_step = engine.decode_step

    def broken_kernel_step(model, cache, rows, kernel="sdpa", key_ranges=None):
        if kernel != "sdpa":
            raise RuntimeError(f"injected: the {kernel} decode kernel failed")
        return real_step(model, cache, rows, kernel, key_ranges)
    scripted_rollout(model, tokenizer, exs[:1], group_size=2, temperature=0.0, free=4, decode="static")  # warm-up
    graphs, _ = timed("graphs (the normal path)")
    try:
        engine.capture = broken_capture
        eager, said_eager = timed("capture fails: the same step eagerly")
        engine.decode_step = broken_kernel_step
        masked, said_masked = timed("capture and kernel fail: masked SDPA")
    finally:
        engine.capture = real_capture
        engine.decode_step = real_step
    rows, tokens = differing(eager, graphs)  # the same kernels and shapes: the same tokens
    print(f"eager fallback against graphs: {rows} of {len(graphs)} trajectories differ ({tokens} tokens)")
    ok = "decoding the same" in said_eager and "masked SDPA" in said_masked and rows == 0
    rows, tokens = differing(masked, graphs)  # another attention kernel: bf16 rounding may flip a near tie
    print(f"masked-SDPA fallback against graphs: {rows} of {len(graphs)} trajectories differ ({tokens} tokens; "
          "reported, not required: another kernel)")
    return ok

# -----------------------------------------------------------------------------
# 7. FSDP2 at world 1: rollout, update, refresh, rollout


def part_fsdp(args):
    """train.py's FSDP2 path on a one-rank group: the full decode copy made before sharding, distributed.distribute
    (activation checkpointing on CUDA, distributed.shard), a rollout from the copy, a grpo_step on the sharded model
    under bf16 autocast (train.rl_update), the copy refreshed (model.refresh_sampler), and a second rollout."""
    import copy
    import functools
    from contextlib import nullcontext

    import torch

    import train
    from distributed import distribute, is_fsdp
    from grpo import GRPOConfig
    from model import TORCH_DTYPES, refresh_sampler, resolve_dtype
    device = args.device
    one_rank_group(device)
    try:
        model, tokenizer = tiny(device)  # fp32 master weights, as train.py loads them
        precision = resolve_dtype("auto", device)
        bf16 = precision == "bf16"
        sampler = copy.deepcopy(model).to(TORCH_DTYPES[precision])  # train.main: the copy is made before sharding
        # world=2 only takes distribute's FSDP branch (train.py shards when --fsdp and world > 1); fully_shard's mesh
        # is the group's own, one rank
        distribute(model, True, 2, device, bf16)
        if not is_fsdp(model):
            print("distribute did not shard the model")
            return False
        shards = sum(type(p).__name__ == "DTensor" for p in model.parameters())
        names = ({n for n, _ in sampler.named_parameters()}, {n for n, _ in model.named_parameters()})
        print(f"sharded: {shards} DTensor parameters; the decode copy ({precision}) has {len(names[0])}")
        if names[0] != names[1]:
            print("the refresh copies the model's parameters into the copy by name: the names must match")
            return False
        exs = examples()[:2]
        group = group_size(device)
        first = scripted_rollout(sampler, tokenizer, exs, group_size=group, temperature=1.0, seed=3)
        print(f"rollout 1: {len(first)} trajectories, {sampled_tokens(first)} sampled tokens")
        rewards = [{"full": float(i % group == 0), "schema": 0.0} for i in range(len(first))]
        cfg = GRPOConfig(group_size=group, schema_lambda=0.0, pad_id=tokenizer.pad_token_id, micro_batch_size=4,
                         recompute_old_logp=True)
        autocast = functools.partial(torch.autocast, torch.device(device).type, torch.bfloat16) if bf16 \
            else nullcontext
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model.train()
        out = train.rl_update(model, opt, first, rewards, cfg, None, None, autocast)
        print(f"grpo_step: loss {out['loss']:.4f}, {out['tokens']} tokens, grad norm {out['grad_norm']:.3g}, "
              f"{out['optimizer_steps']} optimizer step")
        before = [s.detach().clone() for s in sampler.parameters()]
        refresh_sampler(sampler, model)  # what train.main calls before every rollout
        moved = max((s - b).abs().max().item() for s, b in zip(sampler.parameters(), before))
        off = max((s.float() - p.full_tensor().to(s.dtype).float()).abs().max().item()
                  for s, p in zip(sampler.parameters(), model.parameters()))
        print(f"refresh: the decode copy moved by up to {moved:.2e}; it differs from the gathered shards by {off:.1e}")
        second = scripted_rollout(sampler, tokenizer, exs, group_size=group, temperature=1.0, seed=3)
        rows, tokens = differing(second, first)
        print(f"rollout 2 (same seed, updated weights): {rows} of {len(first)} trajectories differ from rollout 1 "
              f"({tokens} sampled tokens)")
        return moved > 0 and off == 0 and not out.get("skipped")
    finally:
        close_group()

# -----------------------------------------------------------------------------
# 8. one GRPO step of a 7B model with LoRA on one GPU


LORA_SHAPE = "Qwen2.5-Coder-7B"  # SkyRL-SQL's model


def part_lora(args):
    """A GRPO step of a random-weight Qwen2.5-Coder-7B shape with LoRA (rank 16 on every linear layer of the decoder)
    as train.py runs it on one GPU: fp32 master weights, a bf16 decode copy, bf16 autocast, non-reentrant activation
    checkpointing, one group of SkyRL's 5 rollouts of 8,192 tokens (4,096 of them sampled), one row per forward.
    Records the step's peak memory, its seconds, and the KV-cache rows of 16,384 tokens that fit beside it."""
    import copy
    import functools
    from types import SimpleNamespace

    import torch

    import lora
    import memory
    from distributed import distribute
    from grpo import GRPOConfig
    from model import build_random, refresh_sampler
    from train import rl_update
    device = args.device
    on_cuda = device == "cuda"
    torch.manual_seed(0)
    if on_cuda:
        model = build_random(LORA_SHAPE, dtype=torch.float32, device=device)
        rows, length, sampled, limit = 5, 8192, 4096, 16384
    else:  # the dry run: the tiny model, short rows
        model = tiny(device)[0]
        rows, length, sampled, limit = 5, 256, 128, 1024
    params = sum(p.numel() for p in model.parameters())
    sampler = copy.deepcopy(model).to(torch.bfloat16)  # the decode copy, made before the adapter
    distribute(model, False, 1, device, bf16=True)  # activation checkpointing on CUDA
    lora.add_adapter(model, lora.LoraSettings(r=16, alpha=32), seed=0)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"{LORA_SHAPE if on_cuda else 'tiny'}: {params / 1e9:.2f}B parameters, {trained / 1e6:.1f}M in the adapter; "
          f"weights {params * 4 / 1e9:.1f} GB fp32 + decode copy {params * 2 / 1e9:.1f} GB bf16")
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    turn = [-1] * (length - sampled) + [0] * sampled
    ep = SimpleNamespace(propose_turn=-1, turn_valid=[True], final_sql="SELECT 1")
    trajs = [SimpleNamespace(token_ids=torch.randint(0, vocab, (length,), generator=g).tolist(), turn_ids=turn,
                             loss_mask=[int(t >= 0) for t in turn], sample_logprobs=[-1.0] * length, episode=ep,
                             stop_reason="answer") for _ in range(rows)]
    rewards = [{"full": float(i % 2), "schema": None} for i in range(rows)]
    cfg = GRPOConfig(group_size=rows, micro_batch_size=1, eps_low=0.2, eps_high=0.2, temperature=0.6,
                     recompute_old_logp=True, pad_id=0)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    autocast = functools.partial(torch.autocast, torch.device(device).type, torch.bfloat16)
    if on_cuda:
        torch.cuda.reset_peak_memory_stats()
    sync(device)
    t0 = time.perf_counter()
    try:
        model.train()
        out = rl_update(model, opt, trajs, rewards, cfg, None, None, autocast)
    except torch.OutOfMemoryError as e:
        print(f"the step ran out of memory: {first_line(e)}")
        return False
    sync(device)
    seconds = time.perf_counter() - t0
    print(f"grpo_step: {rows} x {length:,} tokens in {seconds:.1f} s, loss {out['loss']:.4f}, "
          f"grad norm {out['grad_norm']:.3g}, {out['tokens']} trained tokens")
    refresh_sampler(sampler, model)  # the decode copy takes the merged weights, as before RL's next rollout
    if not on_cuda:
        print("peak memory and KV rows: not measured on the CPU (the part's wiring only)")
        return out["grad_norm"] > 0
    peak = torch.cuda.max_memory_allocated()
    kv_rows = memory.cache_rows(sampler, 4096, device, torch.bfloat16, limit)
    per_row = memory.kv_bytes_per_row(sampler.config, limit, torch.bfloat16)
    print(f"peak allocated {peak / 1e9:.1f} GB of {torch.cuda.get_device_properties(0).total_memory / 1e9:.0f} GB; "
          f"beside it the KV cache holds {kv_rows} rows of {limit:,} tokens ({per_row / 1e6:.0f} MB a row)")
    return out["grad_norm"] > 0 and kv_rows > 0

# -----------------------------------------------------------------------------

PARTS = {  # in the order gpu_check.sh runs them (its parts 2-8)
    "collectives": (part_collectives, "2. each collective path of train.py, eval.py and grpo.py, forced at world 1 on "
                                      "a one-rank cpu:gloo,cuda:nccl group"),
    "row-counts": (part_row_counts, "3. sampled rollouts decoded 4, 16 and all rows at a time: trajectories that "
                                    "differ"),
    "memory-sizing": (part_memory_sizing, "4. free memory and KV-cache rows after a 10 GB allocate-and-free (CUDA)"),
    "long-context": (part_long_context, "5. a 16k-token rollout with long observations beside a ballast: its peak "
                                        "against the headroom"),
    "capture-fallback": (part_capture_fallback, "6. a failed CUDA graph capture: which fallback ran, and its "
                                                "tokens/s (CUDA)"),
    "fsdp": (part_fsdp, "7. FSDP2 at world 1: a rollout, a grpo_step, the decode copy's refresh, a second rollout"),
    "lora": (part_lora, "8. a GRPO step of a 7B model with LoRA on one GPU: peak memory, seconds, the KV rows beside"),
}


def main():
    parser = ArgumentParser(description=__doc__)
    parts = parser.add_subparsers(dest="part", required=True, metavar="PART",
                                  help="which part to run; the parts, in the order the check runs them:")
    for name, (_, text) in PARTS.items():
        sub = parts.add_parser(name, help=text, description=text)
        sub.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                         help="cuda (the check); cpu: the tiny model, small sizes, the check's --dry-run")
        if name == "long-context":
            sub.add_argument("--free-gb", type=float, default=6.0, help="GB the ballast leaves free (CUDA)")
            sub.add_argument("--rows", type=positive_int, default=4, help="rows rolled out (CUDA; the CPU takes 2)")
    args = parser.parse_args()
    import torch
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA device and this machine has none; pass --device cpu")
    torch.manual_seed(0)
    if args.device == "cpu":
        torch.set_num_threads(1)  # the tiny model's ops are too small to split across threads (tests/conftest.py)
    t0 = time.perf_counter()
    try:
        ok = PARTS[args.part][0](args)
    except Skip as e:
        print(f"skipped: {e}")
        sys.exit(SKIPPED)
    print(f"{args.part}: {'ok' if ok else 'FAILED'} in {time.perf_counter() - t0:.1f} s")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
