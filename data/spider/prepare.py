"""
Spider (and Spider-DK / Spider-Syn / Spider-Realistic, which share its format) -> sqlrl JSONL.
Difficulty is the official Spider hardness (easy/medium/hard/extra), computed from the gold SQL with sqlglot.
Also home of the official test-suite evaluator's conventions that eval.py's spider scoring reproduces (its query
rewriting, the test-suite databases, its gold.txt/pred.txt files), and of the small helpers the BIRD and SynSQL
loaders share (JSON streaming, read-only SQLite, gold checks, the gold file both official scorers read).

    python data/spider/prepare.py --spider-dir ../shared/data/spider                 # -> data/spider/dev.jsonl
    python data/spider/prepare.py --spider-dir DIR --split train_spider.json --out /tmp/spider
"""
import json
import random
import re
import sys
from collections import Counter
from pathlib import Path

import sqlglot
from sqlglot import exp
from sqlglot.tokens import TokenType
from tqdm import tqdm

if __name__ == "__main__":  # run as a script: make `data.*` importable like from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from env import run_many  # noqa: E402  (the agent's own read-only sandbox runs the gold queries)

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
    decoder = json.JSONDecoder()
    buf = ""
    pos = 0
    started = False
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
                    started = True
                    pos += 1
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
    failures = []
    step = 1000  # chunks, so a large dataset shows progress
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
    where = top.args.get("where")
    having = top.args.get("having")
    group = top.args.get("group")
    order = top.args.get("order")
    joins = top.args.get("joins") or []
    has_from = top.args.get("from_") or top.args.get("from")
    conds = [j.args.get("on") for j in joins if j.args.get("on")] + [c.this for c in (where, having) if c]
    cond_nodes = [n for c in conds for n in _local(c, top)]
    where_nodes = _local(where, top)
    having_nodes = _local(having, top)

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
# the official test-suite evaluator (taoyds/test-suite-sql-eval, exec_eval.eval_exec_match, default flags): the
# queries it runs for a line of its files, its databases, and the files themselves. eval.py scores with these.


def one_line(sql):
    """sql as a line of the official files (line breaks and tabs become a space): what their scorers then run."""
    return re.sub(r"\s*[\r\n\t]+\s*", " ", sql).strip()


def remove_distinct(sql):
    """exec_eval.remove_distinct: the first statement's text without its DISTINCT keyword tokens. It tokenizes with
    sqlparse; sqlglot's SQLite tokenizer finds the same keywords ("distinct" and [distinct] are names, 'distinct' a
    string). Text that does not tokenize (an unclosed quote) fails to run either way."""
    try:
        tokens = sqlglot.tokenize(sql, read="sqlite")
    except sqlglot.errors.SqlglotError:
        return sql
    out = ""
    pos = 0  # token positions index sql: cutting there keeps comments and spacing as written
    for t in tokens:
        if t.token_type == TokenType.SEMICOLON:  # sqlparse.parse(s)[0]: a second statement is dropped, not run
            return out + sql[pos:t.end + 1]
        if t.token_type == TokenType.DISTINCT:
            out += sql[pos:t.start]  # before pos moves past the DISTINCT
            pos = t.end + 1
    return out + sql[pos:]


def spider_sql(sql, pred):
    """The query the test-suite evaluator runs for a line of its gold (pred=False) or prediction file."""
    sql = one_line(sql)
    if pred:  # evaluation.py: the `value` placeholder of value-free parsers (only between spaces, as there)
        sql = sql.replace(" value ", " 1 ")
    sql = remove_distinct(sql.replace("> =", ">=").replace("< =", "<=").replace("! =", "!="))  # postprocess
    return re.sub(r"YEAR\s*\(\s*CURDATE\s*\(\s*\)\s*\)\s*", "2020", sql, flags=re.I)  # exec_on_db: replace_cur_year


def ts_databases(example, ts_dir=None):
    """The example's database, or each file of its test-suite folder with '.sqlite' in its name ([] if none)."""
    if ts_dir is None:
        return [example["db_path"]]
    folder = Path(ts_dir) / example["db_id"]
    return sorted(str(f) for f in folder.iterdir() if ".sqlite" in f.name) if folder.is_dir() else []


MISSING_SQL = "SELECT"  # a file line for a missing prediction: it fails to run, so it is scored wrong


def write_gold_sql(path, examples):
    """"SQL\\tdb_id" per line for exactly these questions, in order: Spider test-suite's --gold and BIRD's
    dev_gold.sql (both scorers pair predictions with gold lines by position)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("".join(f"{one_line(ex['gold_sql'])}\t{ex['db_id']}\n" for ex in examples))


def write_spider_files(out_dir, examples, sqls):
    """The test-suite evaluator's pair (evaluation.py --gold gold.txt --pred pred.txt --etype exec), one question
    per line. A missing SQL is written as MISSING_SQL: an empty line would end a 'session' and shift every line."""
    write_gold_sql(Path(out_dir) / "gold.txt", examples)
    (Path(out_dir) / "pred.txt").write_text("".join(f"{one_line(sql or '') or MISSING_SQL}\n" for sql in sqls))


# -----------------------------------------------------------------------------
# loader


def load_spider(spider_dir, split_file="dev.json", db_dir=None):
    """Read a Spider-format split -> (records, skipped). Questions whose database is missing are skipped, and listed."""
    spider_dir = require(spider_dir, "Spider folder", "Pass --spider-dir pointing at the unzipped Spider release.")
    split_path = require(spider_dir / split_file, "Spider split file",
                         "Use --split dev.json, train_spider.json, train_others.json (or a DK/Syn/Realistic file).")
    db_dir = require(db_dir or spider_dir / "database", "Spider database folder",
                     "Pass --db-dir DIR holding <db>/<db>.sqlite.")
    records = []
    skipped = []
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


def spider_sample(spider_dir, n):
    """A fixed sample of n Spider dev questions (the same for every run, so seeds compare on the same questions);
    [] when the folder has no dev.json."""
    if not (Path(spider_dir) / "dev.json").is_file():
        return []
    records, _ = load_spider(Path(spider_dir))
    return [{**r, "db_path": str(r["db_path"])} for r in random.Random(0).sample(records, min(n, len(records)))]


if __name__ == "__main__":
    from cli import ArgumentParser, die
    parser = ArgumentParser(description=__doc__)
    parser.add_argument("--spider-dir", type=Path, required=True, help="folder with dev.json, tables.json, database/")
    parser.add_argument("--split", default="dev.json", help="split file inside --spider-dir (default dev.json)")
    parser.add_argument("--db-dir", type=Path, default=None, help="databases (default <spider-dir>/database)")
    parser.add_argument("--out", type=Path, default=HERE, help="output folder (default: beside this script)")
    parser.add_argument("--skip-check", action="store_true", help="do not execute the gold queries")
    args = parser.parse_args()
    try:
        records, skipped = load_spider(args.spider_dir, args.split, args.db_dir)
    except (FileNotFoundError, ValueError) as e:
        die(e)
    finish("spider", records, skipped, args.out / f"{Path(args.split).stem}.jsonl", check=not args.skip_check)
