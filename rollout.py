"""
Batched multi-turn rollout: len(examples) * group_size agent episodes decoded together with ONE KV cache that lives
across all turns. A turn ends at EOS or at a protocol stop string (a tool call); the SQL of every row that stopped at
the same step runs in one env.run_many batch, the observation's chat-template tokens are fed into that row's cache,
and the row decodes on. History is never re-encoded; the training tensors are the very ids sampled and fed.

    python rollout.py --data data/gym/dev.jsonl --protocol trust --num-examples 4 --group-size 2 --max-turns 5

The loop (the engine itself, cache, decode step and sampling, is engine.py; details in docs/rollout.md):
- Each step is one decode step over all rows in use, one token each. Tokens that must go in first (the prompt;
  after a tool call the end-of-turn tokens, the observation message and the generation prompt) are prefilled for
  just the rows that have them, batched by similar length. The shared system message is prefilled once and copied
  into each row.
- Continuous batching: at most max_rows rows decode at once; a finished row's slot goes to the next waiting row.
  Once none wait, idle slots feed pads into the scratch slot until a quarter are idle, and then leave the cache.
- sample_logprobs = log_softmax(logits / T) of the sampled token over the FULL vocabulary, untruncated by top_p:
  what trainers recompute.
- Limits are always visible in stop_reason: max_turns (env), max_tokens (a turn reached max_new_tokens), context
  (the row would exceed max_total_tokens). Nothing is ever cut from the left. A turn cut by a limit is recorded on
  the Episode as an "invalid" action, so episode.actions keeps one entry per sampled turn.
"""
import os
import time
from dataclasses import dataclass, field

import torch

import cli
import engine
import env
import memory
import protocols

_SENTINEL = "@@turn-content@@"

# -----------------------------------------------------------------------------
# RolloutConfig: how an episode runs, besides the model, the questions and the seed


@dataclass(frozen=True)
class RolloutConfig:
    """The protocol and its limits, and how tokens are sampled. train.py builds one from its flags, eval.py from its
    own; greedy decoding is replace(cfg, temperature=0.0, top_p=1.0). rollout(**vars(cfg), ...) takes it field by
    field."""
    protocol: str = "trust"   # a name in protocols.PROTOCOLS, variants included
    schema_mode: str = "none"
    max_turns: int = 15
    max_new_tokens: int = 1024
    max_total_tokens: int = 16384
    temperature: float = 0.8
    top_p: float = 1.0

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
    observations: list[str] = field(default_factory=list)  # what the environment answered each ended turn

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
    traj = row.traj
    episode = traj.episode
    if cut_turn:  # the turn never ended: nothing was parsed or executed
        episode.actions.append(env.Action("invalid", None, None, False, f"turn cut by the {reason} limit"))
        episode.turn_valid.append(False)
        episode.exec_errors.append(None)
    traj.stop_reason = reason
    traj.num_tool_calls = episode.num_tool_calls
    if not episode.done:
        episode.done = True
        episode.stop_reason = reason


@torch.inference_mode()
def rollout(model, tokenizer, examples, protocol, *, group_size, max_turns, max_new_tokens, max_total_tokens,
            temperature, top_p, schema_mode, seed, force=None, sql_workers=4, max_rows=None, bar=None,
            decode="auto", draw_keys=None):
    """Roll out group_size episodes per example; returns Trajectories group-major (example i -> rows i*G..i*G+G-1).
    max_rows: at most this many rows decode at once; a finished row's cache slot goes to the next waiting row
    (continuous batching), so a batch never waits for its longest row while others queue. bar: a tqdm advanced by
    one per finished row. force: optional test/benchmark hook (row, turn, tokens sampled so far this turn) -> token
    id or None; a token overrides the sampled one (a scripted policy), and its recorded log-prob is still the
    model's log-prob of it. decode: how the engine runs its decode step (engine.make_decoder); "auto" replays CUDA
    graphs on a GPU. draw_keys: per row (group-major), the key its sampling draws hash with the seed and the token's
    position (default: the row's index), e.g. a question and sample that two rollouts must draw alike."""
    if temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got {temperature=}, {top_p=}")
    proto = protocols.get(protocol)
    bits = chat_bits(tokenizer, model, proto)
    param = next(model.parameters())

    # --- one row per (example, sample); prompts too long for the context end at once, never cut from the left
    rows = []
    t0 = time.perf_counter()
    for group, example in enumerate(examples):
        turns = example.get("max_turns", max_turns)  # a per-question budget (train.py --adaptive-turns) wins
        prompt = render_ids(tokenizer, proto.build_messages(example, schema_mode, turns), True)
        for _ in range(group_size):
            episode = env.new_episode(example, proto, turns, schema_mode)
            traj = Trajectory(list(prompt), len(prompt), [0] * len(prompt), [0.0] * len(prompt),
                              [-1] * len(prompt), episode, example, group, 0, 0, "")
            rows.append(_Row(traj, list(prompt), len(prompt), t0))
            if len(prompt) >= max_total_tokens:
                _finish(rows[-1], "context")
    keys = list(range(len(rows))) if draw_keys is None else list(draw_keys)
    if len(keys) != len(rows):
        raise ValueError(f"draw_keys has {len(keys)} keys for {len(rows)} rows")
    waiting = [r for r, row in enumerate(rows) if not row.traj.stop_reason][::-1]  # popped from the end
    if not waiting:
        return [row.traj for row in rows]
    # under autocast (fp32 weights, bf16 compute) the cache takes the compute dtype
    device_type = param.device.type
    autocast = torch.is_autocast_enabled(device_type)
    dtype = torch.get_autocast_dtype(device_type) if autocast else param.dtype
    slots = memory.cache_rows(model, min(len(waiting), max_rows or len(waiting)), param.device, dtype,
                              max_total_tokens)
    cache = engine.SlotCache(model, slots, param.device, dtype, max_total_tokens)
    pad = tokenizer.pad_token_id

    with engine.use_slot_attention(model):
        # --- every prompt starts with the same system message: prefill it once into a one-row cache; each row's
        # slot starts as a copy of it, and the rest of the row's prompt is prefilled with the other rows' feeds
        prompts = [rows[r].feed for r in waiting]
        shared = min(len(os.path.commonprefix(prompts)), min(map(len, prompts)) - 1)
        head = engine.SlotCache(model, 1, param.device, dtype, max(shared, 1))
        if shared > 1:  # prefill feeds all but a feed's last token: these are the shared ones
            engine.prefill(model, head, {0: prompts[0][:shared + 1]}, pad)
        else:
            shared = 0

        def admit(slot):
            """The next waiting row takes cache slot `slot` (its old keys stay behind its length, unread)."""
            r = waiting.pop()
            cache.start_row(slot, head, shared)
            rows[r].feed = rows[r].feed[shared:]
            rows[r].turn_t0 = time.perf_counter()
            return r

        active = [admit(slot) for slot in range(slots)]
        decoder = engine.make_decoder(model, cache, decode)
        while active:
            # an idle slot holds nothing: it sorts first and adds nothing to what a compaction copies
            cache.lens = [0 if r is None else n for r, n in zip(active, cache.lens)]
            # --- on the CPU, slots sorted by length let each range of rows read only about its own keys; a sort
            # moves most of the cache, so it happens only once the keys a step reads would drop enough
            if decoder.mode == "ranged":
                ahead = [cache.lens[i] + (0 if r is None else len(rows[r].feed)) for i, r in enumerate(active)]
                order = sorted(range(len(active)), key=ahead.__getitem__)
                if engine.keys_read([ahead[j] for j in order]) < engine.SORT_BELOW * engine.keys_read(ahead):
                    active = [active[j] for j in order]
                    cache.keep(order)
            # --- observations waiting to be fed go in as prefill batches; then one decode step for every slot (an
            # idle slot, None, feeds a pad into the scratch slot until the next compaction)
            live = [(i, r) for i, r in enumerate(active) if r is not None]
            engine.prefill(model, cache, {i: rows[r].feed for i, r in live}, pad)
            feeds = [None if r is None else rows[r].feed[-1] for r in active]
            logits = engine.decode(model, cache, decoder, feeds, pad)
            u = None
            if temperature > 0:  # row r's token at position n draws hash(seed, key r, n), whatever its neighbours
                u = engine.uniforms(seed, [-1 if r is None else keys[r] for r in active],
                                    [0 if r is None else len(rows[r].traj.token_ids) for r in active], param.device)
            tokens, logp = engine.sample(logits, temperature, top_p, u)  # (A,), (A, V)
            tokens = tokens.tolist()
            if force is not None:
                for i, r in live:
                    forced = force(r, rows[r].traj.num_turns, rows[r].traj.token_ids[rows[r].turn_start:])
                    tokens[i] = tokens[i] if forced is None else forced
            token_logp = logp.gather(1, torch.tensor(tokens, device=logp.device)[:, None]).squeeze(1).tolist()

            # --- append the sampled token; decide per row: keep decoding, end the turn, or hit a limit
            ended = []
            for i, r in live:
                row = rows[r]
                traj = row.traj
                token = tokens[i]
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
                row = rows[r]
                traj = row.traj
                turn = traj.num_turns
                last = traj.token_ids[-1]
                observation, done = env.step(traj.episode, text, next(results) if sql is not None else None)
                traj.observations.append(observation)
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
                    row.feed = [last] + extra
                    row.turn_start = len(traj.token_ids)
                    row.turn_t0 = time.perf_counter()

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

# -----------------------------------------------------------------------------

if __name__ == "__main__":
    from model import AUTO_DTYPE, DTYPE_CHOICES, TORCH_DTYPES, load_model, resolve_dtype
    parser = cli.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2", help='"smollm2" (the demo\'s model), "tiny" (the test model), a '
                        'Hugging Face id or a local folder')
    parser.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help="weights while rolling "
                        f"out; {AUTO_DTYPE}")
    parser.add_argument("--data", type=cli.existing_file, default=None, help="examples JSONL (default: gym dev)")
    parser.add_argument("--protocol", default="trust", choices=sorted(protocols.PROTOCOLS), help="agent turn format")
    parser.add_argument("--schema-mode", default="none", choices=env.SCHEMA_MODES,
                        help="none: unknown schema; prompt: schema in the prompt")
    parser.add_argument("--num-examples", type=cli.positive_int, default=4,
                        help="questions rolled out (the first N of --data)")
    parser.add_argument("--group-size", type=cli.positive_int, default=2, help="rollouts per question")
    parser.add_argument("--max-turns", type=cli.positive_int, default=5, help="assistant turns per episode")
    parser.add_argument("--max-new-tokens", type=cli.positive_int, default=256, help="per assistant turn")
    parser.add_argument("--max-total-tokens", type=cli.positive_int, default=4096, help="whole trajectory")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (0 = greedy)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    args = parser.parse_args()
    if args.data is None:
        from data.gym.prepare import ensure_gym
        args.data = str(ensure_gym() / "dev.jsonl")
    try:  # a user's --model or --data that cannot load: one line, not a traceback
        examples = env.load_examples(args.data)[:args.num_examples]
        dtype = TORCH_DTYPES[resolve_dtype(args.dtype, args.device)]
        model, tokenizer = load_model(args.model, device=args.device, dtype=dtype)
    except (OSError, RuntimeError, ValueError) as e:
        cli.die(e)
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
