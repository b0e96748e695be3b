"""
The decoding engine: one KV cache for a batch of rows that each hold their own number of tokens, prefill of the
tokens that must go in first, a decode step whose shapes depend on nothing but the batch bucket (so a GPU replays it
as a CUDA graph), and sampling. rollout.py drives it turn by turn.

    python bench.py capture      # CPU: the decode step compiles once per bucket and never again over a rollout

- SlotCache holds per layer one K and one V buffer, viewed as (B, S, Hkv, D) and allocated once: S = limit + 1 slots,
  the last a scratch slot that pads and idle rows write to. Row b keeps its tokens in slots 0..len_b-1 with no gaps,
  so a token's position id is its slot and a replay of the finished trajectory in one plain forward sees the same
  positions and keys.
- decode_step feeds one token to each of the cache's first `rows` rows. Its inputs sit in one device buffer
  (token, position, write slot per row), filled by one copy per step; the position drives RoPE, the cache write
  (index_copy_ into a flat view) and how many keys the row's attention reads. No Python number that changes between
  steps reaches the forward, so the step is one fixed graph per bucket of rows (1, 2, 4, 8, then every 8 up to 64
  and every 16 beyond).
- Attention reads each row's own keys: flash-attn's flash_attn_with_kvcache where it is installed, else PyTorch's
  own FlashAttention-2 kernel in variable-length mode with per-row key counts (seqused_k), on a GPU in bf16/fp16.
  Elsewhere SDPA with a mask built from the positions. On the CPU, which has no graphs to replay, rows are sorted by
  length, each range of RANGE_ROWS rows reads keys only up to its longest row, and the query heads that share a key
  head attend as that head's queries, so each key is read once.
- Sampling: temperature + top-p, greedy at temperature 0, by inverse CDF at a uniform that hashes (seed, the row's
  trajectory, the token's position), so no row's draw depends on its neighbours; the recorded log-prob is
  log_softmax(logits / T) over the full vocabulary, what a trainer recomputes.
"""
import math
import os
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

try:
    from flash_attn import flash_attn_with_kvcache
except ImportError:  # optional (design card): a GPU-only package
    flash_attn_with_kvcache = None

PREFILL_TOKENS = 16384  # padded tokens per prefill forward (observations, prompts)
PREFILL_BYTES = 2 ** 30  # what one prefill forward may hold beside the weights and the cache (prefill_bytes)
RANGE_ROWS = 16         # CPU decode: rows per length range
SORT_BELOW = 0.8        # CPU decode: sort rows by length once that cuts the keys a step reads below this fraction
# no cuDNN SDPA (Hopper's default): it compiles a plan per key length, so per prefill shape (docs/rollout.md)
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
GRAPHS_ENV = "SQLRL_CUDA_GRAPHS"  # 1 (default): replay CUDA graphs; 0: run the same step eagerly; check: compare
_notes_said = set()

# -----------------------------------------------------------------------------
# One KV cache for the whole batch, with per-row lengths


def head_dim(config):
    """Per-head size of keys and values (configs without head_dim split hidden_size evenly)."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class SlotCache:
    """Duck-types the transformers Cache interface the decoder layers use (update). Per layer K and V are viewed as
    (B, S, Hkv, D), stored heads-first, (B, Hkv, S, D), on the CPU, whose SDPA kernel reads that faster."""

    def __init__(self, model, rows, device, dtype, limit):
        cfg = model.config
        heads = cfg.num_key_value_heads
        D = head_dim(cfg)
        device = torch.device(device)
        S = limit + 1
        self.shape = (rows, S, heads, D)
        heads_first = device.type == "cpu"
        # CPU memory is committed page by page when first written, so there the buffers cost only what reserve()
        # zeroes; a GPU commits at allocation, and zeros cost nothing more there
        alloc = torch.empty if device.type == "cpu" else torch.zeros
        stored = (rows, heads, S, D) if heads_first else self.shape
        self.stores = [alloc(stored, device=device, dtype=dtype) for _ in range(2 * cfg.num_hidden_layers)]
        views = [x.transpose(1, 2) if heads_first else x for x in self.stores]
        self.k = views[0::2]
        self.v = views[1::2]
        self.ready = 0 if device.type == "cpu" else S  # slots [0, ready) are zeroed or written
        self.limit = limit               # tokens a row ever holds; slot `limit` is the scratch slot
        self.lens = [0] * rows           # tokens held by each row in use (rows past len(lens) are free)
        # the decode step's inputs and constants, fixed device buffers a CUDA graph reads by address
        self.step_in = torch.zeros(3, rows, dtype=torch.long, device=device)  # token, position, write slot
        # a key's row in the flat (B * S * Hkv, D) store, from the view's strides, whichever layout: row b, head h
        # of slot s sits at slot0[b, h] + s * slot_stride
        row_step, self.slot_stride, head_step = (n // D for n in self.k[0].stride()[:3])
        self.slot0 = (torch.arange(rows, device=device)[:, None] * row_step
                      + torch.arange(heads, device=device) * head_step)  # (B, Hkv)
        self.key_slots = torch.arange(S, device=device)
        self.cu_rows = torch.arange(rows + 1, dtype=torch.int32, device=device)  # varlen kernel: one query per row
        self.cu_keys = self.cu_rows * (limit + 1)                                # each row's keys start here
        self.write_index = None          # (rows,) decode: flat slot each row's new key goes to
        self.rows = None                 # (A, 1) prefill: cache row of each chunk
        self.slots = None                # (A, C) prefill: slot of each chunk token
        self.kv_len = 0                  # prefill: slots the attention reads

    def reserve(self, n):
        """Make slots [0, n) readable, 1024 at a time. Masked slots must hold finite values, since a masked key still
        multiplies its value by a zero weight, so a slot is zeroed before it is first read."""
        if n <= self.ready:
            return
        end = min(max(n, self.ready + 1024), self.limit + 1)
        for x in self.k + self.v:
            x[:, self.ready:end].zero_()
        self.ready = end

    def update(self, key, value, layer_idx, *args, **kwargs):  # key, value: (A, Hkv, C, D)
        k = self.k[layer_idx]
        v = self.v[layer_idx]
        if self.write_index is not None:  # decode: one token per row into the first A rows, every slot visible
            A, _, _, D = key.shape
            flat_k = self.stores[2 * layer_idx].view(-1, D)
            flat_v = self.stores[2 * layer_idx + 1].view(-1, D)
            flat_k.index_copy_(0, self.write_index, key.reshape(-1, D).to(k.dtype))  # (A * Hkv, D)
            flat_v.index_copy_(0, self.write_index, value.reshape(-1, D).to(v.dtype))
            return k[:A].transpose(1, 2), v[:A].transpose(1, 2)
        k[self.rows, self.slots] = key.transpose(1, 2).to(k.dtype)
        v[self.rows, self.slots] = value.transpose(1, 2).to(v.dtype)
        rows = self.rows[:, 0]  # a prefill of some rows reads a copy of just those rows, heads first
        return k.transpose(1, 2)[rows, :, :self.kv_len], v.transpose(1, 2)[rows, :, :self.kv_len]

    def start_row(self, row, head, n):
        """Row `row` starts over as a copy of the first n slots of head's one row."""
        self.reserve(n)
        for k, v, hk, hv in zip(self.k, self.v, head.k, head.v):
            k[row, :n] = hk[0, :n]
            v[row, :n] = hv[0, :n]
        self.lens[row] = n

    def keep(self, index):
        """Row index[j] becomes row j (a compaction or a sort), in place: the buffers never move (a captured graph
        reads them by address) and per-row copies of the used slots allocate nothing. The moves follow the cycles
        of the permutation, each with one row held aside."""
        used = max(self.lens, default=0)
        kept = set(index)
        src = list(index) + [i for i in range(len(self.lens)) if i not in kept]  # dropped rows go last
        done = [False] * len(src)
        for start in range(len(index)):
            if done[start] or src[start] == start:
                continue
            held = [x[start, :used].clone() for x in self.k + self.v]
            pos = start
            while not done[pos]:
                done[pos] = True
                if src[pos] == start:
                    for x, h in zip(self.k + self.v, held):
                        x[pos, :used] = h
                    break
                for x in self.k + self.v:
                    x[pos, :used] = x[src[pos], :used]
                pos = src[pos]
        self.lens = [self.lens[i] for i in index]


def say_once(note):
    """Print a note the first time it comes up: rollouts repeat every RL step, and so would their notes."""
    if note not in _notes_said:
        _notes_said.add(note)
        print(note)

# -----------------------------------------------------------------------------
# Attention: each row reads its own keys


def decode_kernel(device, dtype, head_dim):
    """The decode attention this device runs: "flash_attn" (the optional package), "varlen" (PyTorch's own
    FlashAttention-2 with per-row key counts), or "sdpa" (a mask from the positions)."""
    flash_ok = torch.device(device).type == "cuda" and dtype in (torch.float16, torch.bfloat16) and head_dim <= 256
    if flash_ok and flash_attn_with_kvcache is not None:
        return "flash_attn"
    return "varlen" if flash_ok and head_dim % 8 == 0 else "sdpa"


def grouped_decode_attention(query, key, value, mask, scaling):
    """One new token per row, query (A, H, 1, D) over keys (A, Hkv, n, D): the H / Hkv query heads that share a key
    head attend as that head's H / Hkv queries, so SDPA reads each key once. Given the heads ungrouped, its CPU kernel
    in bf16 runs as if it read each key once per query head (docs/rollout.md)."""
    A, H, _, D = query.shape
    Hkv = key.shape[1]
    grouped = query.reshape(A, Hkv, H // Hkv, D)
    out = torch.nn.functional.scaled_dot_product_attention(grouped, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(A, 1, H, D)  # transformers' layout: (A, tokens, H, D)


def slot_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, kv_pos=None,
                   attn_kernel="sdpa", key_ranges=None, cu_rows=None, cu_keys=None, **kwargs):
    """Prefill (kv_pos None): SDPA under its mask. Decode, query (A, H, 1, D) over key/value views (A, Hkv, S, D)
    of the cache: row i reads its keys 0..kv_pos[i] only. key_ranges (CPU): [(s, e, n)], rows [s, e) read their
    first n keys. cu_rows, cu_keys (A + 1,): where each row's query and keys start, for the varlen kernel."""
    if kv_pos is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    if attn_kernel == "flash_attn":
        # under autocast RoPE can leave the query in fp32; these kernels take the cache's dtype only
        out = flash_attn_with_kvcache(query.transpose(1, 2).to(key.dtype), key.transpose(1, 2), value.transpose(1, 2),
                                      cache_seqlens=(kv_pos + 1).int(), softmax_scale=scaling)
        return out, None  # (A, 1, H, D)
    if attn_kernel == "varlen":
        A, H, _, D = query.shape
        S = key.shape[2]
        Hkv = key.shape[1]
        out = torch.ops.aten._flash_attention_forward(
            query.reshape(A, H, D).to(key.dtype), key.transpose(1, 2).reshape(A * S, Hkv, D),
            value.transpose(1, 2).reshape(A * S, Hkv, D), cu_rows, cu_keys, 1, S, 0.0, False, False, scale=scaling,
            seqused_k=(kv_pos + 1).int())[0]
        return out[:, None], None  # (A, 1, H, D)
    if key_ranges is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    out = []
    for s, e, n in key_ranges:
        part = grouped_decode_attention(query[s:e], key[s:e, :, :n], value[s:e, :, :n], attention_mask[s:e, :, :, :n],
                                        scaling)
        out.append(part)
    return torch.cat(out), None


AttentionInterface.register("sqlrl_slot_attention", slot_attention)


@contextmanager
def use_slot_attention(model):
    """The model attends through slot_attention while this lasts; its own setting comes back after."""
    own = model.config._attn_implementation
    model.set_attn_implementation("sqlrl_slot_attention")
    try:
        yield
    finally:
        model.set_attn_implementation(own)


def row_ranges(lens, C=0):
    """[(s, e, keys)] over RANGE_ROWS consecutive rows: each range reads up to its longest row (+ C new tokens)."""
    R = RANGE_ROWS
    return [(s, min(s + R, len(lens)), max(lens[s:s + R]) + C) for s in range(0, len(lens), R)]


def keys_read(lens):
    """Keys one CPU decode step reads over rows of these lengths, in their order."""
    return sum((e - s) * n for s, e, n in row_ranges(lens, 1))

# -----------------------------------------------------------------------------
# Prefill: feeds of many tokens, for the rows that have them


def forward_chunks(model, cache, chunks, pad_id, rows=None):
    """Prefill: feed chunks[i] to cache row rows[i] (default: rows 0..len(chunks)-1) and advance their lengths."""
    device = cache.k[0].device
    rows = list(range(len(chunks))) if rows is None else rows
    lens = [cache.lens[r] for r in rows]
    n = [len(c) for c in chunks]
    C = max(n)
    ids = torch.tensor([c + [pad_id] * (C - len(c)) for c in chunks], device=device)  # (A, C)
    pos = torch.tensor(lens, device=device)[:, None] + torch.arange(C, device=device)  # (A, C)
    # pads write past their row's length, where nothing real has been yet; real tokens overwrite them later. Past
    # the limit they share the scratch slot
    cache.kv_len = min(max(lens) + C, cache.limit + 1)
    cache.reserve(cache.kv_len)
    cache.rows = torch.tensor(rows, device=device)[:, None]
    cache.slots = pos.clamp(max=cache.limit)
    allowed = torch.arange(cache.kv_len, device=device) <= pos[:, None, :, None]  # (A, 1, C, kv_len)
    dtype = cache.k[0].dtype  # an additive float mask: SDPA's CPU kernel runs ~20% faster than with a bool one
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, torch.finfo(dtype).min)
    with sdpa_kernel(SDPA_BACKENDS):
        model.get_decoder()(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                            use_cache=True)
    for r, k in zip(rows, n):
        cache.lens[r] += k


def prefill_bytes(config, rows, tokens, keys, itemsize):
    """What one prefill forward of `rows` rows x `tokens` new tokens over `keys` key slots holds at once beside the
    weights and the cache, from the shapes. The decoder layers run one after another, so it is the larger of one
    layer's attention and its MLP. Attention holds per token the residual stream and its norm, the new queries, keys
    and values before and after RoPE and the output; per row the keys and values it reads, once as the cache's copy
    and again repeated for each query head (transformers' SDPA under a mask); and the float and bool masks (rows x
    tokens x keys). SDPA's kernels under a mask (memory-efficient, CPU flash) never hold the scores whole."""
    H = config.num_attention_heads
    Hkv = config.num_key_value_heads
    D = head_dim(config)
    n = rows * tokens
    attention = (n * (2 * config.hidden_size + (3 * H + 4 * Hkv) * D) * itemsize
                 + rows * keys * 2 * (Hkv + H) * D * itemsize + n * keys * (itemsize + 1))
    mlp = n * (2 * config.hidden_size + 3 * config.intermediate_size) * itemsize
    return max(attention, mlp)


def length_groups(items, lengths, max_tokens=PREFILL_TOKENS, fits=None):
    """Split items into prefill batches, longest first, each padded to at most 1.25x its real tokens and to
    max_tokens (a longer single item goes alone), and, given fits(group, tokens), one that fits says True for."""
    order = sorted(range(len(items)), key=lambda j: -lengths[j])
    groups = []
    total = 0
    for j in order:
        group = groups[-1] if groups else []
        padded = (len(group) + 1) * lengths[group[0]] if group else 0
        too_big = padded > max_tokens or padded > 1.25 * (total + lengths[j])
        if group and not too_big and fits is not None:
            too_big = not fits([items[i] for i in group + [j]], lengths[group[0]])
        if not group or too_big:
            groups.append([])
            total = 0
        groups[-1].append(j)
        total += lengths[j]
    return [[items[j] for j in group] for group in groups]


def prefill(model, cache, feeds, pad_id, budget=PREFILL_BYTES):
    """Push all but the last token of every multi-token feed {cache row: tokens} through the model, in forwards whose
    transient memory (prefill_bytes) stays within `budget` bytes: rows of similar lengths together, and a feed too
    long for the budget on its own in pieces, each continuing where the one before ended."""
    itemsize = cache.k[0].dtype.itemsize

    def cost(rows, tokens, keys):
        return prefill_bytes(model.config, len(rows), tokens, min(keys, cache.limit + 1), itemsize)

    def fits(rows, tokens):
        return cost(rows, tokens, max(cache.lens[r] for r in rows) + tokens) <= budget
    waiting = [i for i, feed in feeds.items() if len(feed) > 1]
    for group in length_groups(waiting, [len(feeds[i]) - 1 for i in waiting], fits=fits):
        if len(group) > 1 or fits(group, len(feeds[group[0]]) - 1):
            forward_chunks(model, cache, [feeds[i][:-1] for i in group], pad_id, rows=group)
            continue
        feed = feeds[group[0]][:-1]
        end = cache.lens[group[0]] + len(feed)  # every piece's keys counted as the last piece's
        piece = len(feed)
        while piece > 1 and cost(group, piece, end) > budget:
            piece = (piece + 1) // 2
        for start in range(0, len(feed), piece):
            forward_chunks(model, cache, [feed[start:start + piece]], pad_id, rows=group)

# -----------------------------------------------------------------------------
# The decode step: static shapes, one graph per bucket of rows


def decode_step(model, cache, rows, kernel="sdpa", key_ranges=None):
    """Next-token logits (rows, V) fp32 for cache rows [0, rows), one token each, read from cache.step_in. Every
    shape here depends on `rows` alone; key_ranges (the CPU's length ranges) is the one exception."""
    ids = cache.step_in[0, :rows]  # (rows,)
    pos = cache.step_in[1, :rows]  # (rows,)
    cache.write_index = (cache.slot0[:rows] + cache.step_in[2, :rows, None] * cache.slot_stride).reshape(-1)
    dtype = cache.k[0].dtype
    hidden_keys = cache.key_slots > pos[:, None]  # (rows, S)
    mask = torch.zeros(hidden_keys.shape, dtype=dtype, device=pos.device).masked_fill(hidden_keys,
                                                                                      torch.finfo(dtype).min)
    with sdpa_kernel(SDPA_BACKENDS):
        hidden = model.get_decoder()(input_ids=ids[:, None], attention_mask=mask[:, None, None, :],
                                     position_ids=pos[:, None], past_key_values=cache, use_cache=True, kv_pos=pos,
                                     attn_kernel=kernel, key_ranges=key_ranges, cu_rows=cache.cu_rows[:rows + 1],
                                     cu_keys=cache.cu_keys[:rows + 1]).last_hidden_state  # (rows, 1, H)
    cache.write_index = None
    return model.get_output_embeddings()(hidden[:, 0]).float()


def batch_buckets(max_rows):
    """Row counts a decode step is padded up to: 1, 2, 4, 8, then every 8 up to 64, every 16 beyond, and max_rows."""
    small = [b for b in (1, 2, 4, 8) if b < max_rows]
    by_8 = list(range(16, min(max_rows, 65), 8))
    by_16 = list(range(80, max_rows, 16))
    return [b for b in small + by_8 + by_16 if b < max_rows] + [max_rows]


@dataclass
class Decoder:
    mode: str                    # ranged (CPU), static (eager, bucketed), graphs (CUDA), custom (a given step)
    kernel: str                  # decode attention: flash_attn | varlen | sdpa
    buckets: list[int]           # row counts the step runs at (ranged: any)
    step: Callable = None        # custom: called as step(model, cache, rows) -> logits
    graphs: dict = field(default_factory=dict)  # bucket -> torch.cuda.CUDAGraph
    logits: torch.Tensor = None  # graphs: (B, V) fp32 buffer the replays write, outside the graph pool
    check: bool = False          # graphs: compare every replay with the eager step
    capture_s: float = 0.0


def make_decoder(model, cache, decode="auto"):
    """decode: "auto" (graphs on CUDA, ranged on the CPU), "ranged", "static", "graphs", or a callable that stands
    in for decode_step (the capturability check passes a compiled one). SQLRL_CUDA_GRAPHS=0 turns graphs off."""
    device = cache.k[0].device
    kernel = decode_kernel(device, cache.k[0].dtype, cache.shape[3])
    buckets = batch_buckets(cache.shape[0])
    if callable(decode):
        return Decoder("custom", kernel, buckets, step=decode)
    graphs_env = os.environ.get(GRAPHS_ENV, "1")
    if graphs_env not in ("0", "1", "check"):
        raise ValueError(f"{GRAPHS_ENV}={graphs_env!r}: use 1 (replay CUDA graphs), 0 (eager) or check")
    if decode == "auto":
        on_cuda = device.type == "cuda"
        decode = "ranged" if not on_cuda else "graphs" if graphs_env != "0" else "static"
    if decode not in ("ranged", "static", "graphs"):
        raise ValueError(f"unknown decode mode {decode!r}: auto, ranged, static or graphs")
    if decode == "graphs" and device.type != "cuda":
        raise ValueError("decode='graphs' needs a CUDA device")
    if decode != "ranged":
        cache.reserve(cache.limit + 1)  # a static step's mask spans every slot
    decoder = Decoder(decode, kernel, buckets, check=graphs_env == "check")
    if decode == "graphs":
        try:
            capture(model, cache, decoder)
        except (RuntimeError, TypeError) as e:  # an op this GPU or torch build lacks
            decoder = eager_fallback(model, cache, kernel, buckets, e)
    return decoder


def first_line(error):
    return (str(error).strip().splitlines() or [""])[0][:200]


def eager_fallback(model, cache, kernel, buckets, error):
    """After a failed capture: the same static step run eagerly, whose attention reads each row's own keys; where that
    step fails too (the kernel itself), masked SDPA over every slot. One line says which."""
    failed = f"rollout: CUDA graph capture failed ({type(error).__name__}: {first_line(error)})"
    try:
        _scratch_inputs(cache)
        decode_step(model, cache, buckets[0], kernel)
    except (RuntimeError, TypeError) as e:  # NotImplementedError too: a kernel this device lacks
        say_once(f"{failed}; the {kernel} step fails eagerly too ({type(e).__name__}: {first_line(e)}): decoding "
                 f"eagerly with masked SDPA over all {cache.limit + 1:,} slots (SQLRL_CUDA_GRAPHS=0 skips the capture)")
        return Decoder("static", "sdpa", buckets)
    say_once(f"{failed}: decoding the same {kernel} step eagerly (SQLRL_CUDA_GRAPHS=0 skips the capture)")
    return Decoder("static", kernel, buckets)


def _scratch_inputs(cache, pad_id=0):
    """Step inputs that touch nothing: every row feeds a pad at position 0 into the scratch slot."""
    cache.step_in[0].fill_(pad_id)
    cache.step_in[1].zero_()
    cache.step_in[2].fill_(cache.limit)


def capture(model, cache, decoder):
    """One CUDA graph per bucket, largest first, in one shared memory pool, each after an eager warm-up run."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    vocab = model.get_output_embeddings().weight.shape[0]
    decoder.logits = torch.empty(cache.shape[0], vocab, device=cache.k[0].device)
    _scratch_inputs(cache)
    # autocast's cache of cast weights would be freed after capture while the graph still reads it
    autocast = torch.is_autocast_enabled("cuda")
    no_cast_cache = torch.autocast("cuda", torch.get_autocast_dtype("cuda"), cache_enabled=False) if autocast \
        else nullcontext()
    pool = None
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), no_cast_cache:
        for rows in sorted(decoder.buckets, reverse=True):
            decode_step(model, cache, rows, decoder.kernel)
    torch.cuda.current_stream().wait_stream(side)
    for rows in sorted(decoder.buckets, reverse=True):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool), no_cast_cache:
            decoder.logits[:rows].copy_(decode_step(model, cache, rows, decoder.kernel))
        pool = graph.pool()
        decoder.graphs[rows] = graph
    torch.cuda.synchronize()
    decoder.capture_s = time.perf_counter() - t0


def decode(model, cache, decoder, feeds, pad_id):
    """One token into each of the first len(feeds) cache rows (None: an idle row, which feeds a pad into the scratch
    slot); returns their next-token logits (A, V) fp32."""
    A = len(feeds)
    if A != len(cache.lens):
        raise ValueError(f"decode got {A} feeds for {len(cache.lens)} rows in use")
    rows = A if decoder.mode == "ranged" else next(b for b in decoder.buckets if b >= A)
    live = [f is not None for f in feeds] + [False] * (rows - A)
    lens = cache.lens + [0] * (rows - A)
    host = torch.tensor([[f if f is not None else pad_id for f in feeds] + [pad_id] * (rows - A),
                         [n if ok else 0 for n, ok in zip(lens, live)],
                         [min(n, cache.limit) if ok else cache.limit for n, ok in zip(lens, live)]])
    cache.step_in[:, :rows].copy_(host)  # the step's only host-to-device copy
    if decoder.mode == "ranged":
        cache.reserve(max(lens, default=0) + 1)
        ranges = row_ranges([n if ok else 0 for n, ok in zip(lens, live)], 1)
        logits = decode_step(model, cache, rows, decoder.kernel, key_ranges=ranges)
    elif decoder.mode == "custom":
        logits = decoder.step(model, cache, rows)
    elif decoder.mode == "static":
        logits = decode_step(model, cache, rows, decoder.kernel)
    else:
        decoder.graphs[rows].replay()
        logits = decoder.logits[:rows]
        if decoder.check:
            check_replay(model, cache, decoder, rows, live)
    for i, ok in enumerate(live[:A]):
        cache.lens[i] += ok
    return logits[:A]


def check_replay(model, cache, decoder, rows, live):
    """Debug (SQLRL_CUDA_GRAPHS=check): the eager step must give the replay's logits; it rewrites the same keys."""
    eager = decode_step(model, cache, rows, decoder.kernel)
    on = torch.tensor(live, device=eager.device)
    diff = (eager - decoder.logits[:rows])[on].abs().max().item() if on.any() else 0.0
    flips = (eager.argmax(-1) != decoder.logits[:rows].argmax(-1))[on].sum().item()
    if flips or not math.isfinite(diff) or diff > 1e-2:
        raise RuntimeError(f"CUDA graph replay at {rows} rows differs from the eager decode step: max |logit "
                           f"difference| {diff:.3g}, {flips} greedy tokens differ")

# -----------------------------------------------------------------------------
# Sampling


SPLITMIX = [np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)]


def splitmix64(x):
    """SplitMix64's output function on a uint64 array (wrapping arithmetic): nearby inputs, far-apart outputs."""
    z = x + SPLITMIX[0]
    z = (z ^ (z >> np.uint64(30))) * SPLITMIX[1]
    z = (z ^ (z >> np.uint64(27))) * SPLITMIX[2]
    return z ^ (z >> np.uint64(31))


def uniforms(seed, keys, positions, device="cpu"):
    """(A, 1) fp32 uniforms in [0, 1), one per row, a hash of (seed, the row's key, its position) alone: a trajectory
    (key) draws the same number for its token at a position whatever rows decode beside it, in whatever order, so
    the rows a machine decodes at once do not change what is sampled. 24 bits: exact in fp32 and below 1."""
    keys = np.asarray(keys, dtype=np.int64).astype(np.uint64)
    positions = np.asarray(positions, dtype=np.int64).astype(np.uint64)
    seed_hash = splitmix64(np.array([seed % 2 ** 64], dtype=np.uint64))  # (1,): an array, where a scalar warns on wrap
    h = splitmix64(splitmix64(seed_hash ^ keys) ^ positions)
    u = (h >> np.uint64(40)).astype(np.float32) * np.float32(2.0 ** -24)
    return torch.from_numpy(u)[:, None].to(device)


def draw(probs, u):
    """One index per row with probability probs / probs.sum() (rows need not be normalised), by inverse CDF at the
    row's uniform u (A, 1), where torch.multinomial draws one exponential per vocabulary entry (docs/rollout.md)."""
    cdf = probs.cumsum(dim=-1)
    cdf = cdf / cdf[:, -1:]  # (A, V), last entry exactly 1.0 > any u in [0, 1)
    return torch.searchsorted(cdf, u.to(cdf.dtype), right=True).squeeze(1)  # first cdf > u: zeros never win


def sample(logits, temperature, top_p, u):
    """logits (A, V) -> tokens (A,), logp (A, V) = the log-probs recorded for whichever token a row ends up with.
    u: (A, 1) uniforms (engine.uniforms), unused at temperature 0."""
    if temperature == 0:
        logp = torch.log_softmax(logits, dim=-1)
        return logp.argmax(dim=-1), logp
    logp = torch.log_softmax(logits / temperature, dim=-1)
    probs = logp.exp()
    if top_p >= 1.0:
        return draw(probs, u), logp
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    outside = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p  # mass before this token already reaches top_p
    pick = draw(sorted_probs.masked_fill(outside, 0.0), u)  # draw() renormalises the nucleus
    return order.gather(1, pick[:, None]).squeeze(1), logp
