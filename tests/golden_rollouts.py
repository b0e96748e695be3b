"""The greedy rollouts that pin the decoding engine down: the same scripted multi-turn scenario on tiny random Llama,
Qwen2, Qwen3 and Mistral models and on SmolLM2, in fp32 on the CPU. tests/golden/*.json hold the token ids that the
engine before the static decode step produced; tests/test_engine.py checks every engine path against them.

    python tests/golden_rollouts.py [FAMILY ...]   # (re)write tests/golden/*.json with the current engine
"""
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import env  # noqa: E402
import rollout  # noqa: E402
from model import load_model  # noqa: E402

GOLDEN = Path(__file__).resolve().parent / "golden"
FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "smollm2"]
# (rows, rows decoded at once): the real model is costlier, so two rows that end at different turns; the tiny
# models' six rows in four slots cover refills
ROWS = {"smollm2": (2, 2)}


def family_model(name, tokenizer):
    """A tiny random model of one family (seeded), or the real SmolLM2 in fp32."""
    from transformers import AutoConfig, AutoModelForCausalLM
    if name == "smollm2":
        return load_model("smollm2")[0]
    dims = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True,
                initializer_range=0.2)  # at the default 0.02 a tiny random model greedily repeats one token
    torch.manual_seed(0)
    config = AutoConfig.for_model(name, **dims)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


def trust_call(example, sql):
    call = json.dumps({"name": "execute_sql_query", "arguments": {"db_id": example["db_id"], "sql": sql}})
    return f"<think>I run a query.</think>\n<action>generate_sql</action>\n<tool_call>\n{call}\n</tool_call>"


def trust_answer(sql):
    return f"<think>That answers it.</think>\n<action>confirm_answer</action>\n<answer>\n{sql}\n</answer>"


def scenario(examples):
    """Per row: a scripted tool call, k greedy tokens of the model's own, then a call or an answer, then more greedy
    tokens. Rows end at different turns and lengths, so slots are refilled and the cache compacted."""
    scripts = {}
    for r, example in enumerate(examples):
        third = trust_answer("SELECT 1") if r % 2 == 0 else trust_call(example, "SELECT sql FROM sqlite_master")
        scripts[r] = [trust_call(example, f"SELECT * FROM sqlite_master LIMIT {r % 4 + 1}"), 4 + 3 * r, third, 6 + r]
    return scripts


def force_from(tokenizer, scripts):
    """force hook: a text the row emits, or an int k: the model picks k tokens of its own, then eos."""
    enc = {r: [t if isinstance(t, int) else tokenizer.encode(t, add_special_tokens=False) for t in turns]
           for r, turns in scripts.items()}

    def force(row, turn, sampled):
        script = enc[row][turn] if turn < len(enc[row]) else None
        if isinstance(script, int):
            return tokenizer.eos_token_id if len(sampled) >= script else None
        return script[len(sampled)] if script is not None and len(sampled) < len(script) else None
    return force


def golden_rollout(model, tokenizer, examples, family, **kw):
    """The scenario under continuous batching, greedy: 6 rows, 4 decoded at once (SmolLM2: 2 and 2)."""
    rows, max_rows = ROWS.get(family, (6, 4))
    batch = examples[:rows]
    return rollout.rollout(model, tokenizer, batch, "trust", group_size=1, max_turns=4, max_new_tokens=96,
                           max_total_tokens=4096, temperature=0.0, top_p=1.0, schema_mode="none", seed=0,
                           max_rows=max_rows, force=force_from(tokenizer, scenario(batch)), **kw)


def greedy_margins(model, traj):
    """Top-1 minus top-2 logit at every position the model chose itself: how close each greedy pick was to a tie."""
    ids = torch.tensor([traj.token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0].float()  # (T, V)
    top2 = logits[:-1].topk(2, dim=-1).values
    gaps = (top2[:, 0] - top2[:, 1]).tolist()
    return [gaps[i - 1] for i in range(1, len(traj.token_ids)) if traj.loss_mask[i]]


def record():
    from data.gym.prepare import ensure_gym
    torch.set_num_threads(1)
    examples = env.load_examples(ensure_gym() / "dev.jsonl")
    _, tokenizer = load_model("tiny")
    GOLDEN.mkdir(exist_ok=True)
    for name in sys.argv[1:] or FAMILIES:
        model = family_model(name, tokenizer)
        trajs = golden_rollout(model, tokenizer, examples, name)
        margin = min(min(greedy_margins(model, t)) for t in trajs)
        out = {"family": name, "min_greedy_margin": margin,
               "rows": [{"token_ids": t.token_ids, "stop_reason": t.stop_reason} for t in trajs]}
        (GOLDEN / f"{name}.json").write_text(json.dumps(out) + "\n")
        print(f"{name}: {sum(len(t.token_ids) for t in trajs)} tokens, smallest greedy margin {margin:.2e}")


if __name__ == "__main__":
    record()
