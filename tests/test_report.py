"""report.py: the run's record, metrics.jsonl and curves.png.

    python -m pytest -q tests/test_report.py
"""
import report


def test_curves_draw_a_run_with_one_rl_step(tmp_path):
    """The demo's RL is a single step: its turns panel (no legend there) must still show that step's point."""
    from matplotlib.image import imread
    rows = [{"stage": "sft", "gstep": 1, "loss": 1.0}, {"stage": "sft", "gstep": 2, "loss": 0.5},
            {"stage": "eval", "gstep": 2, "dev_ex": 0.2},
            {"stage": "rl", "gstep": 3, "reward_full": 0.4, "ex": 0.3, "turns": 5.5}]
    assert report.plot_curves(rows, tmp_path / "curves.png")
    img = imread(tmp_path / "curves.png")[:, :, :3]  # (H, W, 3) in [0, 1]
    turns_panel = img[:, img.shape[1] * 3 // 4:]
    blue = (abs(turns_panel - [31 / 255, 119 / 255, 180 / 255]).max(-1) < 0.05).sum()  # matplotlib's first color
    assert blue > 20
