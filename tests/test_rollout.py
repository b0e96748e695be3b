"""rollout.py on the tiny model (CPU, fp32; SmolLM2's tokenizer on a small random Llama) and tiny configs of other
model families: replay, batch invariance, token-in/token-out, limits, bad tool calls.

An untrained model emits junk, so real tool calls come from a scripted policy fed through rollout's `force` hook;
the turns it leaves open are sampled (or decoded greedily) by the model itself.
"""
import json
import os

import pytest
import torch

import env
import protocols
import rollout
from model import load_model

MAX_NEW = 80
MAX_TOTAL = 4096

pytestmark = pytest.mark.usefixtures("one_thread")


def trust_call(sql, db_id="db"):
    call = json.dumps({"name": "execute_sql_query", "arguments": {"db_id": db_id, "sql": sql}})
    return f"<think>I run a query.</think>\n<action>generate_sql</action>\n<tool_call>\n{call}\n</tool_call>"


def trust_answer(sql):
    return f"<think>That answers it.</think>\n<action>confirm_answer</action>\n<answer>\n{sql}\n</answer>"


def scripted(tokenizer, scripts):
    """force hook from scripts[row][turn]: a text or token ids to emit; an int k: the model picks k tokens, then
    eos; None or missing: the model decides everything."""
    enc = {row: [tokenizer.encode(t, add_special_tokens=False) if isinstance(t, str) else t for t in turns]
           for row, turns in scripts.items()}

    def force(row, turn, sampled):
        script = enc.get(row, [])[turn] if turn < len(enc.get(row, [])) else None
        if isinstance(script, int):
            return tokenizer.eos_token_id if len(sampled) >= script else None
        return script[len(sampled)] if script is not None and len(sampled) < len(script) else None
    return force


def run(tiny, examples, scripts, protocol="trust", group_size=1, **kw):
    model, tokenizer = tiny
    args = dict(group_size=group_size, max_turns=3, max_new_tokens=MAX_NEW, max_total_tokens=MAX_TOTAL,
                temperature=0.0, top_p=1.0, schema_mode="none", seed=0)
    args.update(kw)
    return rollout.rollout(model, tokenizer, examples, protocol, force=scripted(tokenizer, scripts), **args)


def replay_logprobs(model, traj, temperature):
    """Teacher-forced log-prob of every token given its prefix (at the sampling temperature), from one plain forward
    over the final ids."""
    ids = torch.tensor([traj.token_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids.to(model.device)).logits.float() / temperature, dim=-1)[0].cpu()  # (T, V)
    out = torch.zeros(len(traj.token_ids))
    out[1:] = logp[:-1].gather(1, ids[0, 1:, None]).squeeze(1)
    return out


def segments(traj):
    """[(turn, sampled ids, fed ids after them)] from loss_mask and turn_ids alone."""
    out = []
    for i in range(traj.prompt_len, len(traj.token_ids)):
        t = traj.turn_ids[i]
        sampled = traj.loss_mask[i] == 1
        if not out or out[-1][0] != t:
            out.append((t, [], []))
        out[-1][1 if sampled else 2].append(traj.token_ids[i])
    return out

# -----------------------------------------------------------------------------
# 1. teacher-forced replay and reproducibility


def test_replay_matches_sample_logprobs_and_seed_reproduces(tiny, examples):
    model, _ = tiny
    # two examples x 2 samples; turn 0 a scripted tool call (different result sizes), turn 1 sampled by the model
    scripts = {r: [trust_call(f"SELECT * FROM sqlite_master LIMIT {r + 1}"), 12 + 4 * r] for r in range(4)}
    kw = dict(group_size=2, temperature=0.8, top_p=0.9, seed=123)
    trajs = run(tiny, examples[:2], scripts, **kw)
    assert [t.group for t in trajs] == [0, 0, 1, 1]
    for traj in trajs:
        assert traj.num_turns >= 2 and traj.num_tool_calls >= 1
        mask = torch.tensor(traj.loss_mask, dtype=torch.bool)
        recorded = torch.tensor(traj.sample_logprobs)
        assert (recorded[~mask] == 0).all()
        assert torch.allclose(replay_logprobs(model, traj, 0.8)[mask], recorded[mask], atol=1e-4, rtol=0)
    again = run(tiny, examples[:2], scripts, **kw)
    assert [t.token_ids for t in again] == [t.token_ids for t in trajs]
    other = run(tiny, examples[:2], scripts, **{**kw, "seed": 124})
    assert [t.token_ids for t in other] != [t.token_ids for t in trajs]


# -----------------------------------------------------------------------------
# 2. batch invariance


def test_greedy_batch_equals_each_row_alone(tiny, examples):
    # 8 questions; ragged tool results; rows 0, 3, 6 answer in turn 1 and leave the batch while the rest decode
    scripts = {r: [trust_call(f"SELECT * FROM sqlite_master LIMIT {r % 4 + 1}")] +
               ([trust_answer("SELECT 1")] if r % 3 == 0 else []) for r in range(8)}
    batch = run(tiny, examples[:8], scripts)
    assert {t.stop_reason for t in batch[::3]} == {"answer"}
    for r in range(8):
        alone = run(tiny, examples[r:r + 1], {0: scripts[r]})[0]
        assert alone.token_ids == batch[r].token_ids, f"row {r} differs when decoded alone"
        assert alone.stop_reason == batch[r].stop_reason
        assert torch.allclose(torch.tensor(alone.sample_logprobs), torch.tensor(batch[r].sample_logprobs),
                              atol=1e-4, rtol=0)

def test_continuous_batching_decodes_each_row_as_the_full_batch_does(tiny, examples):
    # 3 slots for 8 questions: rows that answer early hand their slot (and its stale keys) to waiting rows
    scripts = {r: [trust_call(f"SELECT * FROM sqlite_master LIMIT {r % 4 + 1}")] +
               ([trust_answer("SELECT 1")] if r % 3 == 0 else []) for r in range(8)}
    full = run(tiny, examples[:8], scripts)
    from tqdm import tqdm
    bar = tqdm(total=8, file=open(os.devnull, "w"))
    slots = run(tiny, examples[:8], scripts, max_rows=3, bar=bar)
    assert bar.n == 8  # one tick per finished row
    assert [t.example["id"] for t in slots] == [ex["id"] for ex in examples[:8]]  # still in example order
    for a, b in zip(full, slots):
        assert a.token_ids == b.token_ids and a.stop_reason == b.stop_reason
        assert torch.allclose(torch.tensor(a.sample_logprobs), torch.tensor(b.sample_logprobs), atol=1e-4, rtol=0)


# -----------------------------------------------------------------------------
# 3. token-in/token-out


@pytest.mark.parametrize("protocol", ["trust", "trail"])
def test_token_ids_equal_template_of_whole_conversation(tiny, examples, protocol):
    model, tokenizer = tiny
    proto = protocols.PROTOCOLS[protocol]
    if protocol == "trust":
        turns = [trust_call("SELECT name FROM sqlite_master"), trust_call("SELECT nope FROM nowhere"),
                 trust_answer("SELECT 1")]
    else:
        turns = ["<reasoning>tables?</reasoning>\n<sql>SELECT name FROM sqlite_master</sql>",
                 "<reasoning>bad tags</reasoning><sql>", "<reasoning>done</reasoning>\n<solution>SELECT 1</solution>"]
        turns[1] = tokenizer.encode(turns[1], add_special_tokens=False) + [tokenizer.eos_token_id]  # ends at eos
    traj = run(tiny, examples[:1], {0: turns}, protocol=protocol, max_turns=4, max_new_tokens=200)[0]
    assert traj.stop_reason == "answer" and traj.num_turns == 3

    # the same conversation through the chat template, with observations from a fresh episode
    episode = env.new_episode(examples[0], protocols.get(protocol), 4)
    messages = proto.build_messages(examples[0], "none", 4)
    for turn in turns:
        text = turn if isinstance(turn, str) else tokenizer.decode(turn, skip_special_tokens=True)
        observation, done = env.step(episode, text)
        messages.append({"role": "assistant", "content": text})
        if not done:
            messages.append({"role": proto.obs_role, "content": observation})
    assert traj.token_ids == rollout.render_ids(tokenizer, messages, False)
    assert [a.name for a in traj.episode.actions] == [a.name for a in episode.actions]

    # each fed block = end of the assistant turn + the template-encoded observation message, and nothing sampled
    bits = rollout.chat_bits(tokenizer, model, proto)
    observations = [m["content"] for m in messages if m["role"] == proto.obs_role][-2:]
    for (turn, sampled, fed), observation in zip(segments(traj), observations):
        close = bits.close_ids[1:] if sampled[-1] == tokenizer.eos_token_id else bits.close_ids
        assert fed == close + rollout.observation_ids(tokenizer, bits, proto.obs_role, observation)


def test_sampled_tokens_are_kept_not_retokenized(tiny, examples):
    _, tokenizer = tiny
    text = trust_call("SELECT name FROM sqlite_master")
    head, tail = text.split("SELECT")
    # spell "SELECT" one character per token: decodes to the same text, but is not how the tokenizer encodes it
    odd = (tokenizer.encode(head, add_special_tokens=False)
           + [tokenizer.encode(ch, add_special_tokens=False)[0] for ch in "SELECT"]
           + tokenizer.encode(tail, add_special_tokens=False))
    assert tokenizer.decode(odd) == text and tokenizer.encode(text, add_special_tokens=False) != odd
    traj = run(tiny, examples[:1], {0: [odd]})[0]
    assert segments(traj)[0][1] == odd
    assert traj.episode.actions[0].name == "generate_sql" and traj.episode.exec_errors[0] is None

# -----------------------------------------------------------------------------
# 4. limits


def test_turn_budget_ends_with_max_turns_and_last_turn_hint(tiny, examples):
    _, tokenizer = tiny
    call = trust_call("SELECT name FROM sqlite_master")
    traj = run(tiny, examples[:1], {0: [call, call]}, max_turns=2)[0]
    assert (traj.stop_reason, traj.num_turns, traj.num_tool_calls) == ("max_turns", 2, 2)
    assert traj.episode.stop_reason == "max_turns" and len(traj.episode.actions) == 2
    assert "This is your last turn" in tokenizer.decode(segments(traj)[0][2])


def test_a_question_with_its_own_turn_budget_gets_it_in_prompt_and_episode(tiny, examples):
    # train.py --adaptive-turns puts rewards.turn_budget(difficulty, T) on each question as "max_turns"
    _, tokenizer = tiny
    call = trust_call("SELECT name FROM sqlite_master")
    short = dict(examples[0], max_turns=2)
    trajs = run(tiny, [short, examples[1]], {0: [call, call, call], 1: [call, call, call]}, max_turns=3)
    assert [t.episode.max_turns for t in trajs] == [2, 3] and [t.num_turns for t in trajs] == [2, 3]
    prompts = [tokenizer.decode(t.token_ids[:t.prompt_len]) for t in trajs]
    assert "You have 2 turns" in prompts[0] and "You have 3 turns" in prompts[1]


def test_max_new_tokens_ends_with_max_tokens(tiny, examples):
    _, tokenizer = tiny
    x = tokenizer.encode("x", add_special_tokens=False)[0]
    traj = run(tiny, examples[:1], {0: [[x] * 100]}, max_new_tokens=10)[0]
    assert traj.stop_reason == "max_tokens" and traj.num_turns == 1
    assert sum(traj.loss_mask) == 10 and traj.token_ids[traj.prompt_len:] == [x] * 10
    assert traj.episode.done and traj.episode.actions[-1].name == "invalid"


def test_context_limit_is_visible_never_a_silent_cut(tiny, examples):
    _, tokenizer = tiny
    x = tokenizer.encode("x", add_special_tokens=False)[0]
    prompt_len = run(tiny, examples[:1], {0: [[x] * 100]}, max_new_tokens=1)[0].prompt_len
    # mid-turn: the row fills its context exactly
    traj = run(tiny, examples[:1], {0: [[x] * 100]}, max_new_tokens=50, max_total_tokens=prompt_len + 5)[0]
    assert traj.stop_reason == "context" and len(traj.token_ids) == prompt_len + 5
    # an observation that does not fit is not fed (and not truncated)
    call = trust_call("SELECT * FROM sqlite_master")
    traj = run(tiny, examples[:1], {0: [call]}, max_new_tokens=200, max_total_tokens=prompt_len + 80)[0]
    assert traj.stop_reason == "context" and traj.num_tool_calls == 1 and sum(traj.loss_mask) < 80
    assert traj.token_ids[traj.prompt_len:] == tokenizer.encode(call, add_special_tokens=False)
    # a prompt longer than the context ends at once, with the question intact
    traj = run(tiny, examples[:1], {}, max_total_tokens=prompt_len - 1)[0]
    assert (traj.stop_reason, traj.num_turns, len(traj.token_ids)) == ("context", 0, prompt_len)

# -----------------------------------------------------------------------------
# 5. a malformed tool call mid-batch


@pytest.mark.parametrize("bad", ['<think>x</think><action>generate_sql</action><tool_call>{"name": </tool_call>',
                                 trust_call("SELECT missing FROM nowhere")])
def test_malformed_tool_call_leaves_other_rows_alone(tiny, examples, bad):
    good = {r: [trust_call(f"SELECT * FROM sqlite_master LIMIT {r + 1}")] for r in range(4)}
    ref = run(tiny, examples[:4], good)
    trajs = run(tiny, examples[:4], {**good, 2: [bad]})
    for r in (0, 1, 3):
        assert trajs[r].token_ids == ref[r].token_ids
    episode = trajs[2].episode
    assert trajs[2].num_turns >= 2  # the bad call became an observation; the episode went on
    assert episode.actions[0].name == "invalid" or episode.exec_errors[0] is not None

# -----------------------------------------------------------------------------
# mixed precision, as train.py runs it


def check_bf16_autocast_rollout(pair, examples, replay_model, atol):
    """A rollout under bf16 autocast on pair's device (also run by tests/test_cuda.py) plays its 2 turns, and its
    recorded log-probs stay within bf16 noise (atol) of replay_model's."""
    scripts = {r: [trust_call("SELECT name FROM sqlite_master"), 8] for r in range(2)}
    with torch.autocast(pair[0].device.type, dtype=torch.bfloat16):
        trajs = run(pair, examples[:1], scripts, group_size=2, temperature=1.0, max_turns=2)
        for traj in trajs:
            assert traj.num_turns == 2 and traj.num_tool_calls == 1
            mask = torch.tensor(traj.loss_mask, dtype=torch.bool)
            replay = replay_logprobs(replay_model, traj, 1.0)[mask]
            assert torch.allclose(replay, torch.tensor(traj.sample_logprobs)[mask], atol=atol, rtol=0)


def test_rollout_under_autocast_keeps_a_bf16_cache_and_replays_closely(tiny, examples):
    check_bf16_autocast_rollout(tiny, examples, tiny[0], atol=2e-2)  # replayed under the same autocast

# -----------------------------------------------------------------------------
# rollout -> grpo_step: the update reads rollout's tokens, masks and log-probs the way they were produced


def test_grpo_step_on_rollouts_moves_each_trajectory_along_its_advantage(examples):
    from grpo import GRPOConfig, grpo_step
    model, tokenizer = load_model("tiny", seed=0)  # its own copy: this test changes the weights
    # 4 samples of one question: a scripted tool call (observation tokens in the sequence), then 10 sampled tokens
    scripts = {r: [trust_call("SELECT name FROM sqlite_master"), 10] for r in range(4)}
    trajs = run((model, tokenizer), examples[:1], scripts, group_size=4, temperature=1.0, max_turns=2, seed=7)
    rewards = [{"full": 1.0, "schema": 0.0}] + [{"full": 0.0, "schema": 0.0}] * 3  # row 0 alone is right

    def sampled_logp():
        return torch.stack([(replay_logprobs(model, t, 1.0) * torch.tensor(t.loss_mask)).sum() for t in trajs])

    before = sampled_logp()
    cfg = GRPOConfig(group_size=4, schema_lambda=0.0, grad_clip=1e9, pad_id=tokenizer.pad_token_id)
    m = grpo_step(model, torch.optim.SGD(model.parameters(), lr=0.05), trajs, rewards, cfg)
    # first pass: grpo's recomputed log-probs are the sampler's (ratio 1, nothing clipped)
    assert abs(m["sampler_kl"]) < 1e-5 and m["clip_frac_high"] == m["clip_frac_low"] == 0.0
    change = sampled_logp() - before
    assert change[0] > 0 and (change[1:] < 0).all(), change  # the rewarded trajectory up, the others down

# -----------------------------------------------------------------------------
# 6. any Hugging Face causal LM: tiny random configs of the families users train


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "mistral", "qwen3_moe"])
def test_every_model_family_batches_and_replays(tiny, examples, model_type):
    """Llama-family models take the rollout's 4-D mask as a tensor only (a dict of masks crashed them): each family
    decodes a batch exactly as each row alone, and its recorded log-probs match a plain forward."""
    from transformers import AutoConfig, AutoModelForCausalLM
    _, tokenizer = tiny
    dims = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True)
    if model_type == "qwen3_moe":
        dims.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **dims), attn_implementation="sdpa")
    pair = (model.eval(), tokenizer)
    scripts = {r: [trust_call(f"SELECT * FROM sqlite_master LIMIT {r + 1}"), 6 + 3 * r] for r in range(3)}
    batch = run(pair, examples[:3], scripts, max_new_tokens=20)
    for r in range(3):
        alone = run(pair, examples[r:r + 1], {0: scripts[r]}, max_new_tokens=20)[0]
        assert alone.token_ids == batch[r].token_ids, f"{model_type}: row {r} differs when decoded alone"
    sampled = run(pair, examples[:2], scripts, group_size=1, temperature=0.8, seed=1, max_new_tokens=20)
    for traj in sampled:
        mask = torch.tensor(traj.loss_mask, dtype=torch.bool)
        assert mask.sum() > 10
        assert torch.allclose(replay_logprobs(model, traj, 0.8)[mask], torch.tensor(traj.sample_logprobs)[mask],
                              atol=1e-4, rtol=0)
