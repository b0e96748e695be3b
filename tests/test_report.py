"""report.py: the run's record, metrics.jsonl, rollouts.jsonl, curves.png and the end-of-run summary.

    python -m pytest -q tests/test_report.py
"""
import json

import pytest

import report
from cli import UserError


def test_curves_draw_a_run_with_one_rl_step(tmp_path):
    """A one-step RL run: its turns panel (no legend there) must still show that step's point."""
    from matplotlib.image import imread
    rows = [{"stage": "sft", "step": 1, "gstep": 1, "loss": 1.0}, {"stage": "sft", "step": 2, "gstep": 2, "loss": 0.5},
            {"stage": "eval", "step": 2, "gstep": 2, "dev_ex": 0.2},
            {"stage": "rl", "step": 1, "gstep": 3, "reward_full": 0.4, "ex": 0.3, "turns": 5.5}]
    assert report.plot_curves(rows, [], {}, tmp_path / "curves.png")
    img = imread(tmp_path / "curves.png")[:, :, :3]  # (H, W, 3) in [0, 1]
    turns_panel = img[img.shape[0] // 2:, img.shape[1] * 2 // 3:]  # bottom right
    blue = (abs(turns_panel - [31 / 255, 119 / 255, 180 / 255]).max(-1) < 0.05).sum()  # matplotlib's first color
    assert blue > 20


def test_the_end_of_run_table_gives_intervals_and_rls_paired_gain(tmp_path, capsys):
    """Dev: 3 of 10 after SFT, 5 after RL on the same questions (two gained, none lost)."""
    sft = {i: i < 3 for i in range(10)}
    rl = {i: i < 5 for i in range(10)}
    evals = {"sft": {"dev": {"ex": 0.3, "n": 10, "turns": 3.0, "correct": sft}},
             "rl": {"dev": {"ex": 0.5, "n": 10, "turns": 3.0, "correct": rl}}}
    report.report(tmp_path, evals, {"sft": 1.0})
    out = capsys.readouterr().out
    assert "| SFT | 30.0 [11, 60] |" in out and "| SFT + RL | 50.0 [24, 76] |" in out
    stats = json.loads((tmp_path / "results.json").read_text())["intervals"]["rl_minus_sft"]["dev"]
    assert stats["gain"] == 0.2 and 0 <= stats["bootstrap_95"][0] < 0.2 < stats["bootstrap_95"][1]


def practice_record(question, after, sample, correct, step=None):
    turn = {"text": "...", "sql": f"SELECT {sample} FROM t", "observation": "Result (1 row):\nx\nYou have 3 turns left"}
    stage = {"stage": "rl", "step": step} if step else {"stage": "practice", "after": after}
    return {**stage, "sample": sample, "gstep": 1, "question_id": question, "question": f"Q {question}?",
            "turns": [turn], "reward": {"full": float(correct)}, "correct": correct, "stop_reason": "answer"}


def test_the_practice_summary_gives_its_paired_gain_and_a_question_rl_turned_around(tmp_path, capsys):
    """Practice questions a, b, c at 4 samples: a goes 1/4 -> 4/4, b stays 2/4, c goes 2/4 -> 1/4; mean +0.17."""
    log = report.Logger(tmp_path, type("Args", (), {"resume": False, "wandb": False})(), 0, 0)
    right = {("a", "sft"): 1, ("a", "rl"): 4, ("b", "sft"): 2, ("b", "rl"): 2, ("c", "sft"): 2, ("c", "rl"): 1}
    log.rollouts([practice_record(q, tag, j, j < n) for (q, tag), n in right.items() for j in range(4)])
    log.rollouts([practice_record(q, None, 0, q == "a" or step == 2, step) for step in (1, 2) for q in "abc"])
    practice = {tag: {q: right[(q, tag)] / 4 for q in "abc"} for tag in ("sft", "rl")}
    report.report(tmp_path, {}, {}, practice)
    out = capsys.readouterr().out
    assert "practice set (3 training questions RL practised): pass@1 0.42 after SFT, 0.58 after RL; RL - SFT +0.17" \
        in out
    assert "a practice question RL turned around (pass@1 0.25 -> 1.00): Q a?" in out
    assert "after SFT, wrong:\n    1. SELECT 1 FROM t\n       -> Result (1 row):" in out  # sample 0 was right
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["intervals"]["practice"]["questions"]["c"] == {"sft": 0.5, "rl": 0.25}
    assert [round(p["ex"], 2) for p in results["practice_passes"]] == [0.33, 1.0]  # every question at each visit
    assert (tmp_path / "curves.png").exists()
    (tmp_path / "curves.png").unlink()
    report.report(*report.saved_report(tmp_path))  # python report.py RUN_DIR: the same summary from the saved run
    assert capsys.readouterr().out == out
    assert json.loads((tmp_path / "results.json").read_text()) == results and (tmp_path / "curves.png").exists()


def test_report_py_needs_a_finished_run(tmp_path):
    with pytest.raises(UserError, match="does not exist: give a train.py run folder that finished"):
        report.saved_report(tmp_path)


def test_a_resumed_run_logs_to_the_same_wandb_run(tmp_path, monkeypatch):
    import sys
    from types import SimpleNamespace
    started = []
    ids = iter(["first", "second"])
    fake = SimpleNamespace(init=lambda **kw: started.append(kw) or SimpleNamespace(log=print),
                           util=SimpleNamespace(generate_id=lambda: next(ids)))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    for resume in (False, True):
        args = SimpleNamespace(resume=resume, wandb=True, run_name="r")
        report.Logger(tmp_path, args, 0, 0)
    assert [kw["id"] for kw in started] == ["first", "first"]
    report.Logger(tmp_path, SimpleNamespace(resume=False, wandb=True, run_name="r"), 0, 0)  # a new run: a new id
    assert started[-1]["id"] == "second"
