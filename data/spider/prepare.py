"""
Spider (and Spider-DK / Spider-Syn / Spider-Realistic, which share its format) -> sqlrl JSONL.
Difficulty is the official Spider hardness (easy/medium/hard/extra), computed from the gold SQL with sqlglot.
Also home of the small helpers the BIRD and SynSQL loaders share (JSON streaming, read-only SQLite, gold checks).

    python data/spider/prepare.py --spider-dir ../shared/data/spider                 # -> data/spider/dev.jsonl
    python data/spider/prepare.py --spider-dir DIR --split train_spider.json --out /tmp/spider
"""
import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import sqlglot
from sqlglot import exp
from tqdm import tqdm

if __name__ == "__main__":  # run as a script: make `data.*` importable like from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from env import run_many  # noqa: E402  (the same read-only sandbox the agent uses runs the gold queries)

HERE = Path(__file__).resolve().parent

# -----------------------------------------------------------------------------
# shared helpers (imported by data/bird/prepare.py and data/synsql/prepare.py)


def require(path, what, hint):
    """Return path if it exists, else raise an error naming the missing thing and what to do."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{what} not found: {path}. {hint}")
    return path


def iter_json_array(path, chunk_size=1 << 20):
    """Yield the items of a top-level JSON array one by one, reading the file in chunks (SynSQL's data.json is GBs)."""
    decoder, buf, pos, started = json.JSONDecoder(), "", 0, False
    with open(path, encoding="utf-8") as f:
        while True:
            chunk = f.read(chunk_size)
            buf = buf[pos:] + chunk
            pos = 0
            while True:
                while pos < len(buf) and buf[pos] in " \t\r\n,":  # skip whitespace and separators
                    pos += 1
                if not started:
                    if pos == len(buf):
                        break
                    if buf[pos] != "[":
                        raise ValueError(f"{path}: expected a JSON array of examples, found {buf[pos]!r} at the start")
                    started, pos = True, pos + 1
                    continue
                if pos < len(buf) and buf[pos] == "]":
                    return
                try:
                    item, end = decoder.raw_decode(buf, pos)
                except json.JSONDecodeError:
                    if not chunk:
                        raise ValueError(f"{path}: truncated or malformed JSON near character {pos}") from None
                    break  # the item continues in the next chunk
                if end == len(buf) and chunk:
                    break  # a bare number might continue in the next chunk: decode it again with more text
                yield item
                pos = end
            if not chunk:
                raise ValueError(f"{path}: the JSON array is not closed with ']'")


def db_file(db_dir, db_id):
    return Path(db_dir) / db_id / f"{db_id}.sqlite"


def make_record(id, db_id, db_path, question, gold_sql, difficulty, source, evidence=""):
    return dict(id=str(id), db_id=db_id, db_path=str(Path(db_path).resolve()), question=question.strip(),
                evidence=evidence or "", gold_sql=gold_sql.strip(), difficulty=difficulty, source=source)


def check_gold(records, timeout_s=30.0):
    """Run every gold query in the read-only sandbox; returns [(record, error)] for those that fail."""
    failures, step = [], 1000  # chunks, so a large dataset shows progress
    for i in tqdm(range(0, len(records), step), desc="gold SQL", leave=False, disable=len(records) <= step):
        chunk = records[i:i + step]
        results = run_many([(r["db_path"], r["gold_sql"]) for r in chunk], workers=4, timeout_s=timeout_s, max_rows=1)
        failures += [(r, res.error) for r, res in zip(chunk, results) if res.error]
    return failures


def report(name, records, skipped, failures=()):
    """Print what was kept, and every skipped or failing question, with a count and an example: nothing is silent."""
    levels = dict(sorted(Counter(r["difficulty"] for r in records).items()))
    print(f"{name}: kept {len(records)} questions, difficulty {levels}")
    for reason, items in Counter(s["reason"] for s in skipped).items():
        ex = next(s for s in skipped if s["reason"] == reason)
        print(f"{name}: skipped {items} questions ({reason}), e.g. db {ex['db_id']!r}: {ex['question']!r}")
    if failures:
        r, err = failures[0]
        print(f"{name}: {len(failures)} gold queries failed or timed out, e.g. {r['id']} ({r['db_id']}): {err}")


def write_jsonl(records, path):
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    print(f"wrote {len(records)} records -> {path}")


def finish(name, records, skipped, out_path, check=True, timeout_s=30.0):
    """Shared tail of every loader: check gold SQL, drop (and report) failing ones, report, write.
    A gold query that only times out is reported but kept: it is slow, not wrong."""
    failures = check_gold(records, timeout_s) if check else []
    bad = {id(r) for r, err in failures if not err.startswith("query timed out")}
    skipped = skipped + [dict(db_id=r["db_id"], question=r["question"], reason="gold SQL fails")
                         for r, _ in failures if id(r) in bad]
    records = [r for r in records if id(r) not in bad]
    report(name, records, skipped, failures)
    write_jsonl(records, out_path)
    return records, skipped


# -----------------------------------------------------------------------------
# official Spider hardness (evaluation.py eval_hardness), on a sqlglot parse of the gold SQL.
# Spider scores the top-level (left-most) SELECT only; subqueries in conditions and INTERSECT/UNION/EXCEPT count as
# "nested". Quirks kept on purpose: in WHERE/HAVING, Spider's has_agg tests a condition's NOT flag, and every
# AND/OR connector inside HAVING counts as an aggregation.

NESTED = (exp.Subquery, exp.Select, exp.SetOperation)


def _local(node, root):
    """Nodes under node, not descending into nested queries (which are yielded, but not entered)."""
    if node is None:
        return []
    return list(node.walk(prune=lambda n: n is not root and n is not node and isinstance(n, NESTED)))


def _count(nodes, *types):
    return sum(isinstance(n, types) for n in nodes)


def _has_agg(node, root):
    return any(isinstance(n, exp.AggFunc) for n in _local(node, root))


def hardness_counts(sql):
    """(component1, component2, others) of the official rules for one SQL string."""
    tree = sqlglot.parse_one(sql, read="sqlite")
    top = tree
    while isinstance(top, exp.SetOperation):  # A UNION B: score A, count B as nested
        top = top.this
    if not isinstance(top, exp.Select):
        raise ValueError(f"not a SELECT query: {sql!r}")
    where, having = top.args.get("where"), top.args.get("having")
    group, order = top.args.get("group"), top.args.get("order")
    joins = top.args.get("joins") or []
    has_from = top.args.get("from_") or top.args.get("from")
    conds = [j.args.get("on") for j in joins if j.args.get("on")] + [c.this for c in (where, having) if c]
    cond_nodes = [n for c in conds for n in _local(c, top)]
    where_nodes, having_nodes = _local(where, top), _local(having, top)

    comp1 = bool(where) + bool(group) + bool(order) + bool(top.args.get("limit"))
    comp1 += max((1 if has_from else 0) + len(joins) - 1, 0)  # one per extra table unit (joins)
    comp1 += _count(cond_nodes, exp.Or) + _count(cond_nodes, exp.Like)
    comp2 = sum(n is not c and isinstance(n, NESTED) for c in conds for n in _local(c, top))
    comp2 += isinstance(tree, exp.SetOperation)

    items = [e.this if isinstance(e, exp.Alias) else e for e in top.expressions]
    aggs = sum(_has_agg(e, top) for e in items)
    aggs += sum(isinstance(n, exp.Not) and not isinstance(n.this, exp.Is) for n in where_nodes)  # NOT IN / NOT LIKE
    aggs += sum(_has_agg(g, top) for g in (group.expressions if group else []))
    aggs += sum(min(_count(_local(o, top), exp.AggFunc), 2) for o in (order.expressions if order else []))
    aggs += _count(having_nodes, exp.And, exp.Or, exp.Not)
    n_where = _count(where_nodes, exp.And, exp.Or) + 1 if where else 0
    others = (aggs > 1) + (len(items) > 1) + (n_where > 1) + (len(group.expressions) > 1 if group else 0)
    return comp1, comp2, others


def spider_hardness(sql):
    """Official Spider difficulty of a query: 'easy' | 'medium' | 'hard' | 'extra'."""
    return hardness_level(*hardness_counts(sql))


def hardness_level(c1, c2, others):
    """evaluation.py's eval_hardness thresholds on (component1, component2, others) counts."""
    if c1 <= 1 and others == 0 and c2 == 0:
        return "easy"
    if (others <= 2 and c1 <= 1 and c2 == 0) or (c1 <= 2 and others < 2 and c2 == 0):
        return "medium"
    if (others > 2 and c1 <= 2 and c2 == 0) or (2 < c1 <= 3 and others <= 2 and c2 == 0) or \
            (c1 <= 1 and others == 0 and c2 <= 1):
        return "hard"
    return "extra"


# -----------------------------------------------------------------------------
# loader


def load_spider(spider_dir, split_file="dev.json", db_dir=None):
    """Read a Spider-format split -> (records, skipped). Questions whose database is missing are skipped, and listed."""
    spider_dir = require(spider_dir, "Spider folder", "Pass --spider-dir pointing at the unzipped Spider release.")
    split_path = require(spider_dir / split_file, "Spider split file",
                         "Use --split dev.json, train_spider.json, train_others.json (or a DK/Syn/Realistic file).")
    db_dir = require(db_dir or spider_dir / "database", "Spider database folder",
                     "Pass --db-dir DIR holding <db>/<db>.sqlite.")
    records, skipped = [], []
    for i, ex in enumerate(iter_json_array(split_path)):
        question = ex.get("question") or ex.get("SpiderSynQuestion")  # Spider-Syn names its question field
        sql = ex.get("query") or ex.get("SQL") or ex.get("sql")
        if not question or not isinstance(sql, str) or "db_id" not in ex:
            raise ValueError(f"{split_path}: example {i} lacks db_id/question/query; is this a Spider-format file?")
        path = db_file(db_dir, ex["db_id"])
        if not path.exists():
            skipped.append(dict(db_id=ex["db_id"], question=question, reason="database missing"))
            continue
        try:
            level = spider_hardness(sql)
        except (sqlglot.errors.SqlglotError, ValueError):  # kept, and visible as "unknown" in the report
            level = "unknown"
        records.append(make_record(f"spider-{Path(split_file).stem}-{i:05d}", ex["db_id"], path, question, sql,
                                   level, "spider"))
    return records, skipped


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spider-dir", type=Path, required=True, help="folder with dev.json, tables.json, database/")
    parser.add_argument("--split", default="dev.json", help="split file inside --spider-dir (default dev.json)")
    parser.add_argument("--db-dir", type=Path, default=None, help="databases (default <spider-dir>/database)")
    parser.add_argument("--out", type=Path, default=HERE, help="output folder (default: beside this script)")
    parser.add_argument("--skip-check", action="store_true", help="do not execute the gold queries")
    args = parser.parse_args()
    try:
        records, skipped = load_spider(args.spider_dir, args.split, args.db_dir)
    except (FileNotFoundError, ValueError) as e:
        sys.exit(f"error: {e}")
    finish("spider", records, skipped, args.out / f"{Path(args.split).stem}.jsonl", check=not args.skip_check)
