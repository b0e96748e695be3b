"""
The record of a train.py run: metrics.jsonl (and Weights & Biases), rollouts.jsonl (the agent's own trajectories),
curves.png, and at the end the table of EX after each stage with its intervals, the practice set's pass@1 before and
after RL, the stage seconds and results.json.

    python train.py --model tiny --quick     # out/quick/: metrics.jsonl, rollouts.jsonl, curves.png, results.json
    python report.py out/quick               # its summary again, and curves.png redrawn
"""
import json
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from cli import ArgumentParser, UserError, run
from eval import paired_bootstrap, wilson_interval

# -----------------------------------------------------------------------------
# metrics.jsonl


class Logger:
    """metrics.jsonl (+ wandb) and rollouts.jsonl, the agent's own trajectories, on rank 0. On resume, the lines
    written after the checkpoint are dropped, so both stay exact: `lines` and `rollout_lines` are how many each held
    then (saved in the checkpoint's state)."""

    def __init__(self, run_dir, args, rank, gstep, lines=None, rollout_lines=None):
        self.on = rank == 0
        self.path = run_dir / "metrics.jsonl"
        self.rollouts_path = run_dir / "rollouts.jsonl"
        self.wandb = None
        self.lines = 0
        self.rollout_lines = 0
        if not self.on:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        self.lines = cut_log(self.path, args.resume, lines, gstep)
        self.rollout_lines = cut_log(self.rollouts_path, args.resume, rollout_lines, gstep)
        if args.wandb:  # a resumed run continues its W&B run: the id is kept in the run folder
            import wandb
            id_file = run_dir / "wandb_id"
            run_id = id_file.read_text().strip() if args.resume and id_file.exists() else wandb.util.generate_id()
            id_file.write_text(run_id + "\n")
            self.wandb = wandb.init(project="sqlrl", name=args.run_name, config=vars(args), id=run_id, resume="allow")

    def log(self, row):
        if self.on:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")
            self.lines += 1
            if self.wandb:
                self.wandb.log(row, step=row["gstep"])

    def rollouts(self, records):
        """Append trajectory records (trajectory_record) to rollouts.jsonl."""
        if self.on:
            with open(self.rollouts_path, "a") as f:
                f.writelines(json.dumps(r) + "\n" for r in records)
            self.rollout_lines += len(records)

    def counts(self):
        """The lines each log holds, for a checkpoint's state."""
        return {"log_lines": self.lines, "rollout_lines": self.rollout_lines}

    def finish(self):
        if self.wandb:
            self.wandb.finish()


@contextmanager
def timed(times, name):
    """Adds the seconds of the block to times[name] (the report's stage seconds)."""
    t0 = time.perf_counter()
    yield
    times[name] = times.get(name, 0.0) + time.perf_counter() - t0


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def cut_log(path, resume, lines, gstep):
    """Keep a log's first `lines` lines on resume (a checkpoint that did not count them: those up to its step), none on
    a fresh run; returns how many it holds."""
    old = path.read_text().splitlines() if path.exists() and resume else []
    if lines is None:
        lines = sum(json.loads(line)["gstep"] <= gstep for line in old)
    kept = old[:lines]
    path.write_text("".join(line + "\n" for line in kept))
    return len(kept)


def trajectory_record(traj, reward, tokenizer, **tags):
    """One line of rollouts.jsonl: the tags (stage, step, ...), the question, each turn's sampled text with its SQL
    and what the environment answered, the reward's parts and the stop reason."""
    turns = []
    for t in range(traj.num_turns):
        sampled = [i for i, m, turn in zip(traj.token_ids, traj.loss_mask, traj.turn_ids) if m and turn == t]
        action = traj.episode.actions[t] if t < len(traj.episode.actions) else None
        turns.append({"text": tokenizer.decode(sampled, skip_special_tokens=True),
                      "sql": action.sql if action is not None else None,
                      "observation": traj.observations[t] if t < len(traj.observations) else None})
    parts = {k: v for k, v in reward.items() if isinstance(v, (int, float, bool)) or v is None}
    return {**tags, "question_id": traj.example["id"], "question": traj.example["question"], "turns": turns,
            "reward": parts, "correct": bool(reward["correct"]), "stop_reason": traj.stop_reason}

# -----------------------------------------------------------------------------
# curves.png and the end of a run


def practice_passes(records):
    """Per pass over the practice set: the mean over its questions of each one's EX and reward at its p-th visit by
    RL, so every point covers the same questions; `reused` marks a pass holding the filter's own rollouts."""
    visits = {}  # question -> step -> its records there
    for r in records:
        if r["stage"] == "rl":
            visits.setdefault(r["question_id"], {}).setdefault(r["step"], []).append(r)
    passes = min((len(steps) for steps in visits.values()), default=0)
    out = []
    for p in range(passes):
        at_visit = [steps[sorted(steps)[p]] for steps in visits.values()]  # one list of records per question
        out.append({"pass": p + 1, "questions": len(at_visit),
                    "ex": mean([mean([r["correct"] for r in recs]) for recs in at_visit]),
                    "reward": mean([mean([r["reward"]["full"] for r in recs]) for recs in at_visit]),
                    "reused": any(r.get("reused_filter_draws") for recs in at_visit for r in recs)})
    return out


def mean(values):
    return sum(values) / len(values) if values else 0.0


def plot_curves(rows, passes, before_after, path, per_question=None):
    """curves.png, two rows of three: SFT loss; the RL rollouts' reward and EX per step, and per pass over the practice
    set (a hollow marker where a point holds the filter's own rollouts); before and after RL, the practice set's pass@1
    and the eval sets' greedy EX with 95 % intervals; each practice question's pass@1 after SFT against after RL
    (per_question: {id: {"sft": v, "rl": v}}); turns per RL trajectory. Returns False without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    colour = {"reward": "C0", "ex": "C1", "schema": "C2", "sft": "C0", "rl": "C1"}  # one meaning per colour
    sft = [r for r in rows if r["stage"] == "sft" and "loss" in r]
    rl = [r for r in rows if r["stage"] == "rl" and "reward_full" in r]
    rl_steps = [r["step"] for r in rl]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    ax = axes.flat
    ax[0].plot([r["step"] for r in sft], [r["loss"] for r in sft])
    ax[0].set(title="SFT: loss on the teacher's trajectories", xlabel="SFT step", ylabel="masked NLL per agent token")
    # markers: a one-step RL run draws no line
    ax[1].plot(rl_steps, [r["reward_full"] for r in rl], "o-", color=colour["reward"], label="reward (full track)")
    if rl and "reward_schema" in rl[0]:
        ax[1].plot(rl_steps, [r["reward_schema"] for r in rl], "o-", color=colour["schema"],
                   label="reward (schema track)")
    ax[1].plot(rl_steps, [r["ex"] for r in rl], "o-", color=colour["ex"], label="EX")
    for r in rl:
        if r.get("reused_filter_draws"):
            ax[1].plot(r["step"], r["ex"], "o", mfc="white", color=colour["ex"])
    ax[1].set(title="RL rollouts per step (other questions each step)", xlabel="RL step", ylabel="mean reward / EX")
    ax[1].legend(fontsize=8, title="hollow: the filter's own rollouts", title_fontsize=7)
    for key, label in (("reward", "reward"), ("ex", "EX")):
        ax[2].plot([p["pass"] for p in passes], [p[key] for p in passes], "o-", color=colour[key], label=label)
        for p in passes:
            if p["reused"]:
                ax[2].plot(p["pass"], p[key], "o", mfc="white", color=colour[key])
    n = passes[0]["questions"] if passes else 0
    ax[2].set(title=f"RL rollouts per pass over the {n} practice questions", xlabel="pass over the practice set",
              ylabel="mean reward / EX")
    if passes:
        ax[2].set_xticks([p["pass"] for p in passes])
        ax[2].legend(fontsize=8, title="hollow: holds the filter's rollouts", title_fontsize=7)
    for i, (name, sides) in enumerate(before_after.items()):
        for j, (side, (value, low, high)) in enumerate(sides.items()):
            x = i + (j - 0.5) * 0.35
            label = f"after {side.upper()}" if i == 0 else None
            ax[3].bar(x, value, 0.35, color=colour.get(side, f"C{j}"), label=label)
            ax[3].errorbar(x, value, [[value - low], [high - value]], color="black", capsize=3)
    ax[3].set_xticks(range(len(before_after)), list(before_after))
    ax[3].set(title="after SFT and after RL (95 % intervals)", ylabel="practice pass@1 / greedy EX")
    if before_after:
        ax[3].legend(fontsize=8)
    counts = {}  # (sft, rl) -> how many questions sit there: pass@1 takes few values
    for q in (per_question or {}).values():
        counts[(q["sft"], q["rl"])] = counts.get((q["sft"], q["rl"]), 0) + 1
    for (x, y), count in counts.items():
        ax[4].scatter(x, y, s=60 * count, color="C2" if y > x else "C3" if y < x else "gray", alpha=0.6)
        ax[4].annotate(str(count), (x, y), ha="center", va="center", fontsize=8)
    ax[4].plot([0, 1], [0, 1], color="gray", lw=0.8)
    ax[4].set(title="each practice question: above the line, RL helped", xlabel="pass@1 after SFT",
              ylabel="pass@1 after RL", xlim=(-0.05, 1.05), ylim=(-0.05, 1.05))
    ax[5].plot(rl_steps, [r["turns"] for r in rl], "o-")
    ax[5].set(title="RL rollouts: turns per trajectory", xlabel="RL step", ylabel="turns")
    for a in ax:
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def practice_stats(practice):
    """The practice set's pass@1 after SFT and after RL, each with a normal 95 % interval over questions, and RL - SFT
    with a 95 % paired bootstrap interval over questions; per question, both values."""
    ids = sorted(practice["sft"])
    before = [practice["sft"][i] for i in ids]
    after = [practice["rl"][i] for i in ids]
    sides = {}
    for tag, values in (("sft", before), ("rl", after)):
        spread = 1.96 * float(np.std(values, ddof=1) / np.sqrt(len(values))) if len(values) > 1 else 0.0
        sides[tag] = {"pass1": mean(values), "normal_95": (mean(values) - spread, mean(values) + spread)}
    return {"n": len(ids), **sides, "gain": mean(after) - mean(before), "bootstrap_95": paired_bootstrap(before, after),
            "questions": {i: {"sft": b, "rl": a} for i, b, a in zip(ids, before, after)}}


def turned_around(records, stats, width=110):
    """Lines showing one practice question RL turned from mostly wrong to mostly right: its question, and a wrong
    sample after SFT and a right one after RL, turn by turn (SQL, then the first line of what the database said)."""
    moved = [(q["rl"] - q["sft"], i) for i, q in stats["questions"].items() if q["sft"] < 0.5 < q["rl"]]
    if not moved:
        return []
    question = max(moved)[1]
    mine = [r for r in records if r["stage"] == "practice" and r["question_id"] == question]
    wrong = next((r for r in mine if r["after"] == "sft" and not r["correct"]), None)
    right = next((r for r in mine if r["after"] == "rl" and r["correct"]), None)
    if wrong is None or right is None:  # a log that lacks the samples (a run resumed from an older checkpoint)
        return []
    q = stats["questions"][question]
    lines = [f"a practice question RL turned around (pass@1 {q['sft']:.2f} -> {q['rl']:.2f}): {wrong['question']}"]
    for label, record in (("after SFT, wrong", wrong), ("after RL, right", right)):
        lines.append(f"  {label}:")
        for t, turn in enumerate(record["turns"], 1):
            said = " ".join((turn["sql"] or turn["text"]).split())
            lines.append(f"    {t}. {said}"[:width])
            if turn["observation"]:
                lines.append(f"       -> {turn['observation'].strip().splitlines()[0]}"[:width])
    return lines


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


def report(run_dir, evals, times, practice=None):
    """The end of a train.py run, from its evaluations and the logs in run_dir: EX after each stage with 95 %
    intervals, RL's gain with a paired interval, the practice set's pass@1 before and after RL with its paired
    interval and one question RL turned around, stage seconds, results.json and curves.png."""
    records = read_jsonl(run_dir / "rollouts.jsonl")
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
    before_after = {}
    if practice and "sft" in practice and "rl" in practice:
        stats["practice"] = practice_stats(practice)
        p = stats["practice"]
        lo, hi = p["bootstrap_95"]
        print(f"practice set ({p['n']} training questions RL practised): pass@1 {p['sft']['pass1']:.2f} after SFT, "
              f"{p['rl']['pass1']:.2f} after RL; RL - SFT {p['gain']:+.2f} (95 % paired bootstrap [{lo:+.2f}, "
              f"{hi:+.2f}])")
        for line in turned_around(records, p):
            print(line)
        before_after["practice"] = {tag: (p[tag]["pass1"], *p[tag]["normal_95"]) for tag in ("sft", "rl")}
    for name in names:
        if all(tag in stats and name in stats[tag] for tag in ("sft", "rl")):
            ex = {tag: stats[tag][name] for tag in ("sft", "rl")}
            before_after[name] = {tag: (ex[tag]["ex"], *ex[tag]["wilson_95"]) for tag in ex}
    print("seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in times.items()))
    passes = practice_passes(records)
    per_question = stats["practice"]["questions"] if "practice" in stats else None
    if plot_curves(read_jsonl(run_dir / "metrics.jsonl"), passes, before_after, run_dir / "curves.png", per_question):
        print(f"wrote {run_dir / 'curves.png'}")
    results = {**evals, "intervals": stats, "practice_passes": passes, "seconds": times}
    (run_dir / "results.json").write_text(json.dumps(results, indent=1))


def saved_report(run_dir):
    """report()'s arguments from a finished run's results.json: `python report.py RUN_DIR` prints the run's summary
    again and redraws its curves.png."""
    path = Path(run_dir) / "results.json"
    if not path.is_file():
        raise UserError(f"{path} does not exist: give a train.py run folder that finished (out/<run-name>)")
    results = json.loads(path.read_text())
    evals = {tag: results[tag] for tag in ("sft", "rl") if tag in results}
    questions = results["intervals"].get("practice", {}).get("questions", {})
    practice = {tag: {q: v[tag] for q, v in questions.items()} for tag in ("sft", "rl")} if questions else None
    return Path(run_dir), evals, results["seconds"], practice

# -----------------------------------------------------------------------------
# python report.py RUN_DIR


def main(argv=None):
    parser = ArgumentParser(description=__doc__)
    parser.add_argument("run_dir", help="a finished train.py run's folder, e.g. out/demo")
    report(*saved_report(parser.parse_args(argv).run_dir))


if __name__ == "__main__":
    run(main)
