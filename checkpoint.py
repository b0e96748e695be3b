"""
Checkpoints and resume: a checkpoint is a save_pretrained folder (weights and tokenizer, loadable with a plain
from_pretrained) plus the trainer's state (optimizer, scheduler, each rank's RNG, the run's position, its
evaluations); --resume continues the latest one exactly. A new run never deletes what it did not write.

    python train.py --model tiny --quick --run-name q --stop-after 3      # stopped like a killed run
    python train.py --model tiny --quick --run-name q --resume            # goes on as if it never stopped
"""
import json
import os
import random
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from cli import UserError
from distributed import barrier
from lora import LoraSettings, save_adapters

# -----------------------------------------------------------------------------
# a checkpoint: save_pretrained weights + tokenizer, trainer state, per-rank RNG; temp dir then atomic rename


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


def save_checkpoint(run_dir, gstep, model, tokenizer, optimizer, scheduler, state, args, rank, world, merged=()):
    """out/<run-name>/ckpt-<global step>: loadable with AutoModelForCausalLM.from_pretrained; keeps the last K. With
    LoRA adapters it holds them instead of the weights: the model's, the ones merged before it (merged: their states,
    in order), and lora.json naming --model (model.load_model loads it merged)."""
    final = checkpoint_dir(run_dir, gstep)
    tmp = run_dir / f".tmp-ckpt-{gstep:06d}"
    weights = full_state_dict(model, args.fsdp)  # collective under FSDP: every rank takes part
    opt = optim_state(model, optimizer, args.fsdp)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        if args.lora_r:
            settings = LoraSettings(args.lora_r, args.lora_alpha, args.lora_targets)
            save_adapters(tmp, model, merged, settings, args.model, args.seed)
        else:
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


def run_name(name, resume):
    """The run's folder name: the one given, else a new run-<date>-<time> (rank 0's, on every rank)."""
    if name is not None:
        return name
    if resume:
        raise UserError("--resume needs --run-name: the folder under --out-dir of the run to continue")
    name = [time.strftime("run-%Y%m%d-%H%M%S")]
    if dist.is_initialized():
        dist.broadcast_object_list(name, src=0)
    return name[0]


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
# what train.py calls: where a run starts, and what a stage leaves behind


def start_state(run_dir, resume, stage):
    """The latest checkpoint to resume from (None for a new run) and the run's position: its stage and step, its
    global step, its evaluations and practice measurements, RL's pool, the refill stream's position, the log lines."""
    state = {"stage": stage, "step": 0, "gstep": 0, "evals": {}, "practice": {}, "rl_pool": None, "refill": 0,
             "log_lines": None, "rollout_lines": None}
    ckpt = latest_checkpoint(run_dir) if resume else None
    if ckpt is not None:
        saved = json.loads((ckpt / "state.json").read_text())
        state.update({k: v for k, v in saved.items() if k in state}, gstep=saved["global_step"])
    return ckpt, state


def save_if_due(run_dir, state, log, model, tokenizer, opt, sched, args, rank, world, final, merged=()):
    """A checkpoint every --ckpt-every global steps and at a stage's end; --stop-after exits right after one."""
    if (args.ckpt_every and state["gstep"] % args.ckpt_every == 0) or final:
        state.update(log.counts())
        save_checkpoint(run_dir, state["gstep"], model, tokenizer, opt, sched, state, args, rank, world, merged)
    if args.stop_after and state["gstep"] == args.stop_after:
        if rank == 0:
            print(f"--stop-after {args.stop_after}: stopping like a killed run")
        raise SystemExit(0)


def keep_in_last_checkpoint(run_dir, state, log, args, rank):
    """The stage's last checkpoint keeps what was measured after it (its state is written again): a resume skips
    the measurement."""
    ckpt_dir = checkpoint_dir(run_dir, state["gstep"])
    if rank == 0 and ckpt_dir.exists():
        state.update(log.counts())
        write_state(ckpt_dir, state, state["gstep"], args)
