"""
The record of a train.py run: metrics.jsonl (and Weights & Biases), curves.png, and at the end the table of EX after
each stage with its intervals, the stage seconds and results.json.

    python train.py --model tiny --quick     # out/quick/: metrics.jsonl, curves.png, results.json
"""
import json

from eval import paired_bootstrap, wilson_interval

# -----------------------------------------------------------------------------
# metrics.jsonl


class Logger:
    """metrics.jsonl (+ wandb) on rank 0. On resume, the lines written after the checkpoint are dropped, so the log
    stays exact: `lines` is how many it held then (self.lines, saved in the checkpoint's state)."""

    def __init__(self, run_dir, args, rank, gstep, lines=None):
        self.on = rank == 0
        self.path = run_dir / "metrics.jsonl"
        self.wandb = None
        self.lines = 0
        if not self.on:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        old = self.path.read_text().splitlines() if self.path.exists() and args.resume else []
        if lines is None:  # a checkpoint that did not count them: the lines up to its step
            lines = sum(json.loads(line)["gstep"] <= gstep for line in old)
        kept = old[:lines]
        self.path.write_text("".join(line + "\n" for line in kept))
        self.lines = len(kept)
        if args.wandb:
            import wandb
            self.wandb = wandb.init(project="sqlrl", name=args.run_name, config=vars(args), resume="allow")

    def log(self, row):
        if self.on:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")
            self.lines += 1
            if self.wandb:
                self.wandb.log(row, step=row["gstep"])

    def rows(self):
        return [json.loads(line) for line in self.path.read_text().splitlines()] if self.path.exists() else []

# -----------------------------------------------------------------------------
# curves.png and the end of a run


def plot_curves(rows, path):
    """curves.png: SFT loss over SFT steps; the RL rollouts' reward, EX and turns over RL steps; greedy EX of the
    eval sets over global steps, the SFT -> RL switch dashed. Returns False without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    sft = [r for r in rows if r["stage"] == "sft" and "loss" in r]
    rl = [r for r in rows if r["stage"] == "rl" and "reward_full" in r]
    ev = [r for r in rows if any(k.endswith("_ex") for k in r)]
    rl_steps = [r["step"] for r in rl]
    fig, ax = plt.subplots(1, 4, figsize=(17, 3.8))
    ax[0].plot([r["step"] for r in sft], [r["loss"] for r in sft])
    ax[0].set(title="SFT", xlabel="SFT step", ylabel="masked NLL per agent token")
    # markers: a one-step RL run draws no line
    ax[1].plot(rl_steps, [r["reward_full"] for r in rl], "o-", label="reward (full track)")
    if rl and "reward_schema" in rl[0]:
        ax[1].plot(rl_steps, [r["reward_schema"] for r in rl], "o-", label="reward (schema track)")
    ax[1].plot(rl_steps, [r["ex"] for r in rl], "o-", label="EX of the rollouts")
    ax[1].set(title="RL rollouts (mean per step)", xlabel="RL step", ylabel="reward / EX")
    ax[1].legend(fontsize=8)
    for key in ("dev_ex", "test_ex", "spider_ex"):  # the evals after each stage (and every --eval-every steps)
        pts = [(r["gstep"], 100 * r[key]) for r in ev if key in r]
        if pts:
            ax[2].plot(*zip(*pts), "o-", label=key[:-3])
            for p in pts:
                ax[2].annotate(f"{p[1]:.0f}", p, textcoords="offset points", xytext=(0, 5), ha="center", fontsize=8)
    ax[2].set(title="greedy EX", xlabel="global step (SFT, then RL)", ylabel="EX (%)")
    if ev:
        ax[2].legend(fontsize=8)
    if sft and rl:
        ax[2].axvline(sft[-1]["gstep"] + 0.5, color="gray", ls="--", lw=0.8)
    ax[3].plot(rl_steps, [r["turns"] for r in rl], "o-")
    ax[3].set(title="RL rollouts", xlabel="RL step", ylabel="turns per trajectory")
    for a in ax:
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def ex_intervals(evals):
    """Per stage and eval set: EX with its 95 % Wilson interval; per set, RL - SFT on the same questions with a 95 %
    paired bootstrap interval. Fractions, as evals holds them."""
    out = {tag: {name: {"ex": e["ex"], "n": e["n"], "wilson_95": wilson_interval(round(e["ex"] * e["n"]), e["n"])}
                 for name, e in sets.items()} for tag, sets in evals.items()}
    if "sft" in evals and "rl" in evals:
        out["rl_minus_sft"] = {}
        for name, e in evals["rl"].items():
            if "correct" not in e or "correct" not in evals["sft"].get(name, {}):  # a run resumed from before them
                continue
            ids = sorted(evals["sft"][name]["correct"])
            before = [evals["sft"][name]["correct"][i] for i in ids]
            after = [e["correct"][i] for i in ids]
            gain = (sum(after) - sum(before)) / max(len(ids), 1)
            out["rl_minus_sft"][name] = {"gain": gain, "bootstrap_95": paired_bootstrap(before, after)}
    return out


def report(run_dir, evals, times, log):
    """The end of a train.py run: EX after each stage with 95 % intervals, RL's gain with a paired interval, stage
    seconds, results.json and curves.png."""
    names = list(next(iter(evals.values()), {}))
    stats = ex_intervals(evals)
    print("\n| checkpoint | " + " | ".join(f"{name} EX % [95 % CI]" for name in names) + " |\n"
          + "|---" * (1 + len(names)) + "|")
    for label, tag in [("SFT", "sft"), ("SFT + RL", "rl")]:
        if tag in evals:
            cells = [f"{100 * s['ex']:.1f} [{100 * s['wilson_95'][0]:.0f}, {100 * s['wilson_95'][1]:.0f}]"
                     for s in stats[tag].values()]
            print(f"| {label} | " + " | ".join(cells) + " |")
    for name, g in stats.get("rl_minus_sft", {}).items():
        lo, hi = g["bootstrap_95"]
        print(f"RL - SFT on {name}: {100 * g['gain']:+.1f} points (95 % paired bootstrap [{100 * lo:+.1f}, "
              f"{100 * hi:+.1f}])")
    print("seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in times.items()))
    if plot_curves(log.rows(), run_dir / "curves.png"):
        print(f"wrote {run_dir / 'curves.png'}")
    (run_dir / "results.json").write_text(json.dumps({**evals, "intervals": stats, "seconds": times}, indent=1))
    if log.wandb:
        log.wandb.finish()
