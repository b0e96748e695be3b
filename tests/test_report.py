"""report.py: the run's record, metrics.jsonl and curves.png.

    python -m pytest -q tests/test_report.py
"""
import json

import report


def test_curves_draw_a_run_with_one_rl_step(tmp_path):
    """A one-step RL run: its turns panel (no legend there) must still show that step's point."""
    from matplotlib.image import imread
    rows = [{"stage": "sft", "step": 1, "gstep": 1, "loss": 1.0}, {"stage": "sft", "step": 2, "gstep": 2, "loss": 0.5},
            {"stage": "eval", "step": 2, "gstep": 2, "dev_ex": 0.2},
            {"stage": "rl", "step": 1, "gstep": 3, "reward_full": 0.4, "ex": 0.3, "turns": 5.5}]
    assert report.plot_curves(rows, tmp_path / "curves.png")
    img = imread(tmp_path / "curves.png")[:, :, :3]  # (H, W, 3) in [0, 1]
    turns_panel = img[:, img.shape[1] * 3 // 4:]
    blue = (abs(turns_panel - [31 / 255, 119 / 255, 180 / 255]).max(-1) < 0.05).sum()  # matplotlib's first color
    assert blue > 20


def test_the_end_of_run_table_gives_intervals_and_rls_paired_gain(tmp_path, capsys):
    """Dev: 3 of 10 after SFT, 5 after RL on the same questions (two gained, none lost)."""
    sft = {i: i < 3 for i in range(10)}
    rl = {i: i < 5 for i in range(10)}
    evals = {"sft": {"dev": {"ex": 0.3, "n": 10, "turns": 3.0, "correct": sft}},
             "rl": {"dev": {"ex": 0.5, "n": 10, "turns": 3.0, "correct": rl}}}
    log = report.Logger(tmp_path, type("Args", (), {"resume": False, "wandb": False})(), 0, 0)
    report.report(tmp_path, evals, {"sft": 1.0}, log)
    out = capsys.readouterr().out
    assert "| SFT | 30.0 [11, 60] |" in out and "| SFT + RL | 50.0 [24, 76] |" in out
    stats = json.loads((tmp_path / "results.json").read_text())["intervals"]["rl_minus_sft"]["dev"]
    assert stats["gain"] == 0.2 and 0 <= stats["bootstrap_95"][0] < 0.2 < stats["bootstrap_95"][1]
