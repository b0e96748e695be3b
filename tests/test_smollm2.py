"""Short checks on the real model, SmolLM2-135M-Instruct (fetched once into ~/.cache/sqlrl): a 2-turn rollout is
token-in/token-out against its chat template and replays its own log-probs, and one GRPO step moves the weights the
way the advantages say and writes a checkpoint that a bare from_pretrained loads. Both speak the demo's protocol
(config.DEMO: the short system prompt, 40 observation rows)."""
import json

import pytest
import torch

import env
import protocols
import rollout
import config
from grpo import GRPOConfig, build_batch, grpo_step, token_logprobs
from checkpoint import save_checkpoint
from model import load_model, make_optimizer, resolve_dtype
from rewards import REWARDS


@pytest.fixture(scope="module")
def smol():
    return load_model("smollm2")  # fp32: the replay tolerance below is for fp32 numerics


def forced(tokenizer, scripts):
    """force hook: scripts[row][turn] is a text the row emits, or an int k: the model samples k tokens, then eos."""
    enc = {r: [t if isinstance(t, int) else tokenizer.encode(t, add_special_tokens=False) for t in turns]
           for r, turns in scripts.items()}

    def force(row, turn, sampled):
        script = enc[row][turn]
        if isinstance(script, int):
            return tokenizer.eos_token_id if len(sampled) >= script else None
        return script[len(sampled)] if len(sampled) < len(script) else None
    return force


def trust_turn(example, sql, answer=False):
    if answer:
        return f"<think>Done.</think>\n<action>confirm_answer</action>\n<answer>\n{sql}\n</answer>"
    call = json.dumps({"name": "execute_sql_query", "arguments": {"db_id": example["db_id"], "sql": sql}})
    return f"<think>Which tables?</think>\n<action>explore_schema</action>\n<tool_call>\n{call}\n</tool_call>"


def demo_protocol():
    return protocols.protocol_variant("trust", config.DEMO["brief_prompt"], config.DEMO["obs_rows"])


def test_two_turn_rollout_is_its_chat_template_and_replays(smol, examples):
    model, tokenizer = smol
    name = demo_protocol()
    proto = protocols.PROTOCOLS[name]
    batch = examples[:2]
    # turn 0: a scripted tool call (real observation); turn 1: SmolLM2 samples 16 tokens of its own, then eos
    scripts = {r: [trust_turn(ex, "SELECT name FROM sqlite_master WHERE type = 'table'"), 16]
               for r, ex in enumerate(batch)}
    trajs = rollout.rollout(model, tokenizer, batch, name, group_size=1, max_turns=2, max_new_tokens=128,
                            max_total_tokens=4096, temperature=0.8, top_p=1.0, schema_mode="none", seed=0,
                            force=forced(tokenizer, scripts))
    for traj, ex in zip(trajs, batch):
        assert traj.num_turns == 2 and traj.num_tool_calls == 1
        # the same conversation through SmolLM2's chat template, observations from a fresh episode
        episode = env.new_episode(ex, proto, 2)
        messages = proto.build_messages(ex, "none", 2)
        turn_tokens = {}
        for i, t in enumerate(traj.turn_ids):
            if traj.loss_mask[i]:
                turn_tokens.setdefault(t, []).append(traj.token_ids[i])
        for t in sorted(turn_tokens):
            text = tokenizer.decode(turn_tokens[t], skip_special_tokens=True)
            observation, done = env.step(episode, text)
            messages.append({"role": "assistant", "content": text})
            if not done:
                messages.append({"role": proto.obs_role, "content": observation})
        assert "rows" in messages[3]["content"] or "name" in messages[3]["content"]  # the table list came back
        assert traj.token_ids == rollout.render_ids(tokenizer, messages, False)
        # replay: a plain forward over the final ids gives the recorded log-prob of every sampled token
        mask = torch.tensor(traj.loss_mask, dtype=torch.bool)
        ids = torch.tensor([traj.token_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits.float() / 0.8, dim=-1)[0]  # (T, V)
        replay = torch.zeros(len(traj.token_ids))
        replay[1:] = logp[:-1].gather(1, ids[0, 1:, None]).squeeze(1)
        assert torch.allclose(replay[mask], torch.tensor(traj.sample_logprobs)[mask], atol=2e-3, rtol=0)


def test_one_grpo_step_moves_smollm2_along_the_advantage_and_saves_a_plain_checkpoint(smol, examples, tmp_path):
    import copy

    from transformers import AutoModelForCausalLM
    _, tokenizer = smol
    model = copy.deepcopy(smol[0])  # the module fixture stays the pretrained model
    ex = examples[0]
    # one group of 2: the first commits the gold SQL, the second a wrong one; the real trust reward scores them
    scripts = {0: [trust_turn(ex, ex["gold_sql"], answer=True)], 1: [trust_turn(ex, "SELECT 1", answer=True)]}
    trajs = rollout.rollout(model, tokenizer, [ex], demo_protocol(), group_size=2, max_turns=1, max_new_tokens=200,
                            max_total_tokens=4096, temperature=1.0, top_p=1.0, schema_mode="none", seed=0,
                            force=forced(tokenizer, scripts))
    rewards = [REWARDS["trust"](t, ex) for t in trajs]
    assert rewards[0]["correct"] and not rewards[1]["correct"] and rewards[0]["full"] > rewards[1]["full"]

    args = config.get_args(["--preset", "demo", "--rl-lr", "1e-5", "--rl-steps", "1", "--warmup-ratio", "0"])
    opt, sched = make_optimizer(model, args.rl_lr, args.rl_steps, args.weight_decay, args.warmup_ratio)
    batch = build_batch(trajs, tokenizer.pad_token_id)
    mask = batch["loss_mask"].bool()

    def mean_logp():  # (2,) mean log-prob of each trajectory's own sampled tokens
        with torch.no_grad():
            logp, _ = token_logprobs(model, batch["input_ids"], batch["loss_mask"])
        return (logp * mask).sum(1) / mask.sum(1)

    before = mean_logp()
    model.train()
    bf16 = resolve_dtype("auto", "cpu") == "bf16"  # the demo's update: bf16 autocast where this CPU is fast in it
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        cfg = GRPOConfig(group_size=2, schema_lambda=0.25, pad_id=tokenizer.pad_token_id)
        grpo_step(model, opt, trajs, rewards, cfg)
    model.eval()
    after = mean_logp()
    assert after[0] > before[0] and after[1] < before[1]  # the correct answer up, the wrong one down

    ckpt = save_checkpoint(tmp_path, 1, model, tokenizer, opt, sched, {"stage": "rl", "step": 1}, args, 0, 1)
    loaded = AutoModelForCausalLM.from_pretrained(ckpt)  # a bare from_pretrained
    pretrained = smol[0].state_dict()
    saved = loaded.state_dict()
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())  # the update, exactly
    assert sum(not torch.equal(saved[k], pretrained[k]) for k in pretrained) > 100  # most tensors moved
