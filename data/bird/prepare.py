"""
BIRD as distributed -> sqlrl JSONL. Keeps BIRD's own difficulty (simple/moderate/challenging) and its evidence.

    python data/bird/prepare.py --bird-dir ~/bird/dev              # dev.json + dev_databases/ -> data/bird/dev.jsonl
    python data/bird/prepare.py --bird-dir ~/bird/train --split train --out /tmp/bird
"""
import argparse
import sys
from pathlib import Path

if __name__ == "__main__":  # run as a script: make `data.*` importable like from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from data.spider.prepare import db_file, finish, iter_json_array, make_record, require

HERE = Path(__file__).resolve().parent

# -----------------------------------------------------------------------------


def load_bird(bird_dir, split="dev", db_dir=None):
    """Read <bird_dir>/<split>.json and <bird_dir>/<split>_databases/ -> (records, skipped)."""
    bird_dir = require(bird_dir, "BIRD folder", "Pass --bird-dir pointing at the unzipped BIRD dev (or train) release.")
    split_path = require(bird_dir / f"{split}.json", "BIRD split file", "Use --split dev or --split train.")
    db_dir = require(db_dir or bird_dir / f"{split}_databases", "BIRD database folder",
                     f"Unzip {split}_databases.zip inside --bird-dir, or pass --db-dir.")
    records, skipped = [], []
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


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
        sys.exit(f"error: {e}")
    finish("bird", records, skipped, args.out / f"{args.split}.jsonl", check=not args.skip_check,
           timeout_s=args.timeout)
