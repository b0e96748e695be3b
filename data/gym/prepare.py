"""
The built-in SQLite gym: a seeded, deterministic generator of small BIRD-like text-to-SQL databases and questions.
Same seed -> byte-identical .sqlite and .jsonl files. Everything in sqlrl runs on it with no download.

    python data/gym/prepare.py                  # build into data/gym/ and print statistics
    python data/gym/prepare.py --seed 1 --out /tmp/gym

Output: databases/<db_id>/<db_id>.sqlite, train.jsonl (~2000), dev.jsonl (~200: same databases, new values),
test.jsonl (~200: held-out databases, and templates never seen in train/dev). From Python: `ensure_gym()`.
"""
import datetime
import hashlib
import json
import os
import sqlite3
import sys
import time
from collections import Counter
from pathlib import Path
from random import Random

from tqdm import tqdm

if __name__ == "__main__":  # run as a script: make `data.*` importable like from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from data.gym.domains import DISTRACTOR_COLS, DISTRACTOR_NOUNS, DISTRACTOR_WORDS, DOMAINS, NAMES, C  # noqa: E402

GYM_DIR = Path(__file__).resolve().parent
GYM_VERSION = 2  # bump when the generated data changes on purpose (2: identifiers in backticks)
LEVELS = ["easy", "medium", "hard", "extra"]
# level of question i is LEVEL_CYCLE[...]: 30% easy, 25% medium, 20% hard, 25% extra
LEVEL_CYCLE = ["easy"] * 6 + ["medium"] * 5 + ["hard"] * 4 + ["extra"] * 5
SPLIT_SIZES = {"train": 2000, "dev": 200, "test": 200}
TRAIN_DBS = ["schools", "shop", "flights", "clinic", "library"]
TEST_DBS = ["hotel", "league"]  # held out: never seen in train/dev

# -----------------------------------------------------------------------------
# building the databases

SQL_TYPE = {"pk": "INTEGER", "name": "TEXT", "cat": "TEXT", "int": "INTEGER", "real": "REAL", "date": "TEXT",
            "fk": "INTEGER", "text": "TEXT"}


def gen_value(rng, col, table, data, used):
    kind = col["kind"]
    arg = col["arg"]
    if col["null"] and rng.random() < col["null"]:
        return None
    if kind == "name":  # unique within the table
        for _ in range(1000):
            v = NAMES[arg](rng)
            if v not in used:
                used.add(v)
                return v
        raise RuntimeError(f"name pool {arg!r} too small for table {table}")
    if kind in ("cat", "code"):  # skewed, so "the most common X" has a clear answer
        vals = list(arg)
        return rng.choices(vals, weights=[1.0 / (i + 1) for i in range(len(vals))])[0]
    if kind == "fk":  # the last 15% of parents get no children, so "X with no Y" has answers
        return rng.randint(1, max(1, int(len(data[arg]) * 0.85)))
    if kind == "int":
        return rng.randint(*arg)
    if kind == "real":
        return round(rng.uniform(*arg), 2)
    if kind == "date":  # a uniform day in the year range, as 'YYYY-MM-DD'
        lo = datetime.date(arg[0], 1, 1).toordinal()
        hi = datetime.date(arg[1], 12, 31).toordinal()
        return datetime.date.fromordinal(rng.randint(lo, hi)).isoformat()
    return NAMES[arg](rng)  # text


def gen_rows(rng, cols, n, data, table=None):
    used = set()
    return [tuple(i + 1 if c["kind"] == "pk" else gen_value(rng, c, table, data, used) for c in cols) for i in range(n)]


def add_table(conn, name, cols, rows, tables):
    defs = []
    for c in cols:
        typ = SQL_TYPE.get(c["kind"]) or ("INTEGER" if isinstance(next(iter(c["arg"])), int) else "TEXT")
        defs.append(f'`{c["name"]}` {typ}' + (" PRIMARY KEY" if c["kind"] == "pk" else ""))
    for c in cols:
        if c["kind"] == "fk":
            pk = tables[c["arg"]]["cols"][0]["name"]
            defs.append(f'FOREIGN KEY (`{c["name"]}`) REFERENCES {c["arg"]}(`{pk}`)')
    conn.execute(f"CREATE TABLE {name} (\n  " + ",\n  ".join(defs) + "\n)")
    conn.executemany(f"INSERT INTO {name} VALUES ({', '.join('?' * len(cols))})", rows)


def build_db(path, spec, rng):
    """Write one database file; returns {table: [row tuples]} of the real tables (for sampling question values)."""
    tables = {t["name"]: t for t in spec["tables"]}
    data = {}
    for t in spec["tables"]:  # parents come before children in every domain
        data[t["name"]] = gen_rows(rng, t["cols"], t["rows"], data, t["name"])
    tmp = path.with_suffix(".tmp")
    tmp.unlink(missing_ok=True)
    conn = sqlite3.connect(tmp)
    for t in spec["tables"]:
        add_table(conn, t["name"], t["cols"], data[t["name"]], tables)
    names = set(tables)
    for i in range(spec["distractors"]):
        if i < 2:  # stale copies of real tables, a few rows each, so that exploring the schema matters
            t = spec["tables"][i + 1]
            cols = [c for c in t["cols"] if c["kind"] != "fk"]
            idx = [t["cols"].index(c) for c in cols]
            rows = [tuple(r[j] for j in idx) for r in rng.sample(data[t["name"]], 5)]
            add_table(conn, f"{t['name']}_{['backup', 'staging'][i]}", cols, rows, tables)
            continue
        name = f"{rng.choice(DISTRACTOR_WORDS)}_{rng.choice(DISTRACTOR_NOUNS)}"
        while name in names:
            name = f"{rng.choice(DISTRACTOR_WORDS)}_{rng.choice(DISTRACTOR_NOUNS)}_{rng.randint(2, 9)}"
        names.add(name)
        cols = [C("ID", "pk")] + [C(n, k, (0, 100) if k in ("int", "real") else (2015, 2024) if k == "date"
                                    else "phone") for n, k in rng.sample(DISTRACTOR_COLS, rng.randint(2, 4))]
        add_table(conn, name, cols, gen_rows(rng, cols, 3, data), tables)
    conn.commit()
    conn.close()
    os.replace(tmp, path)
    return data

# -----------------------------------------------------------------------------
# question templates: fn(rng, db) -> (question, sql, evidence, tie_sql, tie_at) or None when not applicable.
# tie_sql lists the ORDER BY keys; the question is rejected when keys tie at a LIMIT/OFFSET boundary (ambiguous gold).

def lit(v):  # the same text in question and SQL: strings single-quoted, numbers bare
    return f"'{v}'" if isinstance(v, str) else str(v)


def q(col, alias=None):  # backticks, as in BIRD: unlike "..." they need no escaping inside a JSON tool call,
    # so a name is the same tokens in the evidence, the schema, the tool call and the answer (easy for a model to copy)
    return f'{alias}.`{col["name"]}`' if alias else f'`{col["name"]}`'


def cols(t, *kinds):
    return [c for c in t["cols"] if c["kind"] in kinds]


def name_col(t):
    return (cols(t, "name") or cols(t, "pk"))[0]


def value(rng, db, t, col):
    i = t["cols"].index(col)
    vals = [r[i] for r in db["data"][t["name"]] if r[i] is not None]
    return rng.choice(vals)


def pick(rng, db, need):  # a random (table, column) whose column kind is in need
    options = [(t, c) for t in db["tables"] for c in t["cols"] if c["kind"] in need]
    return rng.choice(options) if options else (None, None)


def filt(rng, db, t, alias=None):  # a categorical filter: (question phrase, SQL condition, evidence)
    options = cols(t, "cat", "code")
    if not options:
        return None
    c = rng.choice(options)
    v = value(rng, db, t, c)
    cond = f"{q(c, alias)} = {lit(v)}"
    if c["kind"] == "code":  # BIRD-style: the question says what the code means, the evidence gives the code
        return f"that are {c['arg'][v]}", cond, f'{c["arg"][v]} refers to `{c["name"]}` = {lit(v)}'
    return (c["rel"] or "with {p} {v}").format(p=c["phrase"], v=lit(v)), cond, ""


def maybe_filt(rng, db, t, alias=None):  # half the time no filter: ("", "", "")
    return (rng.random() < 0.5 and filt(rng, db, t, alias)) or ("", "", "")


def where(f, sep=" WHERE "):
    return f[1] and sep + f[1]


def sp(f):  # the filter phrase with a leading space, or nothing
    return f[0] and " " + f[0]


def num(rng, db, nonnull=True):
    t, c = pick(rng, db, ("int", "real"))
    return (None, None) if c is None or (nonnull and c["null"]) else (t, c)


def threshold(rng, db, t, c):  # a value from the data, below the maximum so "above v" is non-empty
    vals = sorted(v for v in (r[t["cols"].index(c)] for r in db["data"][t["name"]]) if v is not None)
    return int(vals[rng.randint(len(vals) // 10, len(vals) * 8 // 10)])


def e_count(rng, db):
    t = rng.choice(db["tables"])
    f = filt(rng, db, t)
    return f and (f"How many {t['ents']} are there {f[0]}?", f"SELECT COUNT(*) FROM {t['name']} WHERE {f[1]}", f[2])


def e_list(rng, db):
    t = rng.choice(db["tables"])
    f = filt(rng, db, t)
    n = name_col(t)
    return f and (f"List the {n['phrase']} of {t['ents']} {f[0]}.",
                  f"SELECT {q(n)} FROM {t['name']} WHERE {f[1]}", f[2])


def e_above(rng, db):
    t, c = num(rng, db)
    if t:
        v = threshold(rng, db, t, c)
        return (f"How many {t['ents']} have {c['phrase']} above {v}?",
                f"SELECT COUNT(*) FROM {t['name']} WHERE {q(c)} > {v}", "")


def e_lookup(rng, db):
    t = rng.choice(db["tables"])
    n = name_col(t)
    row = rng.choice(db["data"][t["name"]])
    options = [c for c in cols(t, "cat", "code", "int", "real", "date", "text") if row[t["cols"].index(c)] is not None]
    if options and n["kind"] == "name":
        c = rng.choice(options)
        v = row[t["cols"].index(n)]
        return (f"What is the {c['phrase']} of the {t['ent']} {lit(v)}?",
                f"SELECT {q(c)} FROM {t['name']} WHERE {q(n)} = {lit(v)}", "")


def e_year(rng, db):
    t, c = pick(rng, db, ("date",))
    if t:
        y = value(rng, db, t, c)[:4]
        return (f"How many {t['ents']} have {c['phrase']} in the year '{y}'?",
                f"SELECT COUNT(*) FROM {t['name']} WHERE strftime('%Y', {q(c)}) = '{y}'", "")


def e_null(rng, db):  # held out
    options = [(t, c) for t in db["tables"] for c in t["cols"] if c["null"]]
    t, c = rng.choice(options) if options else (None, None)
    f = t and maybe_filt(rng, db, t)
    return t and (f"How many {t['ents']}{sp(f)} have no {c['phrase']} recorded?",
                  f"SELECT COUNT(*) FROM {t['name']} WHERE {q(c)} IS NULL{where(f, ' AND ')}", f[2])


AGGS = {"average": "AVG", "highest": "MAX", "lowest": "MIN", "total": "SUM"}


def m_count_by(rng, db):
    t, c = pick(rng, db, ("cat", "code"))
    f = maybe_filt(rng, db, t)
    return c["name"] not in f[1] and (f"How many {t['ents']}{sp(f)} are there for each {c['phrase']}?",
                                      f"SELECT {q(c)}, COUNT(*) FROM {t['name']}{where(f)} GROUP BY {q(c)}", f[2])


def m_having(rng, db):
    t, c = pick(rng, db, ("cat", "code"))
    counts = sorted(Counter(r[t["cols"].index(c)] for r in db["data"][t["name"]]).values())
    k = rng.choice(counts[:-1] or [1]) if counts[-1] > 1 else 0
    return (f"Which {c['phrase']} has more than {k} {t['ents']}?",
            f"SELECT {q(c)} FROM {t['name']} GROUP BY {q(c)} HAVING COUNT(*) > {k}", "")


def m_agg_by(rng, db):
    t, c = num(rng, db, nonnull=False)
    g = t and rng.choice(cols(t, "cat", "code") or [None])
    f = g and maybe_filt(rng, db, t)
    if g and g["name"] not in f[1]:
        w = rng.choice(list(AGGS))
        return (f"What is the {w} {c['phrase']} of {t['ents']}{sp(f)} for each {g['phrase']}?",
                f"SELECT {q(g)}, {AGGS[w]}({q(c)}) FROM {t['name']}{where(f)} GROUP BY {q(g)}", f[2])


def m_agg_filter(rng, db):
    t, c = num(rng, db, nonnull=False)
    f = t and filt(rng, db, t)
    if f:
        w = rng.choice(list(AGGS))
        return (f"What is the {w} {c['phrase']} of {t['ents']} {f[0]}?",
                f"SELECT {AGGS[w]}({q(c)}) FROM {t['name']} WHERE {f[1]}", f[2])


def m_having_avg(rng, db):  # held out
    t, c = num(rng, db, nonnull=False)
    g = t and rng.choice(cols(t, "cat", "code") or [None])
    if g:
        v = threshold(rng, db, t, c)
        return (f"Which {g['phrase']} has an average {c['phrase']} above {v}?",
                f"SELECT {q(g)} FROM {t['name']} GROUP BY {q(g)} HAVING AVG({q(c)}) > {v}", "")


def ordered(t, c, desc, where="", k=1, offset=0, alias=None):
    sel = f"SELECT {q(name_col(t))} FROM {t['name']}{where} ORDER BY {q(c)} {'DESC' if desc else 'ASC'}"
    tie = f"SELECT {q(c)} FROM {t['name']}{where} ORDER BY {q(c)} {'DESC' if desc else 'ASC'} LIMIT {k + offset + 1}"
    return sel + f" LIMIT {k}" + (f" OFFSET {offset}" if offset else ""), tie, [offset, offset + k]


def h_top(rng, db):
    t, c = num(rng, db)
    if t:
        desc = rng.random() < 0.5
        sql, tie, at = ordered(t, c, desc)
        return f"Which {t['ent']} has the {'highest' if desc else 'lowest'} {c['phrase']}?", sql, "", tie, at


def h_top_k(rng, db):
    t, c = num(rng, db)
    f = t and (filt(rng, db, t) if rng.random() < 0.5 else ("", "", ""))
    if f:
        desc = rng.random() < 0.5
        k = rng.randint(2, 5)
        sql, tie, at = ordered(t, c, desc, where=f[1] and f" WHERE {f[1]}", k=k)
        return (f"List the {k} {t['ents']}{f[0] and ' ' + f[0]} with the {'highest' if desc else 'lowest'} "
                f"{c['phrase']}.", sql, f[2], tie, at)


def h_top_filter(rng, db):
    t, c = num(rng, db)
    f = t and filt(rng, db, t)
    if f:
        desc = rng.random() < 0.5
        sql, tie, at = ordered(t, c, desc, where=f" WHERE {f[1]}")
        return (f"Among {t['ents']} {f[0]}, which has the {'highest' if desc else 'lowest'} {c['phrase']}?",
                sql, f[2], tie, at)


def h_date(rng, db):
    t, c = pick(rng, db, ("date",))
    if t and not c["null"]:
        desc = rng.random() < 0.5
        sql, tie, at = ordered(t, c, desc)
        return f"Which {t['ent']} has the {'latest' if desc else 'earliest'} {c['phrase']}?", sql, "", tie, at


def h_most(rng, db):
    t, c = pick(rng, db, ("cat", "code"))
    group = f"SELECT {{}} FROM {t['name']} GROUP BY {q(c)} ORDER BY COUNT(*) DESC LIMIT"
    return (f"Which {c['phrase']} has the most {t['ents']}?", group.format(q(c)) + " 1", "",
            group.format("COUNT(*)") + " 2", [0, 1])


def h_second(rng, db):  # held out
    t, c = num(rng, db)
    f = t and maybe_filt(rng, db, t)
    if t:
        desc = rng.random() < 0.5
        sql, tie, at = ordered(t, c, desc, where=where(f), offset=1)
        head = f"Among {t['ents']} {f[0]}, which" if f[0] else f"Which {t['ent']}"
        return f"{head} has the second {'highest' if desc else 'lowest'} {c['phrase']}?", sql, f[2], tie, at


def fk_pair(rng, db):  # (child, fk column, parent)
    t, c = pick(rng, db, ("fk",))
    return t, c, db["by_name"][c["arg"]]


def join(child, fk, parent, a="T1", b="T2"):
    pk = cols(parent, "pk")[0]
    return f"{child['name']} AS {a} JOIN {parent['name']} AS {b} ON {q(fk, a)} = {q(pk, b)}"


def parent_of(rng, db, child, fk, parent):  # name of a parent that has at least one child
    v = value(rng, db, child, fk)
    return db["data"][parent["name"]][v - 1][parent["cols"].index(name_col(parent))]


def x_join_count(rng, db):
    c, fk, p = fk_pair(rng, db)
    v = parent_of(rng, db, c, fk, p)
    return (f"How many {c['ents']} does the {p['ent']} {lit(v)} have?",
            f"SELECT COUNT(*) FROM {join(c, fk, p)} WHERE {q(name_col(p), 'T2')} = {lit(v)}", "")


def x_join_list(rng, db):
    c, fk, p = fk_pair(rng, db)
    f = filt(rng, db, p, alias="T2")
    return f and (f"List the {name_col(c)['phrase']} of {c['ents']} of {p['ents']} {f[0]}.",
                  f"SELECT {q(name_col(c), 'T1')} FROM {join(c, fk, p)} WHERE {f[1]}", f[2])


def x_join_most(rng, db):
    c, fk, p = fk_pair(rng, db)
    base = f"FROM {join(c, fk, p)} GROUP BY {q(fk, 'T1')} ORDER BY COUNT(*) DESC LIMIT"
    return (f"Which {p['ent']} has the most {c['ents']}?", f"SELECT {q(name_col(p), 'T2')} {base} 1", "",
            f"SELECT COUNT(*) {base} 2", [0, 1])


def x_above_avg(rng, db):
    t, c = num(rng, db, nonnull=False)
    if t:
        return (f"List the {name_col(t)['phrase']} of {t['ents']} whose {c['phrase']} is above the average.",
                f"SELECT {q(name_col(t))} FROM {t['name']} WHERE {q(c)} > (SELECT AVG({q(c)}) FROM {t['name']})", "")


def x_in(rng, db):
    c, fk, p = fk_pair(rng, db)
    f = filt(rng, db, c)
    return f and (f"List the {name_col(p)['phrase']} of {p['ents']} that have {c['ents']} {f[0]}.",
                  f"SELECT {q(name_col(p))} FROM {p['name']} WHERE {q(cols(p, 'pk')[0])} IN "
                  f"(SELECT {q(fk)} FROM {c['name']} WHERE {f[1]})", f[2])


def x_chain(rng, db):  # child -> parent -> grandparent
    c, fk, p = fk_pair(rng, db)
    if cols(p, "fk"):
        fk2 = rng.choice(cols(p, "fk"))
        g = db["by_name"][fk2["arg"]]
        v = parent_of(rng, db, p, fk2, g)
        return (f"How many {c['ents']} belong to the {g['ent']} {lit(v)}?",
                f"SELECT COUNT(*) FROM {join(c, fk, p)} JOIN {g['name']} AS T3 ON {q(fk2, 'T2')} = "
                f"{q(cols(g, 'pk')[0], 'T3')} WHERE {q(name_col(g), 'T3')} = {lit(v)}", "")


def x_bridge(rng, db):  # parent <- bridge -> other parent
    c, fk, p = fk_pair(rng, db)
    others = [f for f in cols(c, "fk") if f is not fk]
    if others:
        fk2 = rng.choice(others)
        g = db["by_name"][fk2["arg"]]
        v = parent_of(rng, db, c, fk2, g)
        return (f"List the distinct {name_col(p)['phrase']} of {p['ents']} linked to the {g['ent']} {lit(v)}.",
                f"SELECT DISTINCT {q(name_col(p), 'T2')} FROM {join(c, fk, p)} JOIN {g['name']} AS T3 ON "
                f"{q(fk2, 'T1')} = {q(cols(g, 'pk')[0], 'T3')} WHERE {q(name_col(g), 'T3')} = {lit(v)}", "")


def x_not_in(rng, db):  # held out
    c, fk, p = fk_pair(rng, db)
    f = maybe_filt(rng, db, p)
    listing = rng.random() < 0.5
    head = f"List the {name_col(p)['phrase']} of" if listing else "How many"
    return (f"{head} {p['ents']}{sp(f)} {'that ' if listing else ''}have no {c['ents']}" + "?."[listing],
            f"SELECT {q(name_col(p)) if listing else 'COUNT(*)'} FROM {p['name']} WHERE {q(cols(p, 'pk')[0])} "
            f"NOT IN (SELECT {q(fk)} FROM {c['name']}){where(f, ' AND ')}", f[2])


TEMPLATES = {
    "easy": [e_count, e_list, e_above, e_lookup, e_year, e_null],
    "medium": [m_count_by, m_having, m_agg_by, m_agg_filter, m_having_avg],
    "hard": [h_top, h_top_k, h_top_filter, h_date, h_most, h_second],
    "extra": [x_join_count, x_join_list, x_join_most, x_above_avg, x_in, x_chain, x_bridge, x_not_in],
}
HELD_OUT = {e_null, m_having_avg, h_second, x_not_in}  # test split only

# -----------------------------------------------------------------------------
# generating the splits


def usable(rows):  # non-empty, and not just a zero count or a NULL aggregate
    return any(v is not None for r in rows for v in r) and rows != [(0,)]


def tied(conn, tie_sql, at):
    keys = [r[0] for r in conn.execute(tie_sql).fetchall()]
    return any(0 < i < len(keys) and keys[i - 1] == keys[i] for i in at)


def gen_splits(rng, dbs, sizes, seen, held_out_ok):
    """Questions for several splits at once, interleaved so that they share one template mix; {split: records}."""
    out = {s: [] for s in sizes}
    held = {s: 0 for s in sizes}
    bar = tqdm(total=sum(sizes.values()), desc="gym questions", leave=False)
    while any(len(out[s]) < n for s, n in sizes.items()):
        split = min(sizes, key=lambda s: len(out[s]) / sizes[s])  # the split that is furthest behind
        i = len(out[split])
        db = dbs[i % len(dbs)]
        level = LEVEL_CYCLE[(i // len(dbs)) % len(LEVEL_CYCLE)]
        for _ in range(500):
            # test: ~30% of questions come from the held-out templates, the rest from the shared ones
            novel = held_out_ok and rng.random() < 0.3
            fn = rng.choice([f for f in TEMPLATES[level] if (f in HELD_OUT) == novel])
            res = fn(rng, db)
            if not res or res[1] in seen:
                continue
            question, sql, evidence, *tie = res
            if not usable(db["conn"].execute(sql).fetchall()) or (tie and tied(db["conn"], *tie)):
                continue
            seen.add(sql)
            held[split] += fn in HELD_OUT
            out[split].append(dict(id=f"gym-{split}-{i:04d}", db_id=db["id"], db_path=db["rel"], question=question,
                                   evidence=evidence, gold_sql=sql, difficulty=level, source="gym"))
            bar.update(1)
            break
        else:
            raise RuntimeError(f"gym: no new {level} question for {db['id']} after 500 tries; lower the split size")
    bar.close()
    return out, held


def write_jsonl(records, path):
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    os.replace(tmp, path)


def prepare(out_dir=GYM_DIR, seed=0, sizes=None):
    """Build the gym unconditionally into out_dir; returns statistics."""
    out_dir = Path(out_dir)
    sizes = {**SPLIT_SIZES, **(sizes or {})}
    stamp = out_dir / "databases" / ".stamp"  # says what the folder holds; absent while a build is under way
    stamp.unlink(missing_ok=True)
    rng = Random(seed)
    dbs = {}
    stats = dict(seed=seed, databases={}, splits={})
    for db_id in tqdm(TRAIN_DBS + TEST_DBS, desc="gym databases", leave=False):
        spec = DOMAINS[db_id]
        path = out_dir / "databases" / db_id / f"{db_id}.sqlite"
        path.parent.mkdir(parents=True, exist_ok=True)
        data = build_db(path, spec, rng)
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        dbs[db_id] = dict(id=db_id, tables=spec["tables"], data=data, conn=conn,
                          rel=f"databases/{db_id}/{db_id}.sqlite", by_name={t["name"]: t for t in spec["tables"]})
        n_tables = conn.execute("SELECT COUNT(*) FROM sqlite_master WHERE type = 'table'").fetchone()[0]
        stats["databases"][db_id] = dict(tables=n_tables, real_tables=len(spec["tables"]),
                                         rows=sum(len(v) for v in data.values()),
                                         split="test" if db_id in TEST_DBS else "train/dev")
    seen = set()  # gold SQL already used: dev and test never repeat a train query
    plan = [(TRAIN_DBS, {"train": sizes["train"], "dev": sizes["dev"]}), (TEST_DBS, {"test": sizes["test"]})]
    for names, split_sizes in plan:
        out, held = gen_splits(rng, [dbs[d] for d in names], split_sizes, seen, held_out_ok=names is TEST_DBS)
        for split, records in out.items():
            write_jsonl(records, out_dir / f"{split}.jsonl")
            stats["splits"][split] = dict(questions=len(records), evidence=sum(bool(r["evidence"]) for r in records),
                                          held_out_templates=held[split],
                                          **{lv: sum(r["difficulty"] == lv for r in records) for lv in LEVELS})
    for db in dbs.values():
        db["conn"].close()
    stamp.write_text(_stamp(seed))
    return stats


# -----------------------------------------------------------------------------
# build on demand


def _stamp(seed):
    code = b"".join((GYM_DIR / f).read_bytes() for f in ("prepare.py", "domains.py"))  # either changes the data
    source = hashlib.sha256(code).hexdigest()[:16]
    return json.dumps(dict(version=GYM_VERSION, seed=seed, source=source, sqlite=sqlite3.sqlite_version))


def ensure_gym(seed=0):
    """Return data/gym/, building it first when missing or built with another seed/version (fast no-op otherwise)."""
    import fcntl  # the lock keeps parallel test runs from building into the same folder at once
    stamp = GYM_DIR / "databases" / ".stamp"
    stamp.parent.mkdir(parents=True, exist_ok=True)
    with open(GYM_DIR / "databases" / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        files = [GYM_DIR / f"{s}.jsonl" for s in SPLIT_SIZES]
        if not (stamp.exists() and stamp.read_text() == _stamp(seed) and all(f.exists() for f in files)):
            prepare(GYM_DIR, seed)
    return GYM_DIR


def print_stats(stats):
    print(f"gym (seed {stats['seed']}): {len(stats['databases'])} databases")
    print(f"{'database':<10} {'split':<10} {'tables':>6} {'real':>5} {'rows':>5}")
    for db_id, s in stats["databases"].items():
        print(f"{db_id:<10} {s['split']:<10} {s['tables']:>6} {s['real_tables']:>5} {s['rows']:>5}")
    print(f"{'split':<6} {'questions':>9} " + " ".join(f"{lv:>6}" for lv in LEVELS) + "  evidence  held-out-templates")
    for split, s in stats["splits"].items():
        print(f"{split:<6} {s['questions']:>9} " + " ".join(f"{s[lv]:>6}" for lv in LEVELS) +
              f"  {s['evidence']:>8}  {s['held_out_templates']:>18}")


if __name__ == "__main__":
    from cli import ArgumentParser  # a bad flag is one `error:` line
    parser = ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=GYM_DIR, help="output folder (default: beside this script)")
    parser.add_argument("--seed", type=int, default=0, help="the generated world (databases and questions)")
    args = parser.parse_args()
    t0 = time.perf_counter()
    stats = prepare(args.out, args.seed)
    print_stats(stats)
    print(f"built in {time.perf_counter() - t0:.1f} s -> {args.out}")
