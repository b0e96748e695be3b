"""GPU-only: rollout and the GRPO step on CUDA agree with the CPU, where the rest of the suite pins them down.
Skipped without a CUDA device; on a GPU machine: python -m pytest tests/test_cuda.py
"""
import copy

import pytest
import torch

import engine
from grpo import GRPOConfig, grpo_step
from distributed import compile_layers
from model import load_model
from test_rollout import check_bf16_autocast_rollout, replay_logprobs, run, trust_answer, trust_call

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: checks rollout and GRPO "
                                "on the GPU against the CPU")


@pytest.fixture(scope="module")
def cpu_and_cuda():
    """The tiny fixture in fp32 on the CPU and the same weights on the GPU (TF32 off: fp32 means fp32 there too)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model, tokenizer = load_model("tiny")
    return (model, tokenizer), (copy.deepcopy(model).to("cuda"), tokenizer)


def test_greedy_rollout_on_cuda_equals_the_cpu_and_each_row_alone(cpu_and_cuda, examples):
    # 6 questions, ragged tool results; rows 0 and 3 answer in turn 1 and leave the batch (the cache is compacted)
    cpu, cuda = cpu_and_cuda
    scripts = {r: [trust_call(f"SELECT * FROM sqlite_master LIMIT {r % 4 + 1}")] +
               ([trust_answer("SELECT 1")] if r % 3 == 0 else []) for r in range(6)}
    on_cpu, on_cuda = run(cpu, examples[:6], scripts), run(cuda, examples[:6], scripts)
    for r in range(6):
        assert on_cuda[r].token_ids == on_cpu[r].token_ids, f"row {r}: CUDA decodes other tokens than the CPU"
        assert on_cuda[r].stop_reason == on_cpu[r].stop_reason
        alone = run(cuda, examples[r:r + 1], {0: scripts[r]})[0]
        assert alone.token_ids == on_cuda[r].token_ids, f"row {r} differs when decoded alone on CUDA"


def test_sampled_cuda_logprobs_match_a_cpu_replay(cpu_and_cuda, examples):
    cpu, cuda = cpu_and_cuda
    scripts = {r: [trust_call(f"SELECT * FROM sqlite_master LIMIT {r + 1}"), 12 + 4 * r] for r in range(4)}
    trajs = run(cuda, examples[:2], scripts, group_size=2, temperature=0.8, top_p=0.9, seed=123)
    for traj in trajs:
        mask = torch.tensor(traj.loss_mask, dtype=torch.bool)
        assert mask.sum() > 10
        assert torch.allclose(replay_logprobs(cpu[0], traj, 0.8)[mask], torch.tensor(traj.sample_logprobs)[mask],
                              atol=1e-4, rtol=0)


def test_bf16_autocast_rollout_on_cuda_keeps_a_bf16_cache_and_replays_closely(cpu_and_cuda, examples):
    cpu, cuda = cpu_and_cuda
    check_bf16_autocast_rollout(cuda, examples, cpu[0], atol=5e-2)  # bf16 on CUDA against an fp32 replay on the CPU


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_grpo_step_with_gradient_checkpointing_on_cuda_updates_as_the_cpu_does(cpu_and_cuda, examples, compiled):
    """train.py turns on gradient checkpointing for CUDA (and --compile compiles each layer with inductor): they must
    recompute and fuse, not change, the update."""
    cpu, cuda = cpu_and_cuda
    scripts = {r: [trust_call("SELECT name FROM sqlite_master"), 10] for r in range(4)}
    trajs = run(cpu, examples[:1], scripts, group_size=4, temperature=1.0, max_turns=2, seed=7)
    rewards = [{"full": 1.0, "schema": 0.0}] + [{"full": 0.0, "schema": 0.0}] * 3
    cfg = GRPOConfig(group_size=4, schema_lambda=0.0, grad_clip=1e9, pad_id=cpu[1].pad_token_id)
    models = [copy.deepcopy(cpu[0]), copy.deepcopy(cuda[0])]
    models[1].activation_checkpointing_enable()
    if compiled:
        compile_layers(models[1])
    metrics = [grpo_step(m, torch.optim.SGD(m.parameters(), lr=0.05), trajs, rewards, cfg) for m in models]
    assert metrics[0]["loss"] == pytest.approx(metrics[1]["loss"], abs=1e-5)
    moved = max((a - b).abs().max().item() for a, b in zip(models[0].parameters(), cpu[0].parameters()))
    assert moved > 1e-3  # the step did change the weights
    for a, b in zip(models[0].parameters(), models[1].cpu().parameters()):
        assert torch.allclose(a, b, atol=1e-5, rtol=0)


def test_graph_replay_decodes_as_the_eager_step_and_the_check_mode_agrees(cpu_and_cuda, examples, monkeypatch):
    """6 rows, 4 decoded at once (buckets 4, 2, 1 as rows finish): replayed graphs give the eager step's tokens and
    log-probs; SQLRL_CUDA_GRAPHS=check compares every replay with the eager step and raises on a difference."""
    _, cuda = cpu_and_cuda
    scripts = {r: [trust_call(f"SELECT * FROM sqlite_master LIMIT {r % 4 + 1}"), 5 + 3 * r] for r in range(6)}
    replayed = run(cuda, examples[:6], scripts, max_rows=4, decode="graphs")
    eager = run(cuda, examples[:6], scripts, max_rows=4, decode="static")
    monkeypatch.setenv(engine.GRAPHS_ENV, "check")
    checked = run(cuda, examples[:6], scripts, max_rows=4)
    for a, b, c in zip(replayed, eager, checked):
        assert a.token_ids == b.token_ids == c.token_ids
        assert torch.allclose(torch.tensor(a.sample_logprobs), torch.tensor(b.sample_logprobs), atol=1e-5, rtol=0)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_varlen_flash_kernel_reads_each_rows_own_keys_as_masked_sdpa_does(head_dim):
    """PyTorch's own FlashAttention-2 in varlen mode (seqused_k) against SDPA under a mask, in bf16, on rows of
    different lengths: the decode step's logits agree to bf16 rounding, and so do its greedy picks."""
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.for_model("qwen3", hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                  num_attention_heads=8, num_key_value_heads=2, head_dim=head_dim, vocab_size=1000)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).cuda().eval()
    assert engine.decode_kernel("cuda", torch.bfloat16, head_dim) in ("varlen", "flash_attn")
    cache = engine.SlotCache(model, 4, "cuda", torch.bfloat16, 300)
    chunks = [list(range(1, n)) for n in (40, 200, 7, 120)]
    with torch.inference_mode(), engine.use_slot_attention(model):
        engine.prefill(model, cache, dict(enumerate(chunks)), 0)
        decoder = engine.make_decoder(model, cache, "static")
        feeds = [c[-1] for c in chunks]
        engine.decode(model, cache, decoder, feeds, 0)  # fills the step's inputs; the steps below rewrite its keys
        masked = engine.decode_step(model, cache, 4, "sdpa")
        fused = engine.decode_step(model, cache, 4, decoder.kernel)
    assert (fused - masked).abs().max().item() < 5e-2 * masked.abs().max().item()
    assert torch.equal(fused.argmax(-1), masked.argmax(-1))


def test_a_failed_capture_falls_back_to_the_eager_step_and_says_so(cpu_and_cuda, examples, monkeypatch, capsys):
    _, cuda = cpu_and_cuda
    scripts = {r: [trust_call(f"SELECT * FROM sqlite_master LIMIT {r + 1}"), 6] for r in range(3)}
    eager = run(cuda, examples[:3], scripts, decode="static")

    def broken_capture(model, cache, decoder):
        raise RuntimeError("operation not permitted when stream is capturing")
    monkeypatch.setattr(engine, "capture", broken_capture)
    monkeypatch.setattr(engine, "_notes_said", set())
    fallback = run(cuda, examples[:3], scripts, decode="graphs")
    assert "CUDA graph capture failed (RuntimeError: operation not permitted" in capsys.readouterr().out
    assert [t.token_ids for t in fallback] == [t.token_ids for t in eager]
