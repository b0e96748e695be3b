"""
BIRD as distributed -> sqlrl JSONL. Keeps BIRD's own difficulty (simple/moderate/challenging) and its evidence.
Also home of BIRD's official-scorer conventions that eval.py uses: VES and R-VES as evaluation_ves.py computes them,
and the prediction file its scorers read.

    python data/bird/prepare.py --bird-dir ~/bird/dev              # dev.json + dev_databases/ -> data/bird/dev.jsonl
    python data/bird/prepare.py --bird-dir ~/bird/train --split train --out /tmp/bird
"""
import json
import os
import platform
import sqlite3
import sys
import time
from pathlib import Path

import numpy as np

if __name__ == "__main__":  # run as a script: make `data.*` importable like from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from data.spider.prepare import db_file, finish, iter_json_array, make_record, require, write_gold_sql

HERE = Path(__file__).resolve().parent

# -----------------------------------------------------------------------------


def load_bird(bird_dir, split="dev", db_dir=None):
    """Read <bird_dir>/<split>.json and <bird_dir>/<split>_databases/ -> (records, skipped)."""
    bird_dir = require(bird_dir, "BIRD folder", "Pass --bird-dir pointing at the unzipped BIRD dev (or train) release.")
    split_path = require(bird_dir / f"{split}.json", "BIRD split file", "Use --split dev or --split train.")
    db_dir = require(db_dir or bird_dir / f"{split}_databases", "BIRD database folder",
                     f"Unzip {split}_databases.zip inside --bird-dir, or pass --db-dir.")
    records = []
    skipped = []
    for i, ex in enumerate(iter_json_array(split_path)):
        missing = [k for k in ("db_id", "question", "SQL") if k not in ex]
        if missing:
            raise ValueError(f"{split_path}: example {i} lacks {missing}; is this a BIRD-format file?")
        path = db_file(db_dir, ex["db_id"])
        if not path.exists():
            skipped.append(dict(db_id=ex["db_id"], question=ex["question"], reason="database missing"))
            continue
        qid = ex.get("question_id", i)
        records.append(make_record(f"bird-{split}-{qid}", ex["db_id"], path, ex["question"], ex["SQL"],
                                   ex.get("difficulty", "unknown"), "bird", evidence=ex.get("evidence", "")))
    return records, skipped


# -----------------------------------------------------------------------------
# BIRD's valid efficiency score (evaluation_ves.py): each correct prediction and its gold run `runs` times, one query
# at a time; the ratios gold time / pred time, outliers dropped, are averaged; VES = 100 x the mean over questions of
# sqrt(ratio), a wrong answer counting 0. R-VES (BIRD mini-dev) buckets the ratio first. A timing: compare it only
# between runs on one machine (eval.py's summary names it).


def time_ratio(ratios) -> float:
    """clean_abnormal + mean: the ratios strictly inside mean +- 3 std, averaged. When all are equal none is inside,
    and the official division by zero scores 0."""
    r = np.asarray(ratios, dtype=float)
    kept = r[(r > r.mean() - 3 * r.std()) & (r < r.mean() + 3 * r.std())]
    return float(kept.mean()) if kept.size else 0.0


def r_ves_reward(ratio: float) -> float:
    """R-VES reward of a time ratio: >=2 -> 1.25, >=1 -> 1, >=0.5 -> 0.75, >=0.25 -> 0.5, >0 -> 0.25, 0 -> 0."""
    return next((r for bound, r in ((2, 1.25), (1, 1.0), (0.5, 0.75), (0.25, 0.5)) if ratio >= bound),
                0.25 if ratio > 0 else 0.0)


def bird_ves(examples: list[dict], sqls: list, correct: list[bool], runs=100, timeout_s=30.0) -> list[tuple]:
    """(sqrt(time ratio), sqrt(R-VES reward)) per question. Each run times one cursor.execute (which steps to the
    first row) on a fresh read-only connection opened outside the timer, pred then gold, as the official loop. A
    question gets timeout_s x runs in all (meta_time_out x iterate_num); past it, or on an error, it scores 0."""
    def seconds(db_path, sql, deadline):
        con = sqlite3.connect(f"{Path(db_path).resolve().as_uri()}?mode=ro", uri=True)
        con.set_progress_handler(lambda: time.monotonic() > deadline, 10_000)  # past the deadline: interrupted
        try:
            t0 = time.perf_counter()
            con.execute(sql)
            return time.perf_counter() - t0
        finally:
            con.close()
    out = []
    for ex, sql, ok in zip(examples, sqls, correct):
        ratios = []
        deadline = time.monotonic() + timeout_s * runs
        try:
            for _ in range(runs if ok else 0):
                pred_s = seconds(ex["db_path"], sql, deadline)
                ratios.append(seconds(ex["db_path"], ex["gold_sql"], deadline) / pred_s)
        except (sqlite3.Error, ZeroDivisionError):
            ratios = []
        ratio = time_ratio(ratios) if ratios else 0.0
        out.append((ratio ** 0.5, r_ves_reward(ratio) ** 0.5))
    return out


def machine() -> str:
    """The CPU and OS a timing was taken on."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    cpu = next((l.split(":", 1)[1].strip() for l in info.splitlines() if l.startswith("model name")), None)
    return f"{cpu or platform.processor() or platform.machine()}, {os.cpu_count()} cores, {platform.platform()}"


# -----------------------------------------------------------------------------
# the prediction file BIRD's evaluation.py and evaluation_ves.py read


def question_id(example: dict) -> str:
    """BIRD's question_id, kept by load_bird as the end of the id ("bird-dev-1034" -> "1034")."""
    tail = str(example["id"]).rsplit("-", 1)[-1]
    return str(int(tail)) if tail.isdigit() else str(example["id"])


def write_bird_predictions(path, examples: list[dict], sqls: list) -> None:
    """BIRD's prediction file {"<question_id>": "SQL\\t----- bird -----\\t<db_id>"}, and beside it the gold file
    of exactly these questions (predict_dev.json -> dev_gold.sql), since evaluation.py pairs the two by position.
    A missing SQL is written as an empty string, which the evaluator scores as wrong."""
    preds = {question_id(ex): f"{sql or ''}\t----- bird -----\t{ex['db_id']}" for ex, sql in zip(examples, sqls)}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(preds, f, indent=4)
    write_gold_sql(Path(path).with_name(Path(path).stem.removeprefix("predict_") + "_gold.sql"), examples)


if __name__ == "__main__":
    from cli import ArgumentParser, die
    parser = ArgumentParser(description=__doc__)
    parser.add_argument("--bird-dir", type=Path, required=True, help="folder with <split>.json and <split>_databases/")
    parser.add_argument("--split", default="dev", help="dev or train (default dev)")
    parser.add_argument("--db-dir", type=Path, default=None, help="databases (default <bird-dir>/<split>_databases)")
    parser.add_argument("--out", type=Path, default=HERE, help="output folder (default: beside this script)")
    parser.add_argument("--skip-check", action="store_true", help="do not execute the gold queries")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per gold query when checking")
    args = parser.parse_args()
    try:
        records, skipped = load_bird(args.bird_dir, args.split, args.db_dir)
    except (FileNotFoundError, ValueError) as e:
        die(e)
    finish("bird", records, skipped, args.out / f"{args.split}.jsonl", check=not args.skip_check,
           timeout_s=args.timeout)
