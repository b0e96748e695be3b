"""
SynSQL-2.5M (OmniSQL's synthetic data) -> sqlrl JSONL. data.json is large, so it is streamed; --limit keeps the first N.
Difficulty is SynSQL's own sql_complexity label (Simple / Moderate / Complex / Highly Complex).

    python data/synsql/prepare.py --synsql-dir ~/SynSQL-2.5M --limit 20000     # -> data/synsql/train.jsonl
"""
import sys
from itertools import islice
from pathlib import Path

from tqdm import tqdm

if __name__ == "__main__":  # run as a script: make `data.*` importable like from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from data.spider.prepare import db_file, finish, iter_json_array, make_record, require

HERE = Path(__file__).resolve().parent

# -----------------------------------------------------------------------------


def load_synsql(synsql_dir, limit=None, db_dir=None):
    """Stream <synsql_dir>/data.json (first `limit` examples) with databases/<db>/<db>.sqlite -> (records, skipped)."""
    synsql_dir = require(synsql_dir, "SynSQL folder", "Pass --synsql-dir pointing at the SynSQL-2.5M download.")
    data_path = require(synsql_dir / "data.json", "SynSQL data file", "Expected data.json inside --synsql-dir.")
    db_dir = require(db_dir or synsql_dir / "databases", "SynSQL database folder",
                     "Unpack databases.zip inside --synsql-dir, or pass --db-dir.")
    records = []
    skipped = []
    exists = {}  # db_id -> bool, so 2.5M examples do not stat 2.5M times
    items = tqdm(islice(iter_json_array(data_path), limit), total=limit, desc="synsql", leave=False, unit="q")
    for i, ex in enumerate(items):
        missing = [k for k in ("db_id", "question", "sql") if k not in ex]
        if missing:
            raise ValueError(f"{data_path}: example {i} lacks {missing}; is this SynSQL-2.5M's data.json?")
        path = db_file(db_dir, ex["db_id"])
        if ex["db_id"] not in exists:
            exists[ex["db_id"]] = path.exists()
        if not exists[ex["db_id"]]:
            skipped.append(dict(db_id=ex["db_id"], question=ex["question"], reason="database missing"))
            continue
        records.append(make_record(f"synsql-{i:07d}", ex["db_id"], path, ex["question"], ex["sql"],
                                   ex.get("sql_complexity") or "unknown", "synsql",
                                   evidence=ex.get("external_knowledge", "")))
    return records, skipped


if __name__ == "__main__":
    from cli import ArgumentParser, die, positive_int
    parser = ArgumentParser(description=__doc__)
    parser.add_argument("--synsql-dir", type=Path, required=True, help="folder with data.json and databases/")
    parser.add_argument("--limit", type=positive_int, default=None, help="only the first N examples (default: all)")
    parser.add_argument("--db-dir", type=Path, default=None, help="databases (default <synsql-dir>/databases)")
    parser.add_argument("--out", type=Path, default=HERE, help="output folder (default: beside this script)")
    parser.add_argument("--skip-check", action="store_true", help="do not execute the gold queries")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds per gold query when checking")
    args = parser.parse_args()
    try:
        records, skipped = load_synsql(args.synsql_dir, args.limit, args.db_dir)
    except (FileNotFoundError, ValueError) as e:
        die(e)
    finish("synsql", records, skipped, args.out / "train.jsonl", check=not args.skip_check, timeout_s=args.timeout)
