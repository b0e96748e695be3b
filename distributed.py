"""
Ranks: torchrun's world (WORLD_SIZE, RANK, LOCAL_RANK; plain python is a world of one), the model placed for
training on it (FSDP2 shards or DDP replicas, gradient checkpointing and per-layer compile on a GPU), and the two
collectives the rest of the code needs.

    torchrun --nproc_per_node 8 train.py --model Qwen/Qwen3-4B --fsdp      # train.py calls setup_distributed
"""
import os

import torch
import torch.distributed as dist

# -----------------------------------------------------------------------------
# setup and placement


def setup_distributed(args):
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if world > 1 and not dist.is_initialized():
        cuda = args.device.startswith("cuda")
        if cuda:
            torch.cuda.set_device(local)
        dist.init_process_group("nccl" if cuda else "gloo")
    device = f"cuda:{local}" if args.device.startswith("cuda") else args.device
    return rank, world, device


def shard(model, bf16_on_gpu=False):
    """FSDP2: fully_shard each decoder layer, then the root. On GPU with bf16, layers compute in bf16 and reduce
    gradients in fp32 over fp32 sharded master weights."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16_on_gpu else \
        MixedPrecisionPolicy()
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return model


def compile_layers(model, backend="inductor"):
    """torch.compile each decoder layer in place, to fuse its elementwise ops (RMSNorm, rotary, SwiGLU, casts), which
    dominate a GPU step's kernel time (docs/training.md, Compile). In place, so state_dict keys, checkpoints, DDP and
    FSDP2 see the same modules; one layer's code serves all of them."""
    for layer in model.model.layers:
        layer.compile(backend=backend)


def distribute(model, fsdp, world, device, bf16=False, compile=False):
    """Place the model for training on `world` ranks: FSDP2 (shard), or the same starting weights on every rank
    (DDP would broadcast them too, but RL uses the bare model). Gradient checkpointing on GPU; compile: per layer.
    Returns wrap(module): DDP around a module under plain data parallelism, else the module itself."""
    cuda = str(device).startswith("cuda")
    if cuda:
        model.activation_checkpointing_enable()  # transformers 5 renamed gradient_checkpointing_enable
        model.config.use_cache = False
    if compile:  # after checkpointing (its wrapper calls the compiled layer), before sharding: torchtitan's order
        compile_layers(model)
    if fsdp and world > 1:
        shard(model, bf16_on_gpu=cuda and bf16)
    elif world > 1:
        for p in model.state_dict().values():
            dist.broadcast(p, 0)

    def wrap(module):
        if world > 1 and not fsdp:
            from torch.nn.parallel import DistributedDataParallel
            return DistributedDataParallel(module, device_ids=[int(os.environ.get("LOCAL_RANK", 0))] if cuda else None)
        return module
    return wrap

# -----------------------------------------------------------------------------
# collectives


def all_reduce_sum(x):
    if dist.is_initialized():
        dist.all_reduce(x)
    return x


def barrier():
    if dist.is_initialized():
        dist.barrier()


def unwrap(model):
    return model.module if hasattr(model, "module") else model
