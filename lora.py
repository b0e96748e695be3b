"""
LoRA through peft: low-rank adapters on the decoder's linear layers, so that SFT and GRPO train a few million
parameters of a 7B model on one GPU with the same code, with no full-size optimizer state and no reference copy.

    python train.py --lora-r 16 --lora-alpha 32           # SFT trains an adapter and merges it; RL trains a new one
    python lora.py merge out/<run>/ckpt-000060 out/merged  # a plain save_pretrained folder of a LoRA checkpoint

The model stays the bare Hugging Face module with the adapters injected in place, so code that reaches model.model
and model.lm_head runs unchanged; its own weights are frozen and the optimizer sees the adapters alone.
- SFT's adapter is merged into the weights when SFT ends: RL starts from that policy and trains a fresh adapter, and
  KL's reference is the same model with that adapter switched off (WithoutAdapter): no copy.
- The decode copy takes the merged weights (merged_weights), so the engine decodes a plain model.
- A checkpoint holds the adapter, the adapters merged before it, and the model they sit on (lora.json);
  model.load_model loads one merged.
"""
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from peft.tuners.lora import LoraLayer
from safetensors.torch import load_file, save_file

ADAPTER = "default"  # peft's name for a model's one adapter


@dataclass(frozen=True)
class LoraSettings:
    r: int                      # the adapters' rank
    alpha: float                # their scale is alpha / r
    targets: str = "all-linear"  # peft's target_modules: every linear layer of the decoder (not the LM head)


def add_adapter(model, settings, seed):
    """A fresh adapter injected into model in place (peft), seeded so that every rank starts from the same one;
    the model's own weights are frozen. Returns peft's wrapper, whose merge and disable_adapter act on model."""
    targets = settings.targets if settings.targets == "all-linear" else settings.targets.split(",")
    config = LoraConfig(r=settings.r, lora_alpha=settings.alpha, target_modules=targets, lora_dropout=0.0)
    with torch.random.fork_rng(devices=[]):  # lora_A's init: its own seed, the run's streams untouched
        torch.manual_seed(seed)
        wrapper = get_peft_model(model, config)
    return wrapper


def merge_adapter(wrapper):
    """The adapter added into the weights it adapts; the model is a plain one again (its weights stay frozen)."""
    return wrapper.merge_and_unload()


def has_adapter(model):
    return any(isinstance(m, LoraLayer) for m in model.modules())


def adapter_state(model):
    """{name: tensor} of the adapter's weights, by the model's own parameter names (a copy on the CPU)."""
    return {n: p.detach().to("cpu", copy=True).contiguous() for n, p in model.named_parameters() if "lora_" in n}


def load_adapter_state(model, state):
    """The adapter's weights from adapter_state's names; every adapter weight must be there."""
    params = dict(model.named_parameters())
    missing = [n for n in params if "lora_" in n and n not in state]
    unexpected = [n for n in state if n not in params]
    if missing or unexpected:
        raise ValueError(f"the adapter does not fit the model (missing {missing[:3]}, unexpected {unexpected[:3]}): "
                         "was it trained with another --lora-r or --lora-targets?")
    with torch.no_grad():
        for n, t in state.items():
            params[n].copy_(t)


def merged_weights(model):
    """{name: weight} of the model as a plain one: a LoRA layer's own weight plus its adapter's delta, under the
    names a model without adapters has (the decode copy's)."""
    layers = {n: m for n, m in model.named_modules() if isinstance(m, LoraLayer)}
    out = {}
    for name, p in model.named_parameters():
        if "lora_" in name:
            continue
        if ".base_layer." not in name:
            out[name] = p
            continue
        plain = name.replace(".base_layer.", ".")
        layer = layers[plain.rsplit(".", 1)[0]]
        out[plain] = p + layer.get_delta_weight(ADAPTER).to(p.dtype) if plain.endswith(".weight") else p
    return out


class WithoutAdapter(torch.nn.Module):
    """The policy with its adapter switched off while it runs: RL's KL reference under LoRA, which is the policy RL
    started from (SFT's adapter merged, RL's not yet trained), at no copy. It exposes what grpo.token_logprobs
    reads: the decoder and the LM head (the LM head carries no adapter)."""

    def __init__(self, wrapper):
        super().__init__()
        self.wrapper = wrapper

    def get_decoder(self):
        return self.run_decoder

    def run_decoder(self, **kwargs):
        with self.wrapper.disable_adapter():
            return self.wrapper.get_base_model().get_decoder()(**kwargs)

    def get_output_embeddings(self):
        return self.wrapper.get_base_model().get_output_embeddings()

# -----------------------------------------------------------------------------
# checkpoints: lora.json, the adapter, and the adapters merged before it


def save_adapters(folder, model, merged, settings, base, seed):
    """Write the model's adapter and the merged ones (in order) into folder, with lora.json naming the --model they
    sit on (and the seed that builds it, for the tiny test model)."""
    folder = Path(folder)
    save_file(adapter_state(model), folder / "adapter.safetensors")
    for i, state in enumerate(merged):
        save_file(state, folder / f"merged-{i}.safetensors")
    info = {"base": str(base), "base_seed": seed, "merged": len(merged), **asdict(settings)}
    (folder / "lora.json").write_text(json.dumps(info, indent=1) + "\n")


def read_lora(folder):
    """(lora.json's dict, settings, [merged adapter states]) of a LoRA checkpoint folder."""
    info = json.loads((Path(folder) / "lora.json").read_text())
    settings = LoraSettings(info["r"], info["alpha"], info["targets"])
    merged = [load_file(Path(folder) / f"merged-{i}.safetensors") for i in range(info["merged"])]
    return info, settings, merged


def restore(model, folder, seed):
    """model (the checkpoint's base, loaded) as the checkpoint left it: the merged adapters added into its weights,
    its adapter injected with the saved weights. Returns peft's wrapper and the merged adapters' states."""
    _, settings, merged = read_lora(folder)
    for state in merged:
        wrapper = add_adapter(model, settings, seed)
        load_adapter_state(model, state)
        merge_adapter(wrapper)
    wrapper = add_adapter(model, settings, seed)
    load_adapter_state(model, load_file(Path(folder) / "adapter.safetensors"))
    return wrapper, merged


def load_merged(folder, device="cpu", dtype=torch.float32):
    """A LoRA checkpoint as a plain model and its tokenizer: its base (model.load_model's, itself perhaps a LoRA
    checkpoint), every adapter added into the weights."""
    from model import load_model  # model.load_model calls this for a folder with lora.json
    info, _, _ = read_lora(folder)
    model, tokenizer = load_model(info["base"], device=device, dtype=dtype, seed=info["base_seed"])
    wrapper, _ = restore(model, folder, info["base_seed"])
    model = merge_adapter(wrapper)
    return model.requires_grad_(True).eval(), tokenizer


if __name__ == "__main__":
    from cli import ArgumentParser, die
    parser = ArgumentParser(description=__doc__)
    parser.add_argument("command", choices=["merge"], help="merge: write a LoRA checkpoint as a plain model folder")
    parser.add_argument("checkpoint", help="a train.py checkpoint folder written with --lora-r")
    parser.add_argument("out", help="the folder to write (save_pretrained: weights, config, tokenizer)")
    args = parser.parse_args()
    if not (Path(args.checkpoint) / "lora.json").is_file():
        die(f"{args.checkpoint} has no lora.json: pass a checkpoint of a run with --lora-r (others load as they are)")
    if Path(args.out).exists():
        die(f"{args.out} exists: pass a new folder")
    model, tokenizer = load_merged(args.checkpoint)
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    print(f"wrote {args.out}: loads with AutoModelForCausalLM.from_pretrained")
