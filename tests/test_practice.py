"""The practice set: RL practises training questions the SFT policy solves sometimes, and measures them after SFT and
after RL with draws keyed by question and sample, shared with no other rollout of the run (practice.measure_practice).
A stand-in reward, "the first sampled token is even", gives the tiny random model pass rates between 0 and 1."""
import json

import numpy as np
import pytest
import torch

import engine
import rollout
import config
import practice
import train
from checkpoint import latest_checkpoint
from model import load_model
from report import practice_stats
from rewards import REWARDS

pytestmark = pytest.mark.usefixtures("one_thread")
EVEN = 2  # SmolLM2's "<|im_end|>": an even token id the forced policy answers with


def first_token_even(traj, example):
    correct = traj.token_ids[traj.prompt_len] % 2 == 0
    return {"full": float(correct), "schema": None, "correct": float(correct)}


@pytest.fixture(autouse=True)
def parity_reward(monkeypatch):
    monkeypatch.setitem(REWARDS, "parity", first_token_even)


def measure(model, tokenizer, pool, tag):
    """The practice measurement of a quick run's settings: 4 samples a question at temperature 1."""
    args = config.get_args(["--model", "tiny", "--quick", "--reward", "parity", "--practice-k", "4",
                           "--temperature", "1.0"])
    return practice.measure_practice(model, tokenizer, pool, config.rollout_config(args, args.protocol),
                                     REWARDS[args.reward], args.practice_k, batch_size=args.eval_batch_size,
                                     seed=args.seed, rank=0, world=1, tag=tag)


def test_the_same_policy_measured_twice_gains_exactly_nothing(tiny, examples):
    model, tokenizer = tiny
    pool = examples[:6]
    before, _ = measure(model, tokenizer, pool, "sft")
    after, _ = measure(model, tokenizer, pool, "rl")
    assert 0 < np.mean(list(before.values())) < 1  # the stand-in reward makes the values worth comparing
    stats = practice_stats({"sft": before, "rl": after})
    assert stats["gain"] == 0.0 and stats["bootstrap_95"] == (0.0, 0.0)


def test_a_policy_that_answers_one_question_otherwise_moves_only_that_question(tiny, examples, monkeypatch):
    """Sample j of question i draws the same numbers whichever rows decode beside it: forcing one question's first
    token changes its value and leaves every other question's exactly as it was."""
    model, tokenizer = tiny
    pool = examples[:6]
    before, _ = measure(model, tokenizer, pool, "sft")
    changed = next(ex["id"] for ex in pool if before[ex["id"]] < 1)
    plain = rollout.rollout

    def one_question_otherwise(model, tokenizer, examples, protocol, **kw):
        rows = [ex["id"] for ex in examples for _ in range(kw["group_size"])]

        def force(row, turn, sampled):
            return EVEN if rows[row] == changed and turn == 0 and not sampled else None
        return plain(model, tokenizer, examples, protocol, force=force, **kw)
    monkeypatch.setattr(rollout, "rollout", one_question_otherwise)
    after, _ = measure(model, tokenizer, pool, "rl")
    assert after[changed] == 1.0 != before[changed]
    assert {q: v for q, v in after.items() if q != changed} == {q: v for q, v in before.items() if q != changed}


def test_where_the_filter_stops_changes_no_sample(tiny, examples):
    """Looking at the candidates 2 at a time draws what one batch of all of them draws: each row's key is its running
    index, so a practice set filled early holds the questions a whole pass would have kept first."""
    model, tokenizer = tiny
    args = config.get_args(["--model", "tiny", "--quick", "--reward", "parity", "--temperature", "1.0"])
    cfg = config.rollout_config(args, args.protocol)

    def rates(size):  # a rule that keeps nothing: every pair is looked at
        return practice.difficulty_filter(model, tokenizer, examples[:8], cfg, first_token_even,
                                          practice.PoolRule(pass_rate=0.0), 2, size=size, batch_size=16,
                                          rl_batch_size=2, seed=0, reuse=False, rank=0, world=1)[1]
    whole = rates(0)
    assert 0 < np.mean(list(whole.values())) < 1
    assert rates(2) == whole and len(whole) == 8


@pytest.fixture(scope="module")
def practised(tmp_path_factory):
    """A quick run with a practice set: the filter keeps the candidates solved sometimes (2 rollouts each), RL makes two
    passes over them, 2 a step; every draw's (seed, key) recorded by stage, and the weights each measurement used."""
    tmp = tmp_path_factory.mktemp("practice")
    draws = []
    weights = {}
    uniforms = engine.uniforms
    measure_practice = practice.measure_practice

    def recording_uniforms(seed, keys, positions, device="cpu"):
        draws.append((seed, [int(k) for k in keys]))
        return uniforms(seed, keys, positions, device)

    def recording_measure(policy, tokenizer, pool, *args, tag, **kw):
        weights[tag] = policy.lm_head.weight.detach().clone()
        return measure_practice(policy, tokenizer, pool, *args, tag=tag, **kw)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(REWARDS, "parity", first_token_even)
        mp.setattr(engine, "uniforms", recording_uniforms)
        mp.setattr(practice, "measure_practice", recording_measure)
        state = train.main(["--model", "tiny", "--quick", "--reward", "parity", "--practice-k", "2", "--filter-k", "2",
                            "--group-size", "2", "--filter-limit", "16", "--filter-pass-rate", "1.0",
                            "--filter-solved-once", "--rl-epochs", "2", "--rl-lr", "1e-3", "--temperature", "1.0",
                            "--out-dir", str(tmp)])
    run = tmp / "quick"
    records = [json.loads(line) for line in (run / "rollouts.jsonl").read_text().splitlines()]
    return state, draws, weights, records, run


def test_the_practice_set_is_fixed_before_rl_disjoint_from_dev_and_test_and_practised_twice(practised, gym_dir):
    state, _, _, records, run = practised
    import env
    pool = set(state["rl_pool"])
    assert len(pool) >= 2
    assert set(state["practice"]["sft"]) == set(state["practice"]["rl"]) == pool  # measured on P, both times
    held_out = {ex["id"] for split in ("dev", "test") for ex in env.load_examples(gym_dir / f"{split}.jsonl")}
    assert not pool & held_out
    steps = {}
    for r in records:
        if r["stage"] == "rl":
            assert r["question_id"] in pool  # RL draws only from P
            steps.setdefault(r["question_id"], set()).add(r["step"])
    assert set(steps) == pool and min(len(s) for s in steps.values()) >= 2
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    filtered = next(r for r in rows if r["stage"] == "filter")
    assert filtered["filter_kept"] == len(pool)
    practice_rows = [r for r in rows if r["stage"] == "practice"]
    first_rl = next(i for i, r in enumerate(rows) if r["stage"] == "rl")
    assert rows.index(practice_rows[0]) < first_rl  # measured after the filter fixed P, before RL's first step
    results = json.loads((run / "results.json").read_text())
    assert set(results["intervals"]["practice"]["questions"]) == pool
    assert [p["pass"] for p in results["practice_passes"]] == [1, 2]


def test_the_after_side_decodes_with_the_rl_weights(practised):
    state, _, weights, _, run = practised
    final = load_model(str(latest_checkpoint(run)))[0].lm_head.weight
    assert torch.equal(weights["rl"], final)
    assert not torch.equal(weights["sft"], final)  # RL moved them (lr 1e-3)


def test_the_measurements_draws_share_no_key_with_the_filters_or_rls(practised):
    state, draws, _, records, _ = practised
    measured_draws = set()
    other = set()
    for seed, keys in draws:
        live = [k for k in keys if k != -1]  # -1: an idle row's draw, never used
        on_practice = [k >= practice.PRACTICE_KEYS for k in live]
        assert all(on_practice) or not any(on_practice)
        (measured_draws if all(on_practice) and live else other).update((seed, k) for k in live)
    assert measured_draws and other and not measured_draws & other
    measured = [r for r in records if r["stage"] == "practice"]
    assert len(measured) == 2 * 2 * len(state["rl_pool"])  # k samples of every question, after SFT and after RL
    assert len(measured_draws) == 2 * len(state["rl_pool"])  # the same keys both times
