"""sft.py: SFT rows are the chat template's tokens, masked to the agent's own, and the very sequence rollout feeds.

    python -m pytest -q tests/test_sft.py
"""
import pytest

import env
import protocols
from sft import tokenize_chat


@pytest.fixture(scope="module")
def teacher_record(gym_dir):
    from data.teacher import teach
    examples = env.load_examples(gym_dir / "train.jsonl")
    ex = next(e for e in examples if e["difficulty"] == "extra")
    rec, reason = teach(ex, "trust", max_turns=10, seed=0, repair_rate=1.0)
    assert rec is not None, reason
    return rec, ex


def test_sft_tokens_equal_the_template_and_mask_only_agent_tokens(tiny, teacher_record):
    _, tok = tiny
    rec, _ = teacher_record
    messages = rec["messages"]
    ids, mask = tokenize_chat(messages, tok)
    whole = tok.apply_chat_template(messages, tokenize=True, return_dict=True)  # SmolLM2's real template
    assert ids == list(whole["input_ids"])  # token-exact with rendering the whole conversation at once
    trained = tok.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False)
    agent = "".join(m["content"] + tok.eos_token for m in messages if m["role"] == "assistant")
    assert trained == agent  # exactly the agent's turns and their eos: no prompt, no observation, no role header
    obs_role = protocols.PROTOCOLS["trust"].obs_role
    assert any(m["role"] == obs_role and "Error" in m["content"] for m in messages)  # observations are there...
    assert "Error" not in trained  # ...and masked


def test_sft_sequence_is_what_rollout_feeds(tiny, teacher_record):
    """Force rollout to replay the teacher's turns: identical token ids. The loss masks differ only where a turn
    ended at a stop string: SFT trains the eos the template puts there, rollout feeds it."""
    from rollout import rollout
    model, tok = tiny
    rec, ex = teacher_record
    ids, mask = tokenize_chat(rec["messages"], tok)
    turns = []
    prev = 0
    for i, m in enumerate(mask):  # each run of trained tokens is one assistant turn (content + eos)
        if m and not prev:
            turns.append([])
        if m:
            turns[-1].append(ids[i])
        prev = m

    def script(row, turn, sofar):
        return turns[turn][len(sofar)] if len(sofar) < len(turns[turn]) else None
    traj = rollout(model, tok, [ex], "trust", group_size=1, max_turns=10, max_new_tokens=512, max_total_tokens=4096,
                   temperature=1.0, top_p=1.0, schema_mode="none", seed=0, force=script)[0]
    assert traj.token_ids == ids
    assert traj.stop_reason == "answer"
    diff = [i for i, (a, b) in enumerate(zip(traj.loss_mask, mask)) if a != b]
    assert all(ids[i] == tok.eos_token_id and mask[i] == 1 for i in diff)


def test_tokenizer_without_chat_template_is_a_clear_error(tiny):
    _, tok = tiny
    bare = type(tok).from_pretrained(tok.name_or_path)
    bare.chat_template = None
    with pytest.raises(ValueError, match="chat template"):
        tokenize_chat([{"role": "user", "content": "hi"}], bare)
