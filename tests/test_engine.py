"""engine.py on the CPU: every decode path gives the tokens the engine gave before the static step (golden files),
the static step is capturable (compiled whole, once per bucket, never again), padded rows touch only the scratch
slot, the cache's zeroing, length ranges, and sampling."""
import json

import pytest
import torch

import bench
import engine
from golden_rollouts import FAMILIES, GOLDEN, family_model, golden_rollout
from model import load_model
from test_rollout import replay_logprobs, run, trust_answer, trust_call

pytestmark = pytest.mark.usefixtures("one_thread")


# -----------------------------------------------------------------------------
# 1. the same tokens as the engine before the static step


@pytest.mark.parametrize("family,decode", [(f, d) for f in FAMILIES if f != "smollm2" for d in ("ranged", "static")]
                         + [("smollm2", "ranged")])
def test_greedy_rollout_gives_the_golden_tokens(tiny, examples, family, decode):
    """tests/golden/*.json were recorded with the engine before the static step (tests/golden_rollouts.py)."""
    golden = json.loads((GOLDEN / f"{family}.json").read_text())
    model = family_model(family, tiny[1])
    trajs = golden_rollout(model, tiny[1], examples, family, decode=decode)
    assert len(trajs) == len(golden["rows"])
    for r, (traj, row) in enumerate(zip(trajs, golden["rows"])):
        assert traj.token_ids == row["token_ids"], f"{family}/{decode}: row {r} decodes other tokens"
        assert traj.stop_reason == row["stop_reason"]


def test_static_step_records_the_logprobs_a_replay_computes(tiny, examples):
    model, _ = tiny
    scripts = {r: [trust_call(f"SELECT * FROM sqlite_master LIMIT {r + 1}"), 12 + 4 * r] for r in range(3)}
    trajs = run(tiny, examples[:3], scripts, temperature=0.8, top_p=0.9, seed=5, decode="static")
    for traj in trajs:
        mask = torch.tensor(traj.loss_mask, dtype=torch.bool)
        assert mask.sum() > 10
        assert torch.allclose(replay_logprobs(model, traj, 0.8)[mask], torch.tensor(traj.sample_logprobs)[mask],
                              atol=1e-4, rtol=0)

# -----------------------------------------------------------------------------
# 2. capturability: the CPU proxy for a CUDA graph


def test_decode_step_compiles_once_per_bucket_and_never_again(tiny, examples):
    ok, line = bench.capture_check(*tiny, examples, engine.decode_step, rows=4)
    assert ok, line
    # 4 rows shrink as rows answer in turns 0..4: more than one bucket of [1, 2, 4] is used
    k = int(line.split("(")[1].split(" compiles")[0])
    buckets = int(line.split("for ")[1].split(" buckets")[0])
    steps = int(line.split("over ")[1].split(" steps")[0])
    assert k == buckets >= 2 and steps > 100, line


def test_a_step_with_a_python_int_key_length_is_not_capturable(tiny, examples):
    def int_keyed_step(model, cache, rows):  # the engine before: keys read up to the longest row, a Python int
        longest = max(cache.lens) + 1
        return engine.decode_step(model, cache, rows, key_ranges=[(0, rows, longest)])
    ok, line = bench.capture_check(*tiny, examples, int_keyed_step, rows=4)
    assert not ok and line.startswith("decode step capturable: no (") and "recompile" in line, line


def prefilled(model):
    """A 64-slot fp32 cache of 4 rows holding 3 prompt tokens each, and a static decoder over it (call it under
    inference mode and slot attention)."""
    cache = engine.SlotCache(model, 4, "cpu", torch.float32, 64)
    engine.forward_chunks(model, cache, [[5, 6, 7]] * 4, 0)
    return cache, engine.make_decoder(model, cache, "static")


def test_padded_rows_write_only_the_scratch_slot(tiny):
    """3 feeds run at the 4-row bucket: row 3 is padding and must leave every real slot of its row as it was."""
    model, _ = tiny
    with torch.inference_mode(), engine.use_slot_attention(model):
        cache, decoder = prefilled(model)
        cache.keep([0, 1, 2])  # the fourth row leaves: 3 rows in use, decoded at bucket 4
        before = [x[3].clone() for x in cache.k + cache.v]
        engine.decode(model, cache, decoder, [8, 9, None], 0)
    assert cache.lens == [4, 4, 3]  # the idle row (None) holds what it held
    for x, old in zip(cache.k + cache.v, before):
        assert torch.equal(x[3, :64], old[:64])  # slots 0..limit-1 untouched; slot 64 is the scratch slot
        assert not torch.equal(x[3, 64], old[64])
        assert not torch.equal(x[0, 3], torch.zeros_like(x[0, 3]))  # a live row did write its new key


def test_the_step_profile_names_the_five_longest_ops_of_a_step(tiny):
    """bench.py's table of where a decode step's time goes (on a GPU, its kernels), here from the CPU's ops."""
    model, _ = tiny
    with torch.inference_mode(), engine.use_slot_attention(model):
        cache, decoder = prefilled(model)
        engine.decode(model, cache, decoder, [8, 9, 10, 11], 0)
        table = bench.step_kernels(model, cache, 4, decoder.kernel, steps=3).splitlines()
    total_ms = float(table[0].split(": ")[1].split(" ms")[0])
    calls = int(table[0].split(" ms, ")[1].split()[0])
    longest_ms = [float(line.split()[0]) for line in table[1:]]
    assert len(longest_ms) == 5 and longest_ms == sorted(longest_ms, reverse=True)
    assert sum(longest_ms) <= total_ms + 0.01 * len(longest_ms)  # each shown rounded to 0.01 ms
    # per step: seven bias-free projections a layer, then the LM head, each one matmul
    matmuls = f"{7 * model.config.num_hidden_layers + 1}x  aten::mm"
    assert any(line.split(" ms", 1)[1].strip() == matmuls for line in table[1:]), table
    assert calls > 7 * model.config.num_hidden_layers + 1


def test_batch_buckets():
    assert engine.batch_buckets(3) == [1, 2, 3]
    assert engine.batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert engine.batch_buckets(100) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 100]

# -----------------------------------------------------------------------------
# 3. the cache: zeroing, length ranges


def test_cache_slots_are_zeroed_before_first_read(tiny, examples, monkeypatch):
    # CPU buffers span every slot untouched, so they may hold NaN until reserve() zeroes them; a masked NaN key or
    # value would still poison its row
    scripts = {r: [trust_call(f"SELECT * FROM sqlite_master LIMIT {r % 4 + 1}")] +
               ([trust_answer("SELECT 1")] if r % 3 == 0 else []) for r in range(8)}
    clean = run(tiny, examples[:8], scripts)
    caches = []
    init = engine.SlotCache.__init__

    def dirty_init(self, *args):
        init(self, *args)
        for x in self.stores:
            x.fill_(float("nan"))
        caches.append(self)
    monkeypatch.setattr(engine.SlotCache, "__init__", dirty_init)
    dirty = run(tiny, examples[:8], scripts)
    for a, b in zip(clean, dirty):
        assert a.token_ids == b.token_ids and a.stop_reason == b.stop_reason
        assert torch.allclose(torch.tensor(a.sample_logprobs), torch.tensor(b.sample_logprobs), atol=1e-4, rtol=0)
    batch_cache = caches[0]  # caches[1]: the shared system prompt
    longest = max(len(t.token_ids) for t in dirty)
    assert batch_cache.ready == 1024 * (longest // 1024 + 1)  # zeroed as far as rows reached, not to the limit


def test_each_row_range_reads_up_to_its_longest_row(monkeypatch):
    monkeypatch.setattr(engine, "RANGE_ROWS", 2)
    assert engine.row_ranges([5, 100, 6, 90], 1) == [(0, 2, 101), (2, 4, 91)]
    assert engine.row_ranges(sorted([5, 100, 6, 90]), 1) == [(0, 2, 7), (2, 4, 101)]  # sorted: 216 keys, not 384


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_decode_attention_is_attention_over_repeated_key_heads(dtype):
    # SmolLM2's heads: 9 query heads over 3 key heads; query head h reads key head h // 3 (transformers' repeat_kv).
    # Rows hold 5, 17 and 30 keys of 30 slots, hidden past their length by the additive mask the engine builds
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(3, 9, 1, 64, generator=gen).to(dtype)    # (A, H, 1, D)
    key = torch.randn(3, 3, 30, 64, generator=gen).to(dtype)     # (A, Hkv, n, D)
    value = torch.randn(3, 3, 30, 64, generator=gen).to(dtype)
    lens = torch.tensor([5, 17, 30])
    hidden = torch.arange(30) >= lens[:, None]                    # (A, n)
    mask = torch.zeros(3, 1, 1, 30, dtype=dtype).masked_fill_(hidden[:, None, None], torch.finfo(dtype).min)
    out = engine.grouped_decode_attention(query, key, value, mask, 0.125)  # (A, 1, H, D)
    want = torch.nn.functional.scaled_dot_product_attention(query, key.repeat_interleave(3, 1),
                                                            value.repeat_interleave(3, 1), attn_mask=mask, scale=0.125)
    assert out.shape == (3, 1, 9, 64)
    assert torch.allclose(out.transpose(1, 2).float(), want.float(), atol=2e-2 if dtype == torch.bfloat16 else 1e-5)
    # the first row's answer uses its 5 keys only: values past them may be anything
    value[0, :, 5:] = 1e3
    assert torch.equal(engine.grouped_decode_attention(query, key, value, mask, 0.125)[0], out[0])


def test_length_ranges_and_sorted_slots_decode_as_one_range_does(tiny, examples, monkeypatch):
    # rows alternate observations of 1 and 10 CREATE statements, so lengths alternate; with 2 rows per range the
    # cache gets sorted and each pair of rows reads its own keys only, which must change no token and no log-prob
    scripts = {r: [trust_call(f"SELECT sql FROM sqlite_master LIMIT {1 + 9 * (r % 2)}"), 3 + 2 * r]
               for r in range(8)}
    monkeypatch.setattr(engine, "RANGE_ROWS", 10 ** 6)  # one range: every row reads the longest row's keys
    whole = run(tiny, examples[:8], scripts)
    sorts = []
    keep = engine.SlotCache.keep

    def counted_keep(self, index):
        sorts.append(len(index))
        keep(self, index)
    monkeypatch.setattr(engine.SlotCache, "keep", counted_keep)
    monkeypatch.setattr(engine, "RANGE_ROWS", 2)
    monkeypatch.setattr(engine, "SORT_BELOW", 0.99)
    ranged = run(tiny, examples[:8], scripts)
    assert 8 in sorts  # the 8 slots were permuted at least once
    assert tiny[0].config._attn_implementation == "sdpa"  # the model's own setting is back
    for a, b in zip(whole, ranged):
        assert a.token_ids == b.token_ids and a.stop_reason == b.stop_reason
        assert torch.allclose(torch.tensor(a.sample_logprobs), torch.tensor(b.sample_logprobs), atol=1e-4, rtol=0)

# -----------------------------------------------------------------------------
# 4. sampling


def test_sample_greedy_temperature_and_top_p():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]] * 200)
    u = engine.uniforms(0, range(200), [0] * 200)
    tokens, logp = engine.sample(logits, 0.0, 1.0, None)  # greedy needs no uniforms
    assert (tokens == 0).all() and torch.allclose(logp, torch.log_softmax(logits, -1))
    tokens, logp = engine.sample(logits, 0.5, 1.0, u)
    assert torch.allclose(logp, torch.log_softmax(logits / 0.5, -1))  # full-vocab tempered log-probs are recorded
    assert set(tokens.tolist()) >= {0, 1}
    # at T = 1 the probabilities are .61 .22 .14 .03: the 0.7-nucleus is {0, 1}, so 2 and 3 are never drawn
    tokens, _ = engine.sample(logits, 1.0, 0.7, u)
    assert set(tokens.tolist()) == {0, 1}


def test_draw_matches_the_distribution_and_never_picks_a_zero():
    """Inverse-CDF sampling at hashed uniforms: frequencies follow probs (unnormalised rows are fine), zero entries
    are never drawn, and the same seed draws the same tokens."""
    probs = torch.tensor([[0.5, 0.0, 0.3, 0.2], [0.0, 2.0, 0.0, 2.0]]).repeat(20000, 1)  # (40000, 4)
    u = engine.uniforms(0, range(40000), [3] * 40000)
    tokens = engine.draw(probs, u).reshape(-1, 2)
    freq_a = torch.bincount(tokens[:, 0], minlength=4) / len(tokens)
    freq_b = torch.bincount(tokens[:, 1], minlength=4) / len(tokens)
    assert torch.allclose(freq_a, torch.tensor([0.5, 0.0, 0.3, 0.2]), atol=0.015) and freq_a[1] == 0
    assert torch.allclose(freq_b, torch.tensor([0.0, 0.5, 0.0, 0.5]), atol=0.015) and freq_b[0] == freq_b[2] == 0
    again = engine.draw(probs, engine.uniforms(0, range(40000), [3] * 40000)).reshape(-1, 2)
    assert torch.equal(tokens, again)  # seeded


def test_a_rows_uniform_is_a_hash_of_its_seed_trajectory_and_position():
    # trajectory 9's token at position 3 draws one number, alone or beside others, first or last
    u = engine.uniforms(0, [5, 9], [10, 3])
    assert engine.uniforms(0, [9], [3])[0] == u[1] and engine.uniforms(0, [9, 5], [3, 10])[1] == u[0]
    assert engine.uniforms(1, [9], [3])[0] != u[1]  # another seed, another draw
    # along one trajectory's positions and across trajectories they look uniform: mean 1/2, sd 1/sqrt(12), in [0, 1)
    for keys, positions in ((range(50000), [0] * 50000), ([7] * 50000, range(50000))):
        x = engine.uniforms(0, keys, positions).flatten()
        assert abs(x.mean() - 0.5) < 0.005 and abs(x.std() - 12 ** -0.5) < 0.005 and 0 <= x.min() and x.max() < 1


def test_the_rows_decoded_at_once_do_not_change_what_is_sampled(examples):
    """A machine with less memory decodes fewer rows at once, yet each row draws its own numbers, so the same seed
    samples the same trajectories (before, one generator's draws went to the rows in step order). The tiny random
    model runs in float64: its next-token distributions are nearly flat, and in fp32 a product's rounding, which
    moves with its rows, would flip some draws."""
    model, tokenizer = load_model("tiny", seed=0)  # its own copy: this test changes the dtype
    model.double()
    scripts = {r: [trust_call("SELECT name FROM sqlite_master"), 12] for r in range(6)}  # then 12 sampled tokens
    runs = [run((model, tokenizer), examples[:3], scripts, group_size=2, temperature=1.0, top_p=0.95, max_turns=2,
                seed=3, max_rows=rows) for rows in (6, 4, 1)]
    sampled = [[t.token_ids for t in trajs] for trajs in runs]
    assert sampled[0] == sampled[1] == sampled[2]
    assert len({tuple(ids) for ids in sampled[0]}) == 6  # and the rows did not all draw alike


# -----------------------------------------------------------------------------
# 4. prefill within its memory bound


def qwen3_4b():
    from transformers import AutoConfig
    from model import SHAPES
    return AutoConfig.for_model("qwen3", **SHAPES["Qwen3-4B"])


def test_prefill_bytes_of_many_long_rows_is_what_the_shapes_say():
    """40 rows of a Qwen3-4B shape, 500 new tokens each over 10,000 keys, bf16: the keys and values read, repeated for
    32 query heads, are 40 x 10,000 x 2 x (8 + 32) x 128 x 2 bytes; beside them the masks and one layer's
    activations. A forward that size would not fit the 2 GiB kept beside the cache."""
    cfg = qwen3_4b()
    keys = 40 * 10_000 * 2 * (8 + 32) * 128 * 2
    masks = 40 * 500 * 10_000 * 3
    activations = 40 * 500 * (2 * 2560 + (3 * 32 + 4 * 8) * 128) * 2
    assert engine.prefill_bytes(cfg, 40, 500, 10_000, 2) == keys + masks + activations
    assert keys + masks + activations > 9e9
    assert engine.prefill_bytes(cfg, 1, 1, 1, 2) == 2 * (2 * 2560 + 3 * 9728)  # one token: the MLP's is larger


def test_prefill_groups_stay_within_the_budget():
    """The 40 long rows above split into forwards of at most PREFILL_BYTES each, every row in exactly one."""
    cfg = qwen3_4b()
    rows = list(range(40))

    def fits(group, tokens):
        return engine.prefill_bytes(cfg, len(group), tokens, 10_000 + tokens, 2) <= engine.PREFILL_BYTES
    groups = engine.length_groups(rows, [500] * 40, fits=fits)
    assert sorted(r for g in groups for r in g) == rows
    assert len(groups) > 1
    assert all(fits(g, 500) for g in groups)
    assert all(not fits(g + [0], 500) for g in groups[:-1])  # each group as large as the budget allows


def test_a_prefill_within_a_small_budget_gives_the_cache_one_forward_gives(tiny, monkeypatch):
    """Rows with histories of different lengths get feeds of 3 to 300 tokens: under a budget too small for two rows
    together or for the longest feed alone, rows go in one by one and the 300-token feed in pieces. The cache holds
    the same keys and the next decode step gives the same logits as with no bound."""
    model = tiny[0]
    feeds = {0: list(range(5, 305)), 1: list(range(7, 10)), 2: list(range(11, 131)), 3: list(range(20, 80))}
    history = [[3] * n for n in (10, 40, 0, 25)]
    itemsize = 4
    budget = engine.prefill_bytes(model.config, 1, 150, 340, itemsize)
    calls = []
    forward_chunks = engine.forward_chunks

    def recording(model, cache, chunks, pad_id, rows=None):
        keys = max(cache.lens[r] for r in rows) + max(map(len, chunks))
        calls.append(engine.prefill_bytes(model.config, len(chunks), max(map(len, chunks)), keys, itemsize))
        return forward_chunks(model, cache, chunks, pad_id, rows=rows)
    outputs = []
    for bound in (None, budget):
        cache = engine.SlotCache(model, 4, "cpu", torch.float32, 512)
        with torch.inference_mode(), engine.use_slot_attention(model):
            forward_chunks(model, cache, history, 0)  # pads behind the shorter rows are overwritten below
            cache.lens = [len(h) for h in history]
            monkeypatch.setattr(engine, "forward_chunks", recording)
            calls.clear()
            engine.prefill(model, cache, feeds, 0, **({} if bound is None else {"budget": bound}))
            monkeypatch.setattr(engine, "forward_chunks", forward_chunks)
            decoder = engine.make_decoder(model, cache, "static")
            logits = engine.decode(model, cache, decoder, [feed[-1] for feed in feeds.values()], 0)
        outputs.append((list(cache.lens), logits, len(calls)))
        if bound is not None:
            assert all(c <= bound for c in calls), calls
    (lens, unbounded, one), (bounded_lens, bounded, many) = outputs
    assert lens == bounded_lens == [10 + 300, 40 + 3, 0 + 120, 25 + 60]
    assert many > one
    assert torch.allclose(bounded, unbounded, atol=1e-4, rtol=0)


# -----------------------------------------------------------------------------
# 5. a failed CUDA graph capture


@pytest.mark.parametrize("kernel,runs", [("sdpa", "the same sdpa step eagerly"), ("varlen", "masked SDPA")])
def test_a_failed_capture_falls_back_to_the_same_step_or_to_masked_sdpa(tiny, kernel, runs, monkeypatch, capsys):
    """The step the capture failed on runs eagerly where it can; the varlen kernel is CUDA-only, so on the CPU its
    step really fails, and decoding falls back to masked SDPA. One line says which."""
    model = tiny[0]
    monkeypatch.setattr(engine, "_notes_said", set())
    cache = engine.SlotCache(model, 4, "cpu", torch.float32, 64)
    cache.reserve(65)
    with torch.inference_mode(), engine.use_slot_attention(model):
        decoder = engine.eager_fallback(model, cache, kernel, engine.batch_buckets(4),
                                        RuntimeError("operation not permitted when stream is capturing"))
    out = capsys.readouterr().out
    assert out.startswith("rollout: CUDA graph capture failed (RuntimeError: operation not permitted")
    assert runs in out
    assert decoder.mode == "static"
    assert decoder.kernel == "sdpa"
    assert ("fails eagerly too" in out) == (kernel == "varlen")
