"""
Memory: how much room a run has, and how it gives memory back. The room is a GPU's free memory, or the host's
MemAvailable under any cgroup limit (a container's); the KV cache takes the rows that fit in it; training on a CPU
must fit before any work starts; and glibc's heap returns what training freed, with training on a thread of its own
so that decoding never re-touches training's heap. train.py, rollout.py and eval.py size themselves with it.

    python train.py    # prints "rollout: 128 rows x 1,537 KV slots need 9.1 GB (...): decoding 60 rows at once"
"""
import ctypes
import os
import threading

import torch

import cli
from engine import PREFILL_BYTES, head_dim, say_once

CACHE_HEADROOM = 2 * PREFILL_BYTES  # kept free beside the KV cache: a prefill's bound, as much for logits, sampling
M_MMAP_THRESHOLD = -3         # glibc's mallopt parameter

# -----------------------------------------------------------------------------
# the room this process has


def free_memory(device):
    """Bytes this process can still take: a GPU's free memory with the blocks PyTorch's allocator caches but does not
    use (it hands them out again, or frees them before it would fail), or the host's MemAvailable, lowered to what
    the memory cgroups this process runs in still allow (a container's limit); None where unknown."""
    if device.type == "cuda":
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return torch.cuda.mem_get_info(device)[0] + cached
    host = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    host = int(line.split()[1]) * 1024
    except OSError:
        pass
    known = [room for room in (host, cgroup_room()) if room is not None]
    return min(known) if known else None


# cgroup v2 and v1 name the same three numbers differently: the limit, the usage, and the reclaimable page cache
CGROUP_FILES = {"v2": ("memory.max", "memory.current", "inactive_file"),
                "v1": ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")}


def cgroup_room(proc_cgroup="/proc/self/cgroup", mount="/sys/fs/cgroup"):
    """The least room left under any memory limit on this process's cgroup or its ancestors: limit - usage + the
    inactive page cache the kernel reclaims before it kills (None: no limit, or no cgroups to read)."""
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    rooms = []
    for line in lines:
        if line.count(":") < 2:
            continue
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # the unified hierarchy, mounted on its own or beside v1's as "unified"
            version = "v2"
            root = mount if os.path.exists(f"{mount}/cgroup.controllers") else f"{mount}/unified"
        elif "memory" in controllers.split(","):
            version = "v1"
            root = f"{mount}/memory"
        else:
            continue
        if not os.path.isdir(root):
            continue
        here = os.path.normpath(root + path)
        if not os.path.isdir(here):  # a container without its own cgroup namespace sees its cgroup as the root
            here = root
        while True:
            room = _cgroup_dir_room(here, *CGROUP_FILES[version])
            if room is not None:
                rooms.append(room)
            if here == root:
                break
            here = os.path.dirname(here)
    return min(rooms) if rooms else None


def _cgroup_dir_room(folder, limit_file, usage_file, cache_key):
    """limit - usage + inactive page cache of one cgroup folder; None without a limit (v2's "max", v1's near 2**63)."""
    try:
        with open(f"{folder}/{limit_file}") as f:
            limit = f.read().strip()
        with open(f"{folder}/{usage_file}") as f:
            usage = int(f.read())
        with open(f"{folder}/memory.stat") as f:
            stat = dict(line.split() for line in f if line.strip())
    except (OSError, ValueError):
        return None
    if limit == "max" or int(limit) >= 2 ** 60:
        return None
    return int(limit) - usage + int(stat.get(cache_key, 0))

# -----------------------------------------------------------------------------
# the KV cache's rows


def kv_bytes_per_row(config, limit, dtype):
    """Bytes of one cache row of limit + 1 slots (keys and values of every layer)."""
    return 2 * config.num_hidden_layers * (limit + 1) * config.num_key_value_heads * head_dim(config) * dtype.itemsize


def rows_that_fit(rows, bytes_per_row, free_bytes, reserve=CACHE_HEADROOM):
    """How many rows' KV cache fit in free_bytes, keeping `reserve` bytes for everything else (at most `rows`)."""
    return max(0, min(rows, int((free_bytes - reserve) // bytes_per_row)))


def cache_rows(model, rows, device, dtype, limit, budget=None, reserve=CACHE_HEADROOM):
    """Rows decoded at once: all of them, unless fewer full-length rows fit in the free memory less `reserve` (GPU; or
    the host's, given a budget) or in `budget` bytes, which is then said on one line. A GPU cache is allocated whole,
    at rows x (limit + 1) slots, since growing it would move the buffers a captured graph reads; a CPU cache commits
    pages as rows grow, so without a budget it is not sized at all. Raises ValueError when not even one row fits."""
    device = torch.device(device)
    if device.type != "cuda" and budget is None:
        return rows
    per_row = kv_bytes_per_row(model.config, limit, dtype)
    free = free_memory(device)
    fit = rows if free is None else rows_that_fit(rows, per_row, free, reserve)
    if budget is not None:
        fit = min(fit, int(budget // per_row))
    need = f"{rows} rows x {limit + 1:,} KV slots need {rows * per_row / 1e9:.1f} GB"
    room = "free memory unknown"
    if free is not None:
        room = f"{free / 1e9:.1f} GB free, {reserve / 1e9:.1f} GB of it kept beside the cache"
    if budget is not None:
        room += f", a {budget / 2 ** 30:g} GiB budget"
    if fit == 0:
        short_budget = budget is not None and budget < per_row
        raise ValueError(f"one row of {limit + 1:,} KV slots needs {per_row / 1e9:.2f} GB ({room}): lower "
                         f"--max-total-tokens or {'raise --kv-cache-gb' if short_budget else 'free some memory'}")
    if fit < rows:
        say_once(f"rollout: {need} ({room}): decoding {fit} rows at once")
    return fit

# -----------------------------------------------------------------------------
# training on a CPU: it fits before any work starts


def trained_params(model, args):
    """The parameters training updates: all of them, or under --lora-r the adapters' r x (in + out) on each adapted
    linear layer of the decoder (every one, or those --lora-targets names)."""
    if not args.lora_r:
        return sum(p.numel() for p in model.parameters())
    names = None if args.lora_targets == "all-linear" else set(args.lora_targets.split(","))
    return sum(args.lora_r * (m.in_features + m.out_features) for name, m in model.get_decoder().named_modules()
               if isinstance(m, torch.nn.Linear) and (names is None or name.rsplit(".", 1)[-1] in names))


def copy_bytes(args, bf16):
    """Bytes a parameter of the decode copy: bf16 under bf16; under LoRA an fp32 one too, since the adapted model is
    not a plain one to decode; none where the fp32 model decodes itself."""
    return 2 if bf16 else 4 if args.lora_r else 0


def training_bytes(model, args, bf16):
    """About what training adds to a CPU process that has just loaded the model: the fp32 weights (paged in as
    they are used), the decode copy (copy_bytes) and under bf16 autocast's copies, the trained parameters'
    gradients and AdamW's two moments (12 bytes each), and for each sequence of a micro-batch what backward keeps:
    per token 75 bytes a layer and hidden unit in fp32, 110 in bf16 with what glibc's heaps hold on to, and per
    trained token 20 bytes a vocabulary entry for the logits (measured: docs/training.md#memory)."""
    cfg = model.config
    params = sum(p.numel() for p in model.parameters())
    tokens = args.max_total_tokens
    trained = min(tokens, args.max_turns * args.max_new_tokens)  # the agent's own tokens, at most
    per_row = tokens * cfg.num_hidden_layers * cfg.hidden_size * (110 if bf16 else 75) + trained * 20 * cfg.vocab_size
    weights = params * (4 + copy_bytes(args, bf16) + (2 if bf16 else 0)) + trained_params(model, args) * 12
    return weights + micro_batch_rows(args) * per_row


def decoding_bytes(model, args, bf16):
    """What stays beside the KV cache while a CPU run decodes: the fp32 weights and the decode copy, AdamW's two
    moments of the trained parameters (8 bytes each), and the engine's headroom for prefill."""
    params = sum(p.numel() for p in model.parameters())
    return params * (4 + copy_bytes(args, bf16)) + trained_params(model, args) * 8 + CACHE_HEADROOM


def micro_batch_rows(args):
    """Sequences in one forward and backward, SFT's or RL's, whichever is more."""
    return args.micro_batch_size or max(args.sft_batch_size, args.rl_batch_size * args.group_size)


def check_training_memory(model, args, bf16, device):
    """Stop before any work, not midway, where the machine's available memory cannot hold training (CPU runs)."""
    free = free_memory(torch.device(device))
    need = training_bytes(model, args, bf16)
    if free is not None and free < need:
        cgroup = cgroup_room()
        limited = cgroup is not None and cgroup <= free  # a container or batch job's limit, not other programs
        fix = "raise the memory limit of this process's cgroup" if limited else "close other programs"
        raise cli.UserError(f"training needs about {need / 1e9:.1f} GB more than the loaded model holds (micro-batches "
                            f"of {micro_batch_rows(args)} x {args.max_total_tokens:,} tokens) and {free / 1e9:.1f} GB "
                            f"is available: {fix}, or lower --max-total-tokens or --micro-batch-size")

def decode_rows(model, args, device, master):
    """The rows rollouts decode at once: --eval-batch-size, or as many as the KV cache's memory holds beside what
    stays while decoding (the weights, AdamW's moments, the decode copy); said on one line. On a CPU, training's
    peak must fit too, or the run stops here."""
    bf16 = args.dtype == "bf16"
    kv_dtype = torch.bfloat16 if bf16 else torch.float32
    budget = None
    reserve = CACHE_HEADROOM
    if torch.device(device).type == "cpu":
        check_training_memory(model, args, bf16, device)
        budget = args.kv_cache_gb * 2 ** 30
        reserve = decoding_bytes(model, args, bf16)
    try:
        rows = cache_rows(model, args.eval_batch_size, device, kv_dtype, args.max_total_tokens, budget, reserve)
    except ValueError as e:
        raise cli.UserError(e) from None
    if master and rows == args.eval_batch_size:  # else cache_rows has said it
        kv = kv_bytes_per_row(model.config, args.max_total_tokens, kv_dtype) * rows
        print(f"rollouts decode {rows} rows at once (KV cache up to {kv / 1e9:.2f} GB)")
    return rows

# -----------------------------------------------------------------------------
# glibc's heap: freed memory goes back to the OS


def return_memory_on_free():
    """glibc (elsewhere a no-op): blocks of 1 MiB and up get pages of their own, unmapped when freed. glibc's default
    threshold adapts upwards to the largest block ever freed, so the heap would keep what training once held and the
    KV cache would come on top; below 1 MiB the heap's own pages are reused, not faulted in afresh at every step."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 2 ** 20)
    except (OSError, AttributeError):
        pass


def release_freed_memory():
    """Hand the heaps' free pages back to the OS (glibc; elsewhere a no-op): what training freed, before decoding."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def on_training_thread(device, fn, *args, **kwargs):
    """fn(*args, **kwargs) on a thread of its own on the CPU (elsewhere right here), for training's forwards, backwards
    and optimizer steps. glibc gives a new thread a heap of its own (an arena): the blocks under the mmap threshold that
    a step frees stay in that heap, where the rest of the step reuses them, and the decoding on the main thread never
    re-touches them (release_freed_memory hands them back between steps). Larger blocks, most activations among
    them, are mapped afresh whichever thread asks. Autocast and grad mode are per thread: fn sets its own."""
    if torch.device(device).type != "cpu":
        return fn(*args, **kwargs)
    out = {}

    def target():
        try:
            out["value"] = fn(*args, **kwargs)
        except BaseException as e:  # also SystemExit (--stop-after): raised again on the calling thread
            out["error"] = e
    thread = threading.Thread(target=target, name="train", daemon=True)  # daemon: Ctrl-C need not wait for it
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["value"]
