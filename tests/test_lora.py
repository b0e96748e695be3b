"""LoRA (--lora-r): SFT trains an adapter and merges it, RL trains a fresh one against a reference that is the merged
SFT policy, the decode copy decodes the adapted weights, checkpoints hold adapters and resume exactly.
python -m pytest -q tests/test_lora.py"""
import copy
import json
import sys

import pytest
import torch
from safetensors.torch import load_file

import config
import lora
import memory
import train
from checkpoint import latest_checkpoint
from distributed import compile_layers
from grpo import token_logprobs
from model import load_model, refresh_sampler
from sft import pad_batch, sft_loss

pytestmark = pytest.mark.usefixtures("one_thread")
SETTINGS = lora.LoraSettings(r=4, alpha=8)
QUICK_LORA = ["--quick", "--model", "tiny", "--sft-steps", "2", "--rl-steps", "2", "--eval-limit", "2",
              "--teacher-limit", "12", "--lora-r", "4", "--lora-alpha", "8", "--sft-lr", "1e-2", "--rl-lr", "1e-2"]


def trained_adapter(model, seed):
    """A fresh adapter moved away from its zero start, as training would move it."""
    wrapper = lora.add_adapter(model, SETTINGS, seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return wrapper


def logprobs(model, ids):
    mask = torch.ones_like(ids)
    with torch.no_grad():
        return token_logprobs(model, ids, mask)[0]


def test_the_reference_is_the_merged_sft_policy_not_the_base(tiny):
    model = copy.deepcopy(tiny[0])
    ids = torch.randint(0, 49152, (2, 12), generator=torch.Generator().manual_seed(0))
    base = logprobs(model, ids)
    lora.merge_adapter(trained_adapter(model, seed=1))  # SFT's adapter, merged when SFT ends
    sft_policy = logprobs(model, ids)
    rl = trained_adapter(model, seed=2)  # RL's adapter, already moved
    reference = lora.WithoutAdapter(rl)
    torch.testing.assert_close(logprobs(reference, ids), sft_policy, rtol=0, atol=1e-5)
    assert (logprobs(reference, ids) - base).abs().max() > 1e-2
    assert (logprobs(model, ids) - sft_policy).abs().max() > 1e-2  # the policy itself has RL's adapter on


def test_the_refreshed_decode_copy_decodes_what_the_adapted_model_does(tiny):
    model = copy.deepcopy(tiny[0])
    sampler = copy.deepcopy(model)  # train.py's decode copy, made before any adapter
    trained_adapter(model, seed=3)
    refresh_sampler(sampler, model)
    ids = torch.randint(0, 49152, (1, 6), generator=torch.Generator().manual_seed(1))
    greedy = {}
    for name, m in (("adapted", model), ("copy", sampler)):
        seq = ids
        with torch.no_grad():
            for _ in range(8):  # greedy decoding, each step from the whole sequence
                seq = torch.cat([seq, m(seq).logits[:, -1:].argmax(-1)], dim=1)
        greedy[name] = seq
    assert torch.equal(greedy["copy"], greedy["adapted"])
    assert not any("lora_" in n for n, _ in sampler.named_parameters())  # a plain model: the engine decodes it


def test_adapters_get_gradients_under_non_reentrant_checkpointing(tiny):
    # what distribute() turns on for a GPU, here on the CPU: the frozen embeddings' output needs no gradient
    model = copy.deepcopy(tiny[0])
    model.activation_checkpointing_enable({"use_reentrant": False})
    model.config.use_cache = False
    lora.add_adapter(model, SETTINGS, seed=4)
    model.train()
    rows = [(list(range(100, 130)), [0] * 10 + [1] * 20)]
    ids, mask = pad_batch(rows, 0, "cpu")
    sft_loss(model, ids, mask, 20.0).backward()
    grads = {n: p.grad for n, p in model.named_parameters() if "lora_" in n}
    assert grads and all(g is not None for g in grads.values())
    assert all(g.abs().sum() > 0 for n, g in grads.items() if "lora_B" in n)  # (A's is 0 while B is still 0)
    assert all(p.grad is None for n, p in model.named_parameters() if "lora_" not in n)


def test_adapters_added_after_compile_train_as_without_it(tiny):
    # --compile compiles each decoder layer (distribute) before a stage adds its adapter: the compiled layers must
    # run the Linear modules peft swapped in, and give the adapters the gradients they get uncompiled
    rows = [(list(range(100, 130)), [0] * 10 + [1] * 20)]
    ids, mask = pad_batch(rows, 0, "cpu")
    grads = {}
    for name in ("eager", "compiled"):
        model = copy.deepcopy(tiny[0])
        if name == "compiled":
            compile_layers(model, backend="aot_eager")  # autograd traced as inductor's is, without a C++ build
            assert model.model.layers[0]._compiled_call_impl is not None
        trained_adapter(model, seed=5)
        model.train()
        sft_loss(model, ids, mask, 20.0).backward()
        grads[name] = {n: p.grad for n, p in model.named_parameters() if "lora_" in n}
    assert grads["compiled"].keys() == grads["eager"].keys() and grads["eager"]
    for n, g in grads["eager"].items():
        torch.testing.assert_close(grads["compiled"][n], g, rtol=1e-4, atol=1e-6)
    assert any(g.abs().sum() > 0 for g in grads["compiled"].values())


def test_the_memory_check_counts_the_adapters_not_the_weights(tiny):
    model = copy.deepcopy(tiny[0])
    full = config.get_args(["--model", "tiny", "--quick"])
    with_lora = config.get_args(["--model", "tiny", "--quick", "--lora-r", "4", "--lora-alpha", "8"])
    predicted = memory.trained_params(model, with_lora)
    lora.add_adapter(model, SETTINGS, seed=0)
    assert predicted == sum(p.numel() for p in model.parameters() if p.requires_grad)
    params = sum(p.numel() for p in tiny[0].parameters())
    saved = memory.training_bytes(tiny[0], full, bf16=False) - memory.training_bytes(tiny[0], with_lora, bf16=False)
    # fp32: full fine-tuning's gradients and moments (12 bytes a weight) against the adapters' and a decode copy's 4
    assert saved == params * 12 - predicted * 12 - params * 4 > 0


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("lora")
    train.main(QUICK_LORA + ["--out-dir", str(out)])
    return out / "quick"


def test_a_lora_checkpoint_holds_adapters_and_loads_merged(lora_run, tmp_path):
    ckpt = latest_checkpoint(lora_run)
    info = json.loads((ckpt / "lora.json").read_text())
    assert (info["base"], info["r"], info["merged"]) == ("tiny", 4, 1)  # RL's adapter on SFT's, merged
    assert not list(ckpt.glob("model*.safetensors"))
    sft_adapter = load_file(ckpt / "merged-0.safetensors")
    assert any(t.abs().sum() > 0 for n, t in sft_adapter.items() if "lora_B" in n)  # SFT moved it
    model, _ = load_model(str(ckpt))
    assert not lora.has_adapter(model)
    ids = torch.randint(0, 49152, (1, 10), generator=torch.Generator().manual_seed(2))
    assert (logprobs(model, ids) - logprobs(load_model("tiny", seed=0)[0], ids)).abs().max() > 1e-3
    import subprocess
    out = subprocess.run([sys.executable, "lora.py", "merge", str(ckpt), str(tmp_path / "merged")],
                         cwd=train.__file__.rsplit("/", 1)[0], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    from transformers import AutoModelForCausalLM
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    torch.testing.assert_close(logprobs(plain, ids), logprobs(model, ids), rtol=0, atol=1e-5)


def test_a_killed_lora_run_resumes_exactly(lora_run, tmp_path):
    with pytest.raises(SystemExit):  # killed right after the checkpoint at global step 3 (RL step 1)
        train.main(QUICK_LORA + ["--out-dir", str(tmp_path), "--stop-after", "3"])
    train.main(QUICK_LORA + ["--out-dir", str(tmp_path), "--resume", "--run-name", "quick"])
    resumed = latest_checkpoint(tmp_path / "quick")
    whole = latest_checkpoint(lora_run)
    for name in ("adapter.safetensors", "merged-0.safetensors"):
        a = load_file(whole / name)
        b = load_file(resumed / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name

    assert metrics(tmp_path / "quick") == metrics(lora_run)


def metrics(run):
    return [{k: v for k, v in json.loads(line).items() if not k.startswith("time")}
            for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_lora_on_two_ranks_trains_sfts_adapter_as_one_process_does(lora_run, tmp_path):
    # two gloo ranks, each SFT step's batch split between them: the adapters' gradients summed over ranks
    from test_train import ROOT, torchrun
    torchrun(2, ROOT / "train.py", *QUICK_LORA, "--out-dir", tmp_path, "--run-name", "two")
    one = [r["loss"] for r in metrics(lora_run) if r["stage"] == "sft"]
    two = [r["loss"] for r in metrics(tmp_path / "two") if r["stage"] == "sft"]
    assert len(two) == 2 and two == pytest.approx(one, rel=1e-4)
    a = load_file(latest_checkpoint(lora_run) / "merged-0.safetensors")
    b = load_file(latest_checkpoint(tmp_path / "two") / "merged-0.safetensors")
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-6)
    assert [r["step"] for r in metrics(tmp_path / "two") if r["stage"] == "rl"] == [1, 2]


def test_lora_under_fsdp_stops_at_once(tmp_path):
    from cli import UserError
    with pytest.raises(UserError, match="--lora-r does not run under --fsdp"):
        train.main(QUICK_LORA + ["--fsdp", "--out-dir", str(tmp_path)])
    assert not (tmp_path / "quick").exists()
