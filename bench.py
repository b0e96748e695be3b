"""
Benchmarks. Each prints figures measured in this run; targets are printed beside them, never asserted in tests.

    python bench.py env                   # sandbox throughput and runaway-query return times
    python bench.py grpo                  # tokens/s of one GRPO step (tiny model)
    python bench.py rollout               # KV-cached multi-turn rollout vs the naive re-prefill loop and HF generate
    python bench.py capture               # CPU proxy: the decode step compiles once per bucket, never recompiles
    python bench.py grpo --device cuda    # Qwen3-0.6B-shaped GRPO step in bf16, eager and compiled, and its MFU
    python bench.py rollout --device cuda # Qwen3-0.6B and -4B shapes at 64 rows, CUDA graphs, the HBM bound
"""
import sys
from pathlib import Path

# -----------------------------------------------------------------------------

def bench_grpo(args):
    """Tokens/s of one dual-track GRPO step (forward + backward + optimizer) on synthetic 3-turn trajectories:
    the tiny model on CPU, or (--device cuda) a random Qwen3-0.6B-shaped model in bf16 with its MFU."""
    import time
    from types import SimpleNamespace

    import torch

    from grpo import GRPOConfig, grpo_step
    from distributed import compile_layers
    from model import SHAPES, build_random, load_model

    def batch(vocab, rows, seq_len, gen):
        # a quarter prompt, then 3 turns: sampled tokens (mask 1) followed by an observation (mask 0)
        P = seq_len // 4
        turn_len = (seq_len - seq_len // 4) // 3
        turn_ids = [-1] * P + [t for t in range(3) for _ in range(turn_len)]
        turn_ids += [2] * (seq_len - len(turn_ids))
        mask = [int(t >= 0 and (i - P) % turn_len < turn_len * 2 // 3) for i, t in enumerate(turn_ids)]
        trajs = [SimpleNamespace(token_ids=torch.randint(0, vocab, (seq_len,), generator=gen).tolist(),
                                 loss_mask=mask, turn_ids=turn_ids, sample_logprobs=[0.0] * seq_len,
                                 stop_reason="answer", episode=SimpleNamespace(propose_turn=1, turn_valid=[True] * 3,
                                                                               final_sql="SELECT 1"))
                 for _ in range(rows)]
        rewards = [{"full": float(i % 3 == 0) + 0.1, "schema": float(i % 2)} for i in range(rows)]
        return trajs, rewards

    def run(model, cfg, trajs, rewards, steps, sync=lambda: None):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
        grpo_step(model, opt, trajs, rewards, cfg)  # warm-up (allocator, kernels, optimizer state)
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            metrics = grpo_step(model, opt, trajs, rewards, cfg)
        sync()
        return (time.perf_counter() - t0) / steps, metrics

    gen = torch.Generator().manual_seed(args.seed)
    G = 8
    if args.device == "cpu":
        model, tokenizer = load_model("tiny", seed=args.seed)
        rows = 16
        seq_len = 512
        trajs, rewards = batch(len(tokenizer), rows, seq_len, gen)
        cfg = GRPOConfig(group_size=G, schema_lambda=0.25, micro_batch_size=8)
        dt, m = run(model, cfg, trajs, rewards, steps=3)
        print(f"grpo tiny/cpu: {rows} x {seq_len} tokens ({m['tokens']} sampled) in {dt * 1e3:.0f} ms/step: "
              f"{rows * seq_len / dt:,.0f} tokens/s ({m['tokens'] / dt:,.0f} sampled tokens/s)")
        return
    shape = "Qwen3-0.6B"
    rows = 32
    seq_len = 2048
    model = build_random(shape, dtype=torch.bfloat16, device="cuda")
    trajs, rewards = batch(SHAPES[shape]["vocab_size"], rows, seq_len, gen)
    cfg = GRPOConfig(group_size=G, schema_lambda=0.25, micro_batch_size=8)
    for compiled in (False, True):  # eager, then train.py --compile (run's warm-up step pays the compiling)
        if compiled:
            compile_layers(model)
        t0 = time.perf_counter()
        dt, m = run(model, cfg, trajs, rewards, steps=3, sync=torch.cuda.synchronize)
        report_mfu(model, shape, rows, seq_len, dt, m, "--compile" if compiled else "eager",
                   time.perf_counter() - t0 - 3 * dt)


def report_mfu(model, shape, rows, seq_len, dt, m, label, first_s):
    """Print one GRPO step's throughput and model FLOPs utilisation on this GPU."""
    import torch

    from model import SHAPES
    # model FLOPs of one step: 6 per parameter per token for the body, the LM head only on sampled positions
    # (grpo.token_logprobs skips the rest), causal attention 6·L·(heads·head_dim)·T per token; no recompute
    s = SHAPES[shape]
    head = s["vocab_size"] * s["hidden_size"]
    body = sum(p.numel() for p in model.parameters()) - head  # tied embedding: lookup is free, the head is not
    attn = 6 * s["num_hidden_layers"] * s["num_attention_heads"] * s["head_dim"] * seq_len
    flops = (6 * body + attn) * rows * seq_len + 6 * head * m["tokens"]
    name = torch.cuda.get_device_name()
    peak = next((v for k, v in {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12}.items()
                 if k in name), None)  # dense bf16 tensor-core peak of the SXM parts
    mfu = f"{flops / dt / peak:.1%}" if peak else "n/a (unknown peak for this GPU)"
    print(f"grpo {shape}/{name} bf16, {label}: {rows} x {seq_len} tokens in {dt * 1e3:.0f} ms/step "
          f"(first step {first_s:.0f} s): {rows * seq_len / dt:,.0f} tokens/s, {flops / dt / 1e12:.0f} TFLOP/s, "
          f"MFU {mfu} (target >= 35%)")


def bench_env(args):
    """Sandbox throughput: 2,000 simple Spider-dev gold queries (cycled) through env.run_many with 2 workers, and the
    worst return time of runaway queries against their timeout, alone, 16 at once, and one heavy call per row."""
    import json
    import statistics
    import time

    import cli
    import env

    spider = Path(__file__).resolve().parent.parent / "shared" / "data" / "spider"
    if not (spider / "dev.json").exists():
        cli.die(f"bench env needs the Spider dev set at {spider} (dev.json + database/)")

    def db(db_id):
        return spider / "database" / db_id / f"{db_id}.sqlite"
    dev = [d for d in json.loads((spider / "dev.json").read_text()) if db(d["db_id"]).exists()]
    jobs = [(str(db(d["db_id"])), d["query"]) for d in dev]
    jobs = (jobs * (2000 // len(jobs) + 1))[:2000]
    env.run_many(jobs[:200], workers=2)  # warm the OS file cache
    rates = []
    for rep in range(3):  # the CPU is shared with other work: report every run and the median
        t0 = time.perf_counter()
        results = env.run_many(jobs, workers=2)
        rates.append(len(jobs) / (time.perf_counter() - t0))
        errors = sum(r.error is not None for r in results)
        print(f"env run {rep}: {len(jobs)} Spider-dev gold queries, 2 workers: {rates[-1]:,.0f} queries/s "
              f"({errors} errors)")

    world = str(db("world_1"))  # city has 4,079 rows
    runaways = {"recursive CTE, no LIMIT": "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) "
                                           "SELECT count(*) FROM c",
                "3-way cartesian join": "SELECT count(*) FROM city a, city b, city c",
                "sorted cartesian join": "SELECT a.Name, b.Name FROM city a, city b, city c ORDER BY a.Name || c.Name"}
    worst = 0.0
    for timeout in (1.0, env.TIMEOUT_S):
        for name, sql in runaways.items():
            t0 = time.monotonic()
            r = env.run_sql(world, sql, timeout_s=timeout)
            over = time.monotonic() - t0 - timeout
            worst = max(worst, over)
            print(f"env runaway alone, timeout {timeout} s, {name}: returned {over:+.3f} s after the timeout "
                  f"({r.error})")
        t0 = time.monotonic()
        jobs16 = ([(world, sql) for sql in runaways.values()] * 6)[:16]
        rs = env.run_many(jobs16, workers=16, timeout_s=timeout)
        wall = time.monotonic() - t0 - timeout
        per_query = max(r.elapsed_s for r in rs) - timeout
        worst = max(worst, per_query, wall)
        print(f"env runaways 16 at once, timeout {timeout} s: worst query {per_query:+.3f} s after its timeout, "
              f"whole batch {wall:+.3f} s (all timed out: {all('timed out' in (r.error or '') for r in rs)})")
    big = "replace(hex(zeroblob(499000)), '0', 'a')"  # 998,000 bytes, built inside SQLite
    per_row = f"WITH v(s) AS (SELECT {big}) SELECT count(*) FROM city, v WHERE "  # one heavy call per city row
    one_step = {"LIKE at the pattern limit": per_row + "substr(s, ID) LIKE '%" + "a" * 37 + "b'",
                "GLOB [...] at its budget": per_row + "substr(s, ID) GLOB '*[" + "b" * 15 + "a]c'",
                "trim() at its budget": per_row + "length(trim(substr(s, ID), '" + "b" * 18 + "a'))",
                "randomblob(1e6)": "SELECT count(*) FROM city a, city b WHERE length(randomblob(999999 - a.ID - b.ID))"}
    for name, sql in one_step.items():  # work inside one SQLite call, which no interrupt stops
        t0 = time.monotonic()
        r = env.run_sql(world, sql, timeout_s=1.0)
        over = time.monotonic() - t0 - 1.0
        worst = max(worst, over)
        print(f"env one heavy call per row, timeout 1.0 s, {name}: returned {over:+.3f} s after the timeout "
              f"({r.error})")
    print(f"env worst runaway return: timeout {worst:+.3f} s (target <= +0.2 s)")
    print(f"env queries/s (median of 3, target >= 2,000): {statistics.median(rates):,.0f}")
    print(f"env queries/s: {statistics.median(rates):.0f}")


# -----------------------------------------------------------------------------
# Rollout: the engine against the naive loop and HF generate, on identical scripted work

TURNS = 5


def scripted_turns(tokenizer, example, turn_len):
    """Token ids of each scripted turn, each exactly turn_len long: <think> filler, then the action (tool calls whose
    observations are tens of rows, then confirm_answer)."""
    import json

    import env
    table = env.run_sql(example["db_path"], "SELECT name FROM sqlite_master WHERE type = 'table'").rows[0][0]
    sqls = ["SELECT name FROM sqlite_master WHERE type = 'table'", f'SELECT * FROM "{table}" LIMIT 10',
            example["gold_sql"], f'SELECT * FROM "{table}" LIMIT 20']
    out = []
    for t in range(TURNS):
        if t < TURNS - 1:
            call = json.dumps({"name": "execute_sql_query", "arguments": {"db_id": example["db_id"], "sql": sqls[t]}})
            action = "explore_schema" if t < 2 else "generate_sql"
            body = f"<tool_call>\n{call}\n</tool_call>"
        else:
            action = "confirm_answer"
            body = f"<answer>\n{example['gold_sql']}\n</answer>"
        head = tokenizer.encode("<think>", add_special_tokens=False)
        tail = tokenizer.encode(f"</think>\n<action>{action}</action>\n{body}", add_special_tokens=False)
        if len(head) + len(tail) > turn_len:
            raise ValueError(f"turn_len {turn_len} is shorter than the scripted action ({len(head) + len(tail)})")
        filler = tokenizer.encode(" ok", add_special_tokens=False)[:1] * (turn_len - len(head) - len(tail))
        out.append(head + filler + tail)
    return out


def script_force(scripts, free_turn=None):
    """rollout's force hook: row r emits scripts[r][turn] token by token; in free_turn the model decides."""
    def force(row, turn, sampled):
        if turn == free_turn or len(sampled) >= len(scripts[row][turn]):
            return None
        return scripts[row][turn][len(sampled)]
    return force


def run_engine(model, tokenizer, batch, scripts, turn_len, group_size, limit, seed=0, decode="auto", free_turn=None):
    """rollout.py on the scripted work; returns its trajectories."""
    import protocols
    from rollout import rollout
    trajs = rollout(model, tokenizer, batch[::group_size], protocols.PROTOCOLS["trust"], group_size=group_size,
                    max_turns=TURNS, max_new_tokens=turn_len, max_total_tokens=limit, temperature=0.0, top_p=1.0,
                    schema_mode="none", seed=seed, force=script_force(scripts, free_turn), decode=decode)
    bad = [t.stop_reason for t, s in zip(trajs, scripts) if t.stop_reason != "answer" or t.num_turns != len(s)]
    if bad and free_turn is None:
        print(f"  warning: {len(bad)} rows did not run the full script ({bad[:3]})")
    return trajs


def run_naive(model, tokenizer, batch, scripts, turn_len):
    """The loop a student writes: every turn re-render the whole conversation and call model.generate on it."""
    import env
    import protocols
    proto = protocols.PROTOCOLS["trust"]
    chats = [proto.build_messages(example, "none", TURNS) for example in batch]
    episodes = [env.new_episode(example, proto, TURNS, "none") for example in batch]
    generated = 0
    for t in range(TURNS):
        texts = [tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) for chat in chats]
        enc = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
        out = model.generate(**enc.to(model.device), max_new_tokens=turn_len, min_new_tokens=turn_len,
                             do_sample=False, pad_token_id=tokenizer.pad_token_id)
        generated += out[:, enc["input_ids"].shape[1]:].numel()
        for chat, episode, turn_ids in zip(chats, episodes, [s[t] for s in scripts]):
            text = tokenizer.decode(turn_ids)  # the scripted turn stands in for the untrained model's text
            observation, done = env.step(episode, text)
            chat.append({"role": "assistant", "content": text})
            if not done:
                chat.append({"role": proto.obs_role, "content": observation})
    return generated


def run_one_turn(model, tokenizer, batch, turn_len):
    """HF generate producing as many tokens in one uninterrupted turn: no tools, one prefill."""
    import protocols
    proto = protocols.PROTOCOLS["trust"]
    chats = [proto.build_messages(example, "none", TURNS) for example in batch]
    texts = [tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) for chat in chats]
    enc = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    out = model.generate(**enc.to(model.device), max_new_tokens=TURNS * turn_len, min_new_tokens=TURNS * turn_len,
                         do_sample=False, pad_token_id=tokenizer.pad_token_id)
    return out[:, enc["input_ids"].shape[1]:].numel()


def compare(label, model, tokenizer, examples, rows, group_size, turn_len, limit, goals, sync):
    """tokens/s of rollout.py, the naive loop and one-turn HF generate, one run each; returns the two speedups."""
    import time

    from torch.nn.attention import sdpa_kernel

    from engine import SDPA_BACKENDS
    batch = [examples[i // group_size] for i in range(rows)]  # group-major, like rollout's rows
    scripts = [scripted_turns(tokenizer, example, turn_len) for example in batch]
    print(f"{label}: {rows // group_size} prompts x {group_size} samples, {TURNS} turns x {turn_len} tokens")
    sides = {
        "kv-cached rollout": lambda: sum(sum(t.loss_mask) for t in run_engine(model, tokenizer, batch, scripts,
                                                                                turn_len, group_size, limit)),
        "naive re-prefill": lambda: run_naive(model, tokenizer, batch, scripts, turn_len),
        "HF generate 1 turn": lambda: run_one_turn(model, tokenizer, batch, turn_len),
    }
    rates = []
    for name, side in sides.items():
        sync()
        t0 = time.perf_counter()
        with sdpa_kernel(SDPA_BACKENDS):  # every contender gets the engine's prefill kernels
            tokens = side()
        sync()
        dt = time.perf_counter() - t0
        rates.append(tokens / dt)
        print(f"  {name:18s} {tokens} sampled tokens in {dt:6.2f}s = {tokens / dt:9,.0f} tokens/s")
    print(f"  speedup vs re-prefill {rates[0] / rates[1]:.2f}x (goal >= {goals[0]}x); vs HF generate of one "
          f"{TURNS * turn_len}-token turn {rates[0] / rates[2]:.2f}x (goal >= {goals[1]}x)")
    return rates[0] / rates[2], rates[0] / rates[1]


def decode_bound(model, rows, ctx, steps):
    """Time one captured decode step with ctx tokens cached per row against reading weights + KV once at the GPU's
    HBM bandwidth (the SXM parts' data sheets); also the seconds capturing every bucket took."""
    import time

    import torch

    import engine
    cfg = model.config
    param = next(model.parameters())
    with torch.inference_mode(), engine.use_slot_attention(model):
        cache = engine.SlotCache(model, rows, param.device, param.dtype, ctx + steps + 3)
        for _ in range(0, ctx, 512):
            engine.forward_chunks(model, cache, [[7] * 512] * rows, 0)
        decoder = engine.make_decoder(model, cache, "graphs")
        for i in range(steps + 3):  # 3 warm-up steps
            if i == 3:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
            logits = engine.decode(model, cache, decoder, [7] * rows, 0)
            u = engine.uniforms(0, range(rows), [ctx + i] * rows, param.device)
            engine.sample(logits, 1.0, 1.0, u)[0].tolist()
        torch.cuda.synchronize()
        step_s = (time.perf_counter() - t0) / steps
        kernel_table = step_kernels(model, cache, rows, decoder.kernel, steps=5)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_bytes = (rows * (ctx + steps // 2) * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads
                * engine.head_dim(cfg) * param.element_size())
    name = torch.cuda.get_device_name()
    hbm = next((v for k, v in {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12}.items() if k in name), 4.8e12)
    bound_s = (weight_bytes + kv_bytes) / hbm
    print(f"  decode step ({decoder.kernel} attention), batch {rows}, {ctx} tokens cached: {step_s * 1e3:.2f} ms; "
          f"HBM bound ({weight_bytes / 1e9:.1f} GB weights + {kv_bytes / 1e9:.1f} GB KV at {hbm / 1e12:.2f} TB/s) "
          f"{bound_s * 1e3:.2f} ms = {bound_s / step_s:.0%} of the bound (goal >= 50%)")
    print(f"  capture: {len(decoder.graphs)} CUDA graphs (buckets {decoder.buckets}) in {decoder.capture_s:.1f} s")
    print(kernel_table)


def step_kernels(model, cache, rows, kernel, steps):
    """Where an eager decode step's device time goes (a graph replays the same kernels): the five kernels that take
    the most, per step, and how many kernels a step launches. On the CPU the same table of the CPU's ops."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    import engine
    on_cuda = cache.k[0].device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    engine.decode_step(model, cache, rows, kernel)  # warm-up
    with profile(activities=activities) as prof:
        for _ in range(steps):
            engine.decode_step(model, cache, rows, kernel)
        if on_cuda:
            torch.cuda.synchronize()

    def self_us(event):  # the op's own time, in µs, where the step runs
        return event.self_device_time_total if on_cuda else event.self_cpu_time_total
    # on CUDA only the kernels: a CPU op's self device time repeats the time of the kernels it launched
    where = DeviceType.CUDA if on_cuda else DeviceType.CPU
    ops = sorted((e for e in prof.key_averages() if e.device_type == where and self_us(e) > 0), key=self_us,
                 reverse=True)
    per_step = [self_us(e) / steps / 1e3 for e in ops]  # ms
    lines = [f"  an eager step's {'kernels' if on_cuda else 'CPU ops'}: {sum(per_step):.2f} ms, "
             f"{sum(e.count for e in ops) // steps} {'launches' if on_cuda else 'calls'}; the five longest:"]
    for e, ms in zip(ops[:5], per_step):
        lines.append(f"    {ms:6.2f} ms  {e.count // steps:4d}x  {e.key[:90]}")
    return "\n".join(lines)


def graph_token_diff(model, tokenizer, examples, rows, turn_len, limit):
    """Greedy tokens of the last, free turn (after 4 scripted ones) replayed as CUDA graphs vs the eager step."""
    batch = [examples[i] for i in range(rows)]
    scripts = [scripted_turns(tokenizer, example, turn_len) for example in batch]
    free = TURNS - 1
    runs = [run_engine(model, tokenizer, batch, scripts, turn_len, 1, limit, decode=d, free_turn=free)
            for d in ("graphs", "static")]
    sampled = [[tok for tok, m, t in zip(x.token_ids, x.loss_mask, x.turn_ids) if m and t == free] for x in runs[0]]
    eager = [[tok for tok, m, t in zip(x.token_ids, x.loss_mask, x.turn_ids) if m and t == free] for x in runs[1]]
    differ = sum(a != b for g, e in zip(sampled, eager) for a, b in zip(g, e))
    differ += sum(abs(len(g) - len(e)) for g, e in zip(sampled, eager))
    print(f"  greedy tokens of a free turn, graph replay vs eager step: {differ} of {sum(map(len, eager))} differ")


def bench_rollout(args):
    """KV-cached multi-turn rollout (rollout.py) vs (a) the naive loop a student writes: every turn re-render the
    whole conversation and call model.generate on it (the history is prefilled again each turn), and (b) HF generate
    producing the same number of tokens in one uninterrupted turn (no tools, one prefill: the ceiling for a decoder).
    All get identical work: the trust protocol in unknown-schema mode, 5 turns of exactly `turn_len` tokens from a
    scripted policy, the same observations. CPU: SmolLM2-135M-Instruct in the demo's rollout precision (--dtype
    auto). --device cuda: random Qwen3-0.6B- and Qwen3-4B-shaped models at 64 rows in bf16 (SmolLM2's tokenizer),
    the decode step against the HBM bound, the capture time, the step's five longest kernels, and graph replay
    against the eager step."""
    import torch

    import env
    from data.gym.prepare import ensure_gym
    from model import TORCH_DTYPES, build_random, load_model, resolve_dtype, smollm2_tokenizer

    examples = env.load_examples(ensure_gym() / "dev.jsonl")
    torch.manual_seed(args.seed)
    if args.device == "cpu":
        model, tokenizer = load_model("smollm2", seed=args.seed)
        precision = resolve_dtype("auto", "cpu")  # the demo's rollout precision
        model = model.to(TORCH_DTYPES[precision])
        speedups = compare(f"SmolLM2-135M-Instruct / cpu / {precision}", model, tokenizer, examples, 32, 4, 96,
                           16384, goals=(3, 1), sync=torch.cpu.synchronize)
    else:
        tokenizer = smollm2_tokenizer()
        for shape in ("Qwen3-0.6B", "Qwen3-4B"):
            model = build_random(shape, dtype=torch.bfloat16, device="cuda")
            speedups = compare(f"{shape} shape (random) / {torch.cuda.get_device_name()} / bf16", model, tokenizer,
                               examples, 64, 2, 128, 4096, goals=(3, 2), sync=torch.cuda.synchronize)
            decode_bound(model, 64, 2048, 20)
            if shape == "Qwen3-0.6B":
                graph_token_diff(model, tokenizer, examples, 64, 128, 4096)
            del model
            torch.cuda.empty_cache()
    print(f"rollout speedup vs HF generate: {speedups[0]:.2f}x")
    print(f"rollout speedup vs re-prefill: {speedups[1]:.2f}x")

# -----------------------------------------------------------------------------
# Capture: is the decode step static enough for a CUDA graph? (checked on the CPU)


def capture_check(model, tokenizer, examples, step, rows=16, turn_len=96):
    """Run a scripted 5-turn rollout of `rows` rows (prefills in between, rows finishing, compactions) whose decode
    step is `step` compiled with fullgraph=True, dynamic=False. Each bucket may compile once; after that a
    recompile fails the check (torch.compiler stance fail_on_recompile), as do logits that differ from the eager
    step and cache buffers that move. Returns (capturable, the line that says so). Stricter than a CUDA graph needs:
    it also catches syncs, guards on Python numbers, and state a graph would freeze."""
    import torch
    import torch._dynamo

    import engine
    compiles = []

    def counting_aot_eager(gm, example_inputs):
        compiles.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, dynamic=False, backend=counting_aot_eager)
    seen = set()   # buckets compiled so far
    ptrs = None    # the cache buffers' addresses at the first step
    worst = 0.0    # largest |compiled - eager| logit
    steps = 0

    def checked_step(model, cache, n):
        nonlocal ptrs, worst, steps
        now = [x.data_ptr() for x in cache.k + cache.v]
        if ptrs is not None and now != ptrs:
            raise RuntimeError("the cache's buffers moved")
        ptrs = now
        stance = "fail_on_recompile" if n in seen else "default"
        with torch.compiler.set_stance(stance):
            logits = compiled(model, cache, n)
        seen.add(n)
        eager = engine.decode_step(model, cache, n)  # rewrites the same keys
        worst = max(worst, (logits - eager).abs().max().item())
        steps += 1
        return logits

    batch = examples[:rows]
    scripts = [scripted_turns(tokenizer, example, turn_len) for example in batch]
    for r in range(rows):  # row r answers in turn r % 5: rows finish at different turns and the batch shrinks
        scripts[r] = scripts[r][:r % TURNS] + scripts[r][-1:]
    try:
        with torch._dynamo.config.patch(recompile_limit=64):
            run_engine(model, tokenizer, batch, scripts, turn_len, 1, 4096, decode=checked_step)
    except Exception as e:  # noqa: BLE001  any failure is the answer, said on one line
        reason = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return False, f"decode step capturable: no ({type(e).__name__}: {reason[:300]})"
    if worst > 1e-4:
        return False, f"decode step capturable: no (compiled logits differ from the eager step by {worst:.2e})"
    recompiles = len(compiles) - len(seen)
    return recompiles == 0, (f"decode step capturable: {'yes' if recompiles == 0 else 'no'} ({len(compiles)} "
                             f"compiles for {len(seen)} buckets, {recompiles} recompiles over {steps} steps)")


def bench_capture(args):
    """The CPU proxy for CUDA-graph capture: engine.decode_step compiled whole, static shapes, on the tiny model
    over a 5-turn rollout of 16 rows."""
    import engine
    import env
    from data.gym.prepare import ensure_gym
    from model import load_model
    model, tokenizer = load_model("tiny", seed=args.seed)
    examples = env.load_examples(ensure_gym() / "dev.jsonl")
    ok, line = capture_check(model, tokenizer, examples, engine.decode_step)
    print(line)
    if not ok:
        sys.exit(1)

BENCHES = {
    "capture": bench_capture,
    "env": bench_env,
    "grpo": bench_grpo,
    "rollout": bench_rollout,
}

if __name__ == "__main__":
    import torch

    from cli import ArgumentParser  # a bad flag is one `error:` line
    parser = ArgumentParser(description=__doc__)
    parser.add_argument("name", choices=sorted(BENCHES), help="which benchmark to run")
    parser.add_argument("--seed", type=int, default=0, help="random init and data")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="cpu: the tiny model (grpo) or SmolLM2 (rollout); cuda: random Qwen3 shapes in bf16")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA device and this machine has none; leave --device out for the CPU")
    BENCHES[args.name](args)
