"""
Ranks: torchrun's world (WORLD_SIZE, RANK, LOCAL_RANK; plain python is a world of one), the model placed for
training on it (FSDP2 shards or whole replicas, gradient checkpointing and per-layer compile on a GPU), the reductions
over ranks the rest of the code needs, and the step that makes a rank's gradient the global one (SFT's and
GRPO's updates).

    torchrun --nproc_per_node 8 train.py --model Qwen/Qwen3-4B --fsdp      # train.py calls setup_distributed
"""
import os

import torch
import torch.distributed as dist

# -----------------------------------------------------------------------------
# setup and placement


def group_backends(device) -> str:
    """The backends of the ranks' process group: on CUDA, NCCL for GPU tensors and gloo for CPU ones (NCCL serves
    CUDA tensors only), so a count made on the host reduces where it is, with no copy to the GPU and back."""
    return "cpu:gloo,cuda:nccl" if torch.device(device).type == "cuda" else "gloo"


def setup_distributed(args):
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if world > 1 and not dist.is_initialized():
        if args.device.startswith("cuda"):
            torch.cuda.set_device(local)
        dist.init_process_group(group_backends(args.device))
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
    """Place the model for training on `world` ranks: FSDP2 (shard), or the same starting weights on every rank.
    No DDP wrapper: both stages divide each rank's loss by the global normaliser and sum the gradients
    (sum_grads_over_ranks). Gradient checkpointing on GPU; compile: per layer."""
    cuda = str(device).startswith("cuda")
    if cuda:
        # non-reentrant: LoRA's adapters get their gradient though the frozen embeddings' output needs none
        model.activation_checkpointing_enable({"use_reentrant": False})  # transformers 5: gradient_checkpointing_...
        model.config.use_cache = False
    if compile:  # after checkpointing (its wrapper calls the compiled layer), before sharding: torchtitan's order
        compile_layers(model)
    if fsdp and world > 1:
        shard(model, bf16_on_gpu=cuda and bf16)
    elif world > 1:
        for p in model.state_dict().values():
            dist.broadcast(p, 0)

# -----------------------------------------------------------------------------
# collectives: every function is a no-op in a world of one. Each rank holds whole GRPO groups and divides its loss by
# the global normaliser, so per-rank losses add up to the single-process loss and the global gradient is their sum.


def world_size():
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def over_ranks(x: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """x reduced over ranks (summed by default), as a new tensor: x itself is left as it was."""
    if world_size() > 1:
        x = x.clone()
        dist.all_reduce(x, op=op)
    return x


def stats_over_ranks(sums: dict, lows: dict, highs: dict, device):
    """One dict of this rank's statistics over all ranks: sums summed, lows their minimum, highs their maximum."""
    total = over_ranks(torch.tensor(list(sums.values()), dtype=torch.float64, device=device)).tolist()
    low = over_ranks(torch.tensor(list(lows.values()), dtype=torch.float64, device=device), dist.ReduceOp.MIN).tolist()
    high = over_ranks(torch.tensor(list(highs.values()), dtype=torch.float64, device=device), dist.ReduceOp.MAX).tolist()
    return dict(zip(sums, total)) | dict(zip(lows, low)) | dict(zip(highs, high))


def all_ranks(obj) -> list:
    """obj of every rank, in rank order ([obj] in a world of one): the object gathers of dicts and records."""
    if world_size() == 1:
        return [obj]
    gathered = [None] * world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def barrier():
    if dist.is_initialized():
        dist.barrier()

# -----------------------------------------------------------------------------
# gradients of a bare or FSDP2-sharded model


def is_fsdp(model) -> bool:
    return any(type(p).__name__ == "DTensor" for p in model.parameters())  # FSDP2 fully_shard'ed parameters


def fsdp_fillers(model, passes, device):
    """How many extra forward passes this rank runs beside its own `passes`: FSDP gathers parameters in every forward,
    so every rank must run as many as the busiest one."""
    if not is_fsdp(model):
        return 0
    most = int(over_ranks(torch.tensor(max(passes, 1), device=device), dist.ReduceOp.MAX).item())
    return most - passes


def sum_grads_over_ranks(model):
    """Make every rank's gradient the gradient of the global loss. Each rank's loss is already divided by the global
    normaliser, so the global gradient is the SUM over ranks (DDP and FSDP would average instead). One all-reduce
    per parameter, after the backward (SFT and GRPO alike)."""
    world = world_size()
    if world == 1:
        return
    if is_fsdp(model):  # FSDP2 has reduce-scattered with a mean: undo the 1/world
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(world)
        return
    for p in model.parameters():
        if p.requires_grad:
            if p.grad is None:  # a rank whose rows were all filtered still joins the all-reduce
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
