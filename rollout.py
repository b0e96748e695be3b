"""
Batched multi-turn rollout: len(examples) * group_size agent episodes decoded together with ONE KV cache that lives
across all turns. A turn ends at EOS or at a protocol stop string (a tool call); the SQL of every row that stopped at
the same step runs in one env.run_many batch, the observation's chat-template tokens are fed into that row's cache,
and the row decodes on. History is never re-encoded; the training tensors are the very ids sampled and fed.

    python rollout.py --data data/gym/dev.jsonl --protocol trust --num-examples 4 --group-size 2 --max-turns 5

How the engine works (details and measurements: docs/rollout.md):
- SlotCache keeps per layer one K and one V buffer of shape (B, Hkv, S, D). Row b holds its tokens in slots
  0..len_b-1 with no gaps, so a token's position id is its slot and the mask of row b is just "slot <= my position":
  a replay of the finished trajectory in one plain forward sees the same positions and keys.
- Each step is one decode forward over all active rows, one token each. Tokens that must go in first (the prompt;
  after a tool call the end-of-turn tokens, the observation message and the generation prompt) are prefilled for
  just the rows that have them, batched by similar length; pads go to slots past the row's length. The shared
  system message is prefilled once and copied into each row.
- Continuous batching: at most max_rows rows decode at once; a finished row's slot goes to the next waiting row.
  Once none wait, dead slots decode pads until a quarter are dead, and then leave the cache.
- Decode attention by length ranges: slots are kept sorted by length, and each range of RANGE_ROWS rows reads keys
  only up to its own longest row (ranged_sdpa), not the whole batch's.
- Sampling: temperature + top-p, a torch.Generator seeded with `seed`; greedy at temperature 0. sample_logprobs =
  log_softmax(logits / T) of the sampled token over the FULL vocabulary, untruncated by top_p: what trainers recompute.
- Limits are always visible in stop_reason: max_turns (env), max_tokens (a turn reached max_new_tokens), context
  (the row would exceed max_total_tokens). Nothing is ever cut from the left. A turn cut by a limit is recorded on
  the Episode as an "invalid" action, so episode.actions keeps one entry per sampled turn.
"""
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import env

_SENTINEL = "@@turn-content@@"
PREFILL_TOKENS = 16384  # padded tokens per prefill forward (observations, prompts)
RANGE_ROWS = 16         # decode attention: rows per length range (see ranged_sdpa)
# no cuDNN SDPA (Hopper's default): it compiles a plan per key length, so per decode step (docs/rollout.md, On a GPU)
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
SORT_BELOW = 0.8        # slots are sorted by length once that cuts the keys a decode step reads below this fraction

# -----------------------------------------------------------------------------
# Trajectory: what the trainer consumes


@dataclass
class Trajectory:
    token_ids: list[int]          # prompt + every sampled and fed token, in order
    prompt_len: int
    loss_mask: list[int]          # 1 only for sampled tokens
    sample_logprobs: list[float]  # log-prob of each sampled token (see docstring), 0 elsewhere
    turn_ids: list[int]           # -1 prompt; t for tokens sampled in turn t and the observation fed after it
    episode: env.Episode
    example: dict
    group: int                    # index of the example in the batch
    num_turns: int
    num_tool_calls: int
    stop_reason: str              # answer | max_turns | max_tokens | context
    turn_times: list[float] = field(default_factory=list)  # wall seconds of each turn (decode + tool + obs)

# -----------------------------------------------------------------------------
# Chat template pieces: prompt, end-of-turn and observation tokens, all derived from the tokenizer's template


def render_ids(tokenizer, messages, add_generation_prompt):
    return list(tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt,
                                              return_dict=False))


@dataclass
class ChatBits:
    close_ids: list[int]    # tokens the template puts after an assistant message's content, e.g. <|im_end|> \n
    base: list[dict]        # fixed base conversation observations are appended to
    base_ids: list[int]     # its tokens; observation tokens = render(base + [obs]) with these sliced off
    stop: list[str]         # protocol stop strings
    window: int             # decoded tail (tokens) that must contain any stop string the newest token completed
    eos_ids: set[int]


def chat_bits(tokenizer, model, protocol):
    base = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
            {"role": "assistant", "content": _SENTINEL}]
    text = tokenizer.apply_chat_template(base, tokenize=False)
    close_text = text[text.rindex(_SENTINEL) + len(_SENTINEL):]
    close_ids = tokenizer.encode(close_text, add_special_tokens=False)
    eos = getattr(model.generation_config, "eos_token_id", None)
    eos_ids = {tokenizer.eos_token_id} | set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if not close_ids or close_ids[0] not in eos_ids:
        raise ValueError(f"chat template closes an assistant turn with {close_text!r}, which does not start with "
                         f"the eos token {tokenizer.eos_token!r}: use a chat model whose template ends turns at eos")
    window = max([len(s) for s in protocol.stop], default=0) + 2  # every token decodes to >= 1 character
    return ChatBits(close_ids, base, render_ids(tokenizer, base, False), list(protocol.stop), window, eos_ids)


def observation_ids(tokenizer, bits, role, text):
    """Template tokens of one observation message plus the next generation prompt (exactly as the template has
    them inside a whole conversation: render base + message, slice off the base)."""
    ids = render_ids(tokenizer, bits.base + [{"role": role, "content": text}], True)
    if ids[:len(bits.base_ids)] != bits.base_ids:
        raise ValueError("chat template re-renders earlier messages when a new one is appended; observation tokens "
                         "cannot be taken as a suffix")
    return ids[len(bits.base_ids):]


def hits_stop(tokenizer, bits, ids, turn_start):
    """Does the decoded turn ids[turn_start:] contain a stop string? Checked after every token, so only the tail
    that the newest token can have completed a stop string in needs decoding."""
    if not bits.stop:
        return False
    tail = tokenizer.decode(ids[max(turn_start, len(ids) - bits.window):], skip_special_tokens=False)
    return any(s in tail for s in bits.stop)


def turn_text(tokenizer, bits, turn_tokens):
    """The text env parses: the turn without its eos (special tokens such as <tool_call> are kept)."""
    ends_at_eos = turn_tokens and turn_tokens[-1] in bits.eos_ids
    return tokenizer.decode(turn_tokens[:-1] if ends_at_eos else turn_tokens, skip_special_tokens=False)

# -----------------------------------------------------------------------------
# One KV cache for the whole batch, with per-row lengths


class SlotCache:
    """Duck-types the transformers Cache interface the decoder layers use (update). Per layer (B, Hkv, S, D)."""

    def __init__(self, model, batch, device, dtype, limit):
        cfg = model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        # CPU memory is committed page by page when first written, so there the buffers span every slot from the
        # start and cost only what reserve() zeroes; an accelerator commits it at allocation, so there they grow
        slots = limit + 1 if torch.device(device).type == "cpu" else 0
        self.shape = (batch, cfg.num_key_value_heads, slots, head_dim)
        self.k = [torch.empty(self.shape, device=device, dtype=dtype) for _ in range(cfg.num_hidden_layers)]
        self.v = [torch.empty(self.shape, device=device, dtype=dtype) for _ in range(cfg.num_hidden_layers)]
        self.lens = [0] * batch        # tokens held by each row
        self.ready = 0                 # slots [0, ready) are zeroed or written; the rest may hold garbage
        self.rows = self.slots = None  # (A, 1), (A, C): where this forward's chunk is written
        self.kv_len = 0                # slots the attention reads this forward
        self.subset = None             # (A,) rows a prefill reads, None: all rows
        self.limit = limit             # tokens a row ever holds; pads past it all go to one scratch slot, `limit`

    def reserve(self, n):
        """Make slots [0, n) readable, 1024 at a time. Masked slots must hold finite values, since a masked key still
        multiplies its value by a zero weight, so a slot is zeroed before it is first read."""
        if n <= self.ready:
            return
        end = min(max(n, self.ready + 1024), self.limit + 1)
        for bufs in (self.k, self.v) if end > self.k[0].shape[2] else ():
            for layer, x in enumerate(bufs):  # layer by layer: the copy adds one layer's memory, not the cache's
                grown = x.new_empty(*x.shape[:2], end, x.shape[3])
                grown[:, :, :self.ready] = x[:, :, :self.ready]
                bufs[layer] = grown
        for x in self.k + self.v:
            x[:, :, self.ready:end].zero_()
        self.ready = end

    def update(self, key, value, layer_idx, *args, **kwargs):  # key, value: (A, Hkv, C, D)
        k, v = self.k[layer_idx], self.v[layer_idx]
        k[self.rows, :, self.slots] = key.transpose(1, 2).to(k.dtype)
        v[self.rows, :, self.slots] = value.transpose(1, 2).to(v.dtype)
        k, v = k[:, :, :self.kv_len], v[:, :, :self.kv_len]
        if self.subset is not None:  # a prefill of some rows reads a copy of just those rows
            k, v = k.index_select(0, self.subset), v.index_select(0, self.subset)
        return k, v

    def start_row(self, row, head, n):  # row `row` starts over as a copy of the first n slots of head's one row
        self.reserve(n)
        for k, v, hk, hv in zip(self.k, self.v, head.k, head.v):
            k[row, :, :n], v[row, :, :n] = hk[0, :, :n], hv[0, :, :n]
        self.lens[row] = n

    def keep(self, index):
        """Row index[j] becomes row j (a compaction or a sort), in place: copying into new buffers would page-fault
        ~100 MB per layer at 128 rows (~1.5 s per call), while per-row copies of the used slots allocate nothing.
        The moves follow the cycles of the permutation, each with one row held aside."""
        used, n = max(self.lens, default=0), len(index)
        kept = set(index)
        src = list(index) + [i for i in range(len(self.lens)) if i not in kept]  # dropped rows go last
        done = [False] * len(src)
        for start in range(n):
            if done[start] or src[start] == start:
                continue
            held = [x[start, :, :used].clone() for x in self.k + self.v]
            pos = start
            while not done[pos]:
                done[pos] = True
                if src[pos] == start:
                    for x, h in zip(self.k + self.v, held):
                        x[pos, :, :used] = h
                    break
                for x in self.k + self.v:
                    x[pos, :, :used] = x[src[pos], :, :used]
                pos = src[pos]
        self.k, self.v = [k[:n] for k in self.k], [v[:n] for v in self.v]
        self.lens = [self.lens[i] for i in index]


def ranged_sdpa(module, query, key, value, attention_mask, row_ranges=None, **kwargs):
    """SDPA where rows [s, e) read only their first n keys, for each (s, e, n) of row_ranges: at 128 rows the key
    read is most of a decode step, and over length-sorted rows each range reads about its own rows' lengths."""
    if row_ranges is None:  # prefills
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    out = [sdpa_attention_forward(module, query[s:e], key[s:e, :, :n], value[s:e, :, :n],
                                  attention_mask[s:e, :, :, :n], **kwargs)[0] for s, e, n in row_ranges]
    return torch.cat(out), None


AttentionInterface.register("sqlrl_ranged_sdpa", ranged_sdpa)


def row_ranges(lens, C=0):
    """[(s, e, keys)] over RANGE_ROWS consecutive rows: each range reads up to its longest row (+ C new tokens)."""
    R = RANGE_ROWS
    return [(s, min(s + R, len(lens)), max(lens[s:s + R]) + C) for s in range(0, len(lens), R)]


@contextmanager
def ranged_attention(model):
    """An sdpa model decodes through ranged_sdpa while this lasts (yields whether it does); its own setting comes
    back after."""
    own = model.config._attn_implementation
    if own == "sdpa":
        model.set_attn_implementation("sqlrl_ranged_sdpa")
    try:
        yield own == "sdpa"
    finally:
        model.set_attn_implementation(own)


def forward_chunks(model, cache, chunks, pad_id, rows=None, logits=True):
    """Feed chunks[i] to cache row rows[i] (default: every row, in order). Returns next-token logits (A, V) fp32 at
    each chunk's last token, or None for a prefill (logits=False)."""
    device = cache.k[0].device
    index = torch.arange(len(chunks), device=device) if rows is None else torch.tensor(rows, device=device)
    lens = cache.lens if rows is None else [cache.lens[r] for r in rows]
    n = [len(c) for c in chunks]
    C = max(n)
    ids = torch.tensor([c + [pad_id] * (C - len(c)) for c in chunks], device=device)  # (A, C)
    pos = torch.tensor(lens, device=device)[:, None] + torch.arange(C, device=device)  # (A, C)
    # pads write past their row's length, where nothing real has been yet; real tokens overwrite them later. Past
    # the limit they share a scratch slot, so a long row padded to a long chunk never grows (copies) the cache
    slots, cache.kv_len = pos.clamp(max=cache.limit), min(max(lens) + C, cache.limit + 1)
    cache.reserve(cache.kv_len)
    cache.rows, cache.slots, cache.subset = index[:, None], slots, None if rows is None else index
    allowed = torch.arange(cache.kv_len, device=device) <= pos[:, None, :, None]  # (A, 1, C, kv_len)
    dtype = cache.k[0].dtype  # an additive float mask: SDPA's CPU kernel runs ~20% faster than with a bool one
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, torch.finfo(dtype).min)
    # a 4-D mask is used as given by every HF model class (a dict of masks only by those with sliding layers)
    ranged = {} if rows is not None or model.config._attn_implementation != "sqlrl_ranged_sdpa" else \
        {"row_ranges": row_ranges(lens, C)}
    with sdpa_kernel(SDPA_BACKENDS):
        hidden = model.get_decoder()(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                                     use_cache=True, **ranged).last_hidden_state  # (A, C, H)
    for r, k in zip(index.tolist(), n):
        cache.lens[r] += k
    if not logits:
        return None
    last = hidden[torch.arange(len(chunks), device=device), torch.tensor(n, device=device) - 1]  # (A, H)
    return model.get_output_embeddings()(last).float()


def length_groups(items, lengths, max_tokens=PREFILL_TOKENS):
    """Split items into prefill batches, longest first, each padded to at most 1.25x its real tokens and to
    max_tokens (a longer single item goes alone)."""
    order = sorted(range(len(items)), key=lambda j: -lengths[j])
    groups, total = [], 0
    for j in order:
        padded = (len(groups[-1]) + 1) * lengths[groups[-1][0]] if groups else 0
        if not groups or padded > max_tokens or padded > 1.25 * (total + lengths[j]):
            groups.append([])
            total = 0
        groups[-1].append(j)
        total += lengths[j]
    return [[items[j] for j in group] for group in groups]


def prefill(model, cache, feeds, pad_id):
    """Push all but the last token of every multi-token feed {cache row: tokens} through the model."""
    waiting = [i for i, feed in feeds.items() if len(feed) > 1]
    for group in length_groups(waiting, [len(feeds[i]) - 1 for i in waiting]):
        forward_chunks(model, cache, [feeds[i][:-1] for i in group], pad_id, rows=group, logits=False)

# -----------------------------------------------------------------------------
# Sampling


def draw(probs, generator):
    """One index per row with probability probs / probs.sum() (rows need not be normalised): inverse CDF with one
    uniform per row. torch.multinomial draws one exponential per vocabulary entry, ~3 ms per step on a (64, 4k)
    CPU batch, which was 30 % of a tiny-model rollout."""
    cdf = probs.cumsum(dim=-1)
    cdf = cdf / cdf[:, -1:]  # (A, V), last entry exactly 1.0 > any u in [0, 1)
    u = torch.rand(len(probs), 1, generator=generator, device=probs.device, dtype=cdf.dtype)
    return torch.searchsorted(cdf, u, right=True).squeeze(1)  # first cdf > u: zero-probability entries never win


def sample(logits, temperature, top_p, generator):
    """logits (A, V) -> tokens (A,), logp (A, V) = the log-probs recorded for whichever token a row ends up with."""
    if temperature == 0:
        logp = torch.log_softmax(logits, dim=-1)
        return logp.argmax(dim=-1), logp
    logp = torch.log_softmax(logits / temperature, dim=-1)
    probs = logp.exp()
    if top_p >= 1.0:
        return draw(probs, generator), logp
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    outside = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p  # mass before this token already reaches top_p
    pick = draw(sorted_probs.masked_fill(outside, 0.0), generator)  # draw() renormalises the nucleus
    return order.gather(1, pick[:, None]).squeeze(1), logp

# -----------------------------------------------------------------------------
# The rollout loop: a state machine per row (decoding -> turn ended -> tool call -> observation fed -> decoding)


@dataclass
class _Row:
    traj: Trajectory
    feed: list[int]          # tokens to push through the model on the next forward
    turn_start: int          # index in token_ids where the current turn's sampled tokens start
    turn_t0: float


def _append(traj, ids, turn, loss=0, logprobs=None):
    traj.token_ids += ids
    traj.loss_mask += [loss] * len(ids)
    traj.sample_logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
    traj.turn_ids += [turn] * len(ids)


def _finish(row, reason, cut_turn=False):
    """End a row's episode; limits are recorded on the Episode too, so rewards see them."""
    traj, episode = row.traj, row.traj.episode
    if cut_turn:  # the turn never ended: nothing was parsed or executed
        episode.actions.append(env.Action("invalid", None, None, False, f"turn cut by the {reason} limit"))
        episode.turn_valid.append(False)
        episode.exec_errors.append(None)
    traj.stop_reason = reason
    traj.num_tool_calls = episode.num_tool_calls
    if not episode.done:
        episode.done, episode.stop_reason = True, reason


def get_protocol(protocol):
    if isinstance(protocol, env.Protocol):
        return protocol
    if protocol not in env.PROTOCOLS:
        raise ValueError(f"unknown protocol {protocol!r}: choose one of {sorted(env.PROTOCOLS)}")
    return env.PROTOCOLS[protocol]


@torch.inference_mode()
def rollout(model, tokenizer, examples, protocol, *, group_size, max_turns, max_new_tokens, max_total_tokens,
            temperature, top_p, schema_mode, seed, force=None, sql_workers=4, max_rows=None, bar=None):
    """Roll out group_size episodes per example; returns Trajectories group-major (example i -> rows i*G..i*G+G-1).
    max_rows: at most this many rows decode at once; a finished row's cache slot goes to the next waiting row
    (continuous batching), so a batch never waits for its longest row while others queue. bar: a tqdm advanced by
    one per finished row. force: optional test/benchmark hook (row, turn, tokens sampled so far this turn) -> token
    id or None; a token overrides the sampled one (a scripted policy), and its recorded log-prob is still the
    model's log-prob of it."""
    if model.config._attn_implementation not in ("sdpa", "eager"):
        raise ValueError(f"rollout needs attn_implementation 'sdpa' or 'eager' (per-row masks), not "
                         f"{model.config._attn_implementation!r}: call model.set_attn_implementation('sdpa')")
    if temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got {temperature=}, {top_p=}")
    proto = get_protocol(protocol)
    bits = chat_bits(tokenizer, model, proto)
    param = next(model.parameters())
    generator = torch.Generator(device=param.device).manual_seed(seed)

    # --- one row per (example, sample); prompts too long for the context end at once, never cut from the left
    rows, t0 = [], time.perf_counter()
    for group, example in enumerate(examples):
        turns = example.get("max_turns", max_turns)  # a per-question budget (train.py --adaptive-turns) wins
        prompt = render_ids(tokenizer, proto.build_messages(example, schema_mode, turns), True)
        for _ in range(group_size):
            episode = env.new_episode(example, proto.name, turns, schema_mode)
            traj = Trajectory(list(prompt), len(prompt), [0] * len(prompt), [0.0] * len(prompt),
                              [-1] * len(prompt), episode, example, group, 0, 0, "")
            rows.append(_Row(traj, list(prompt), len(prompt), t0))
            if len(prompt) >= max_total_tokens:
                _finish(rows[-1], "context")
    waiting = [r for r, row in enumerate(rows) if not row.traj.stop_reason][::-1]  # popped from the end
    # under autocast (fp32 weights, bf16 compute) the cache and the mask take the compute dtype
    device_type = param.device.type
    autocast = torch.is_autocast_enabled(device_type)
    dtype = torch.get_autocast_dtype(device_type) if autocast else param.dtype
    cache = SlotCache(model, min(len(waiting), max_rows or len(waiting)), param.device, dtype, max_total_tokens)
    pad = tokenizer.pad_token_id

    # --- every prompt starts with the same system message: prefill it once into a one-row cache; each row's slot
    # starts as a copy of it, and the rest of the row's prompt is prefilled with the other rows' feeds
    prompts = [rows[r].feed for r in waiting]
    shared = min(len(os.path.commonprefix(prompts)), min(map(len, prompts), default=1) - 1) if prompts else 0
    head = SlotCache(model, 1, param.device, dtype, max(shared, 1))
    if shared > 1:
        forward_chunks(model, head, [prompts[0][:shared]], pad, logits=False)
    else:
        shared = 0

    def admit(slot):
        """The next waiting row takes cache slot `slot` (its old keys stay behind its length, masked)."""
        r = waiting.pop()
        cache.start_row(slot, head, shared)
        rows[r].feed, rows[r].turn_t0 = rows[r].feed[shared:], time.perf_counter()
        return r

    active = [admit(slot) for slot in range(cache.shape[0])]

    keys = lambda lens: sum((e - s) * n for s, e, n in row_ranges(lens))  # noqa: E731  keys a decode step reads
    with ranged_attention(model) as ranged:
        while active:
            # a dead slot's pad never raises the kv length every row attends over
            cache.lens = [0 if r is None else n for r, n in zip(active, cache.lens)]
            # --- slots sorted by length let each range of rows read only about its own keys (ranged_sdpa); a sort
            # moves most of the cache, so it happens only once the keys a step reads would drop enough
            ahead = [cache.lens[i] + (0 if r is None else len(rows[r].feed)) for i, r in enumerate(active)]
            order = sorted(range(len(active)), key=ahead.__getitem__)
            if ranged and keys([ahead[j] for j in order]) < SORT_BELOW * keys(ahead):
                active = [active[j] for j in order]
                cache.keep(order)
            # --- observations waiting to be fed go in as prefill batches; then one decode step for every slot (a dead
            # slot, None, decodes a pad at position 0 until the next compaction: cheaper than compacting every time)
            live = [(i, r) for i, r in enumerate(active) if r is not None]
            prefill(model, cache, {i: rows[r].feed for i, r in live}, pad)
            logits = forward_chunks(model, cache, [[pad] if r is None else rows[r].feed[-1:] for r in active], pad)
            tokens, logp = sample(logits, temperature, top_p, generator)  # (A,), (A, V)
            tokens = tokens.tolist()
            if force is not None:
                for i, r in live:
                    forced = force(r, rows[r].traj.num_turns, rows[r].traj.token_ids[rows[r].turn_start:])
                    tokens[i] = tokens[i] if forced is None else forced
            token_logp = logp.gather(1, torch.tensor(tokens, device=logp.device)[:, None]).squeeze(1).tolist()

            # --- append the sampled token; decide per row: keep decoding, end the turn, or hit a limit
            ended = []
            for i, r in live:
                row, token, traj = rows[r], tokens[i], rows[r].traj
                _append(traj, [token], traj.num_turns, loss=1, logprobs=[token_logp[i]])
                if token in bits.eos_ids or hits_stop(tokenizer, bits, traj.token_ids, row.turn_start):
                    ended.append(r)
                elif len(traj.token_ids) >= max_total_tokens or len(traj.token_ids) - row.turn_start >= max_new_tokens:
                    traj.num_turns += 1
                    traj.turn_times.append(time.perf_counter() - row.turn_t0)
                    _finish(row, "context" if len(traj.token_ids) >= max_total_tokens else "max_tokens", cut_turn=True)
                else:
                    row.feed = [token]

            # --- tool calls of all rows that ended a turn together run as one batch
            texts = [turn_text(tokenizer, bits, rows[r].traj.token_ids[rows[r].turn_start:]) for r in ended]
            sqls = [env.pending_sql(rows[r].traj.episode, text) for r, text in zip(ended, texts)]
            jobs = [(rows[r].traj.example["db_path"], sql) for r, sql in zip(ended, sqls) if sql is not None]
            results = iter(env.run_many(jobs, workers=sql_workers) if jobs else [])
            for r, text, sql in zip(ended, texts, sqls):
                row, traj = rows[r], rows[r].traj
                turn, last = traj.num_turns, traj.token_ids[-1]
                observation, done = env.step(traj.episode, text, next(results) if sql is not None else None)
                traj.num_turns += 1
                # close the assistant message exactly as the template does (a sampled eos is its first token)
                extra = bits.close_ids[1:] if last == bits.close_ids[0] else list(bits.close_ids)
                if not done:
                    extra += observation_ids(tokenizer, bits, proto.obs_role, observation)
                fits = len(traj.token_ids) + len(extra) + (0 if done else 1) <= max_total_tokens
                if fits:
                    _append(traj, extra, turn)
                traj.turn_times.append(time.perf_counter() - row.turn_t0)
                if done or not fits:
                    _finish(row, traj.episode.stop_reason if done else "context")
                else:
                    row.feed, row.turn_start, row.turn_t0 = [last] + extra, len(traj.token_ids), time.perf_counter()

            # --- a finished row hands its slot to a waiting row; with none waiting the slot dies, and once a quarter of
            # the slots are dead they leave the cache (each compaction moves every kept row)
            for i, r in live:
                if rows[r].traj.stop_reason:
                    if bar is not None:
                        bar.update(1)
                    active[i] = admit(i) if waiting else None
            keep = [i for i, r in enumerate(active) if r is not None]
            if len(keep) <= 0.75 * len(active):
                active = [active[i] for i in keep]
                if active:
                    cache.keep(keep)
    return [row.traj for row in rows]

def rollout_with_signal(model, tokenizer, prompts, protocol, reward_fn, *, refill=None, rounds=3, seed, group_size,
                        **rollout_kw):
    """Rollouts and rewards of prompts, group-major, and stats. With refill (DAPO's dynamic sampling: n -> n fresh
    prompts), groups whose rewards are all equal carry no gradient, so fresh prompts are rolled, at most `rounds` more
    times, until len(prompts) groups have signal; flat groups fill the batch only when that cap is hit."""
    G, kept, flat, done, batch = group_size, [], [], 0, prompts
    while True:
        trajs = rollout(model, tokenizer, batch, protocol, seed=seed + 7 * done, group_size=G, **rollout_kw)
        rewards = [reward_fn(t, t.example) for t in trajs]
        for g in range(len(batch)):
            group = (trajs[g * G:(g + 1) * G], rewards[g * G:(g + 1) * G])
            signal = len({r["full"] for r in group[1]}) > 1 or len({r.get("schema") for r in group[1]}) > 1
            (kept if signal or refill is None else flat).append(group)
        done += 1
        if len(kept) >= len(prompts) or done > rounds or refill is None:
            break
        batch = refill(len(prompts))
    groups = (kept + flat)[:len(prompts)]
    stats = {"ds_rounds": done, "ds_signal_groups": min(len(kept), len(prompts)),
             "ds_cap_hit": len(kept) < len(prompts)} if refill is not None else {}
    return [t for g in groups for t in g[0]], [r for g in groups for r in g[1]], stats

def rollout_metrics(trajs, rewards):
    """Means over a step's trajectories on all ranks: every numeric reward term, EX, turns, tool calls, tokens."""
    keys = sorted({k for r in rewards for k, v in r.items() if isinstance(v, (int, float))})
    local = {f"reward_{k}": sum(float(r.get(k) or 0.0) for r in rewards) for k in keys}
    local |= {"ex": sum(r["correct"] for r in rewards), "turns": sum(t.num_turns for t in trajs),
              "tool_calls": sum(t.num_tool_calls for t in trajs),
              "sampled_tokens": sum(sum(t.loss_mask) for t in trajs),
              "seq_tokens": sum(len(t.token_ids) for t in trajs),
              "answered": sum(t.episode.final_sql is not None for t in trajs), "n": len(trajs)}
    total = torch.tensor(list(local.values()), dtype=torch.float64)
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(total)
    total = dict(zip(local, total.tolist()))
    n = max(total.pop("n"), 1)
    return {k: v / n for k, v in total.items()}

# -----------------------------------------------------------------------------

if __name__ == "__main__":
    parser = env.ArgumentParser(description=__doc__)
    pos = env.positive_int
    parser.add_argument("--model", default="smollm2", help='"smollm2" (the demo\'s model), "tiny" (the test model), a '
                        'Hugging Face id or a local folder')
    parser.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"], help="weights while rolling "
                        "out (auto: bf16 where the device has fast bf16 matmuls)")
    parser.add_argument("--data", type=env.existing_file, default=None, help="examples JSONL (default: gym dev)")
    parser.add_argument("--protocol", default="trust", choices=sorted(env.PROTOCOLS), help="agent turn format")
    parser.add_argument("--schema-mode", default="none", choices=env.SCHEMA_MODES,
                        help="none: unknown schema; prompt: schema in the prompt")
    parser.add_argument("--num-examples", type=pos, default=4, help="questions rolled out (the first N of --data)")
    parser.add_argument("--group-size", type=pos, default=2, help="rollouts per question")
    parser.add_argument("--max-turns", type=pos, default=5, help="assistant turns per episode")
    parser.add_argument("--max-new-tokens", type=pos, default=256, help="per assistant turn")
    parser.add_argument("--max-total-tokens", type=pos, default=4096, help="whole trajectory")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (0 = greedy)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    args = parser.parse_args()
    from model import TORCH_DTYPES, load_model, resolve_dtype
    if args.data is None:
        from data.gym.prepare import ensure_gym
        args.data = str(ensure_gym() / "dev.jsonl")
    try:  # a user's --model or --data that cannot load: one line, not a traceback
        examples = env.load_examples(args.data)[:args.num_examples]
        dtype = TORCH_DTYPES[resolve_dtype(args.dtype, args.device)]
        model, tokenizer = load_model(args.model, device=args.device, dtype=dtype)
    except (OSError, RuntimeError, ValueError) as e:
        env.die(e)
    t0 = time.perf_counter()
    trajs = rollout(model, tokenizer, examples, args.protocol, group_size=args.group_size, max_turns=args.max_turns,
                    max_new_tokens=args.max_new_tokens, max_total_tokens=args.max_total_tokens,
                    temperature=args.temperature, top_p=args.top_p, schema_mode=args.schema_mode, seed=args.seed)
    elapsed = time.perf_counter() - t0
    sampled = sum(sum(t.loss_mask) for t in trajs)
    print(f"{len(trajs)} trajectories, {sampled} sampled tokens in {elapsed:.2f}s ({sampled / elapsed:.0f} tok/s)")
    for t in trajs:
        print(f"group {t.group}: {t.num_turns} turns, {t.num_tool_calls} tool calls, {len(t.token_ids)} tokens, "
              f"stop {t.stop_reason}")
    print("--- first trajectory after the prompt:")
    print(tokenizer.decode(trajs[0].token_ids[trajs[0].prompt_len:]))
