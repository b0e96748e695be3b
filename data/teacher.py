"""
Scripted teacher: correct multi-turn SFT trajectories, made by really exploring each database with the sandbox.

The papers distil their warm-up data from GPT-4.1 / Claude / DeepSeek-R1. We can't call an API, so this teacher
plays the agent itself, the way TRUST-SQL's case study (App. E) does: list the tables, read the schemas of the tables
the gold SQL touches (found with rewards.extract_schema) plus a distractor, probe the distinct values of filtered
columns, propose the schema (trust), restate the question and run a candidate SQL (now and then a broken first
attempt that it repairs) and confirm. Every trajectory is replayed through env.new_episode/env.step and kept only when
every turn passes the protocol's format check and the final SQL matches gold by execution (TRUST App. A.2 filters its
SFT data the same way).

Output: JSONL, one trajectory per line: {"id", "db_id", "protocol", "schema_mode", "max_turns", "messages", ...}
where messages = protocol.build_messages(...) followed by alternating assistant / observation messages, exactly
what rollout.py would produce. Trajectories from any other source in the same format train the same way.

    python data/teacher.py --data data/gym/train.jsonl --protocol trust --out out/teacher/gym_trust.jsonl
"""
import json
import random
import re
import sys
import time
from pathlib import Path

if __name__ == "__main__":  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import sqlglot
from sqlglot import exp

import cli
import env
import protocols
from rewards import extract_schema

# -----------------------------------------------------------------------------
# thinking templates: several phrasings per step, picked per example with a seeded rng

THINK = {
    "list": ["First I list the tables.", "Which tables are there?", "Let me list the tables."],
    "schema": ["I need {tables}. Check the columns.", "Read the schema of {tables}.", "Verify the columns of {tables}."],
    "probe": ["Check the values of {col}.", "How are {col} values written?", "Look at the values in {col}."],
    "propose": ["The schema is verified.", "Commit to the verified schema.", "I have what I need."],
    # the question again, right before the SQL: its values are then a few tokens back, not a few hundred
    "generate": ["{question} Run the query.", "{question} Test the SQL.", "{question} Now write the SQL."],
    "repair": ["It failed: {error}. Fix it.", "Error ({error}). Repair the query.", "{error}. Correct it."],
    "confirm": ["The result is right.", "This answers the question.", "Confirm the SQL."],
}

LIST_TABLES_SQL = "SELECT name FROM sqlite_master WHERE type = 'table'"


def quote_str(value):
    return "'" + str(value).replace("'", "''") + "'"

# -----------------------------------------------------------------------------
# turn rendering per protocol: a dict of plain functions. Each returns the assistant text of one turn.


def tool_call_json(db_id, sql, name="execute_sql_query", db_key="db_id"):
    return json.dumps({"name": name, "arguments": {db_key: db_id, "sql": sql}}, ensure_ascii=False)


def render_trust(kind, think, db_id, sql=None, schema=None):
    if kind in ("explore", "generate"):
        action = "explore_schema" if kind == "explore" else "generate_sql"
        body = f"<tool_call>\n{tool_call_json(db_id, sql)}\n</tool_call>"
    elif kind == "propose":
        action = "propose_schema"
        body = f"<schema>\n{json.dumps(schema, ensure_ascii=False)}\n</schema>"
    else:
        action = "confirm_answer"
        body = f"<answer>\n{sql}\n</answer>"
    return f"<think>{think}</think>\n<action>{action}</action>\n{body}"


def render_trail(kind, think, db_id, sql=None, schema=None):
    tag = "solution" if kind == "confirm" else "sql"
    return f"<reasoning>{think}</reasoning>\n<{tag}>{sql}</{tag}>"


def render_skyrl(kind, think, db_id, sql=None, schema=None):
    tag = "solution" if kind == "confirm" else "sql"
    return f"<think>{think}</think>\n<{tag}>{sql}</{tag}>"


def render_mtir(kind, think, db_id, sql=None, schema=None):
    if kind == "confirm":
        return f"<think>{think}</think>\n<answer>\n{sql}\n</answer>"
    call = tool_call_json(db_id, sql, "sql-execute_sql_query", "db_name")  # the name MTIR's prompt gives
    return f"<think>{think}</think>\n<tool_call>\n{call}\n</tool_call>"


# protocol variants (protocols.protocol_variant, e.g. "trust-brief") render like their base protocol
RENDER = {"trust": render_trust, "trail": render_trail, "skyrl": render_skyrl, "mtir": render_mtir}

# -----------------------------------------------------------------------------
# reading the gold SQL: which tables/columns it touches, its joins, and which columns it filters on literals


def table_columns(db_path, table):
    res = env.run_sql(db_path, f"PRAGMA table_info({env.quote_ident(table)})")
    return [] if res.error else [row[1] for row in res.rows]


def gold_facts(gold_sql, db_path, all_tables):
    """Tables (db spelling, sorted), columns per table, join conditions and (table, column) filtered on a
    string literal (with that literal), from the gold SQL."""
    gold = extract_schema(gold_sql, db_path)
    by_lower = {t.lower(): t for t in all_tables}
    tables = []
    for t in sorted(gold["tables"]):  # sets iterate in PYTHONHASHSEED order: sort, so trajectories reproduce
        name = by_lower.get(str(t).lower())
        if name and name not in tables:
            tables.append(name)
    cols_of = {t: table_columns(db_path, t) for t in tables}
    columns = {t: [] for t in tables}
    for c in sorted(gold["columns"]):  # "table.column" (or bare column) strings
        c = str(c)
        t, _, col = c.rpartition(".")
        owners = [x for x in tables if (not t or x.lower() == t.lower())]
        for owner in owners:
            match = [k for k in cols_of[owner] if k.lower() == col.lower()]
            if match and match[0] not in columns[owner]:
                columns[owner].append(match[0])
                break
    tree = sqlglot.parse_one(gold_sql, read="sqlite")
    alias = {}
    for node in tree.find_all(exp.Table):
        name = by_lower.get(node.name.lower())
        if name:
            alias[(node.alias_or_name or node.name).lower()] = name
            alias[node.name.lower()] = name

    def owner_of(col):
        if col.table and col.table.lower() in alias:
            return alias[col.table.lower()]
        for t in tables:
            if any(k.lower() == col.name.lower() for k in cols_of[t]):
                return t
        return None

    def real_col(t, name):
        return next((k for k in cols_of.get(t, []) if k.lower() == name.lower()), None)

    joins = []
    for j in tree.find_all(exp.Join):
        on = j.args.get("on")
        for eq in (on.find_all(exp.EQ) if on else []):
            a = eq.left
            b = eq.right
            if isinstance(a, exp.Column) and isinstance(b, exp.Column):
                ta = owner_of(a)
                tb = owner_of(b)
                ca = real_col(ta, a.name)
                cb = real_col(tb, b.name)
                if ta and tb and ca and cb:
                    joins.append(f"{ta}.{ca} = {tb}.{cb}")
    filtered = []
    for cond in tree.find_all(exp.EQ, exp.NEQ, exp.Like, exp.In):
        col = cond.this if isinstance(cond.this, exp.Column) else None
        others = [cond.args.get("expression")] + list(cond.args.get("expressions") or [])
        strings = [o.this for o in others if isinstance(o, exp.Literal) and o.is_string]
        if col is None or not strings:
            continue
        t = owner_of(col)
        c = real_col(t, col.name) if t else None
        if c and all((t, c) != f[:2] for f in filtered):
            filtered.append((t, c, strings[0]))
    return tables, columns, joins, filtered


def break_sql(gold_sql, columns, rng):
    """A plausible first attempt that fails: one real column renamed to a name that does not exist."""
    tree = sqlglot.parse_one(gold_sql, read="sqlite")
    cols = [c for c in tree.find_all(exp.Column) if c.name and c.name != "*"]
    if not cols:
        return None, None
    ident = rng.choice(cols).this
    known = {k.lower() for ks in columns.values() for k in ks}
    for suffix in ("_name", "_id", "s", "_value"):
        wrong = ident.name + suffix
        if wrong.lower() not in known:
            break
    # splice the name into the gold text at the identifier's offsets: the repair then differs from the broken attempt
    # in that one name, and the SQL keeps gold's quoting and layout (sqlglot would re-quote it all with "...")
    start = ident.meta["start"]
    end = ident.meta["end"]
    quote = gold_sql[start] if ident.args.get("quoted") else ""
    close = {"[": "]"}.get(quote, quote)
    return gold_sql[:start] + quote + wrong.replace(close, close * 2) + close + gold_sql[end + 1:], wrong

# -----------------------------------------------------------------------------
# one trajectory


def plan_turns(example, protocol, schema_mode, rng, distractors=1, max_probes=2, repair_rate=0.2, list_tables=True):
    """The teacher's turns as (kind, think, sql, schema). Raises ValueError when the example cannot be taught."""
    db_path = example["db_path"]
    gold_sql = example["gold_sql"].strip().rstrip(";").strip()
    listing = env.run_sql(db_path, LIST_TABLES_SQL)
    if listing.error:
        raise ValueError(f"cannot list tables: {listing.error}")
    all_tables = [r[0] for r in listing.rows if not str(r[0]).startswith("sqlite_")]
    tables, columns, joins, filtered = gold_facts(gold_sql, db_path, all_tables)
    if not tables:
        raise ValueError("gold SQL touches no known table")

    def pick(key, **kw):  # one of the key's reasoning lines, seeded
        return rng.choice(THINK[key]).format(question=example["question"], **kw)
    turns = []
    # unknown schema: list the tables (list_tables=False: read the ones the question names straight away, shorter);
    # with a prefilled schema the prompt has the list, but reading the needed tables still verifies them
    if schema_mode == "none" and list_tables:
        turns.append(("explore", pick("list"), LIST_TABLES_SQL, None))
    if schema_mode == "none" or protocol.startswith("trust"):
        others = [t for t in all_tables if t not in tables]
        shown = tables + rng.sample(others, min(distractors, len(others)))
        names = ", ".join(quote_str(t) for t in shown)
        sql = f"SELECT name, sql FROM sqlite_master WHERE type = 'table' AND name IN ({names})"
        turns.append(("explore", pick("schema", tables=" and ".join(tables)), sql, None))
    for t, c, value in filtered[:max_probes]:
        # few distinct values: list them all; many (names): look the question's value up with LIKE
        col = env.quote_ident(c)
        table = env.quote_ident(t)
        n = env.run_sql(db_path, f"SELECT COUNT(DISTINCT {col}) FROM {table}").rows
        if n and n[0][0] <= 12:
            sql = f"SELECT DISTINCT {col} FROM {table}"
        else:
            word = max(re.findall(r"[^\s%_']+", value) or [value], key=len)
            sql = f"SELECT DISTINCT {col} FROM {table} WHERE {col} LIKE {quote_str('%' + word + '%')} LIMIT 10"
        turns.append(("explore", pick("probe", col=f"{t}.{c}"), sql, None))
    if protocol.startswith("trust"):
        schema = {"tables": tables, "columns": {t: columns[t] for t in tables}, "joins": joins}
        turns.append(("propose", pick("propose"), None, schema))
    if rng.random() < repair_rate:
        broken, wrong = break_sql(gold_sql, columns, rng)
        err = env.run_sql(db_path, broken).error if broken else None
        if err:
            turns.append(("generate", pick("generate"), broken, None))
            turns.append(("generate", pick("repair", error=err.splitlines()[0][:80]), gold_sql, None))
    if not turns or turns[-1][2] != gold_sql:
        turns.append(("generate", pick("generate"), gold_sql, None))
    turns.append(("confirm", pick("confirm"), gold_sql, None))
    return turns


def teach(example, protocol="trust", *, max_turns=10, schema_mode="none", seed=0, **plan_kw):
    """Returns (record, None) for a checked trajectory or (None, reason) when it is dropped."""
    rng = random.Random(f"{seed}:{example['id']}")
    try:
        turns = plan_turns(example, protocol, schema_mode, rng, **plan_kw)
    except (ValueError, sqlglot.errors.ParseError) as e:
        return None, f"plan: {str(e).splitlines()[0][:60]}"
    proto = protocols.PROTOCOLS[protocol]
    if len(turns) > max_turns:
        return None, "too many turns"
    messages = [dict(m) for m in proto.build_messages(example, schema_mode, max_turns)]
    episode = env.new_episode(example, proto, max_turns, schema_mode)
    for kind, think, sql, schema in turns:
        text = RENDER[protocol.split("-")[0]](kind, think, example["db_id"], sql=sql, schema=schema)
        messages.append({"role": "assistant", "content": text})
        obs, done = env.step(episode, text)
        if done:
            break
        messages.append({"role": proto.obs_role, "content": obs})
    record = {"id": example["id"], "db_id": example["db_id"], "protocol": protocol, "schema_mode": schema_mode,
              "max_turns": max_turns, "num_turns": len(episode.actions),
              "repaired": any(e is not None for e in episode.exec_errors), "messages": messages}
    ok, reason = check_trajectory(record, example)
    return (record, None) if ok else (None, reason)

# -----------------------------------------------------------------------------
# the check every kept trajectory passes (works for trajectories from any source)


def check_trajectory(record, example):
    """Replay the assistant turns through a fresh episode: every turn format-valid, observations identical to the
    stored ones, ends with an answer whose execution result matches gold. Returns (ok, reason)."""
    proto = protocols.PROTOCOLS[record["protocol"]]
    prompt = proto.build_messages(example, record["schema_mode"], record["max_turns"])
    messages = record["messages"]
    if [dict(m) for m in messages[:len(prompt)]] != [dict(m) for m in prompt]:
        return False, "prompt differs from protocol.build_messages"
    episode = env.new_episode(example, proto, record["max_turns"], record["schema_mode"])
    rest = messages[len(prompt):]
    for i in range(0, len(rest), 2):
        if rest[i]["role"] != "assistant":
            return False, f"message {len(prompt) + i} is not an assistant turn"
        obs, done = env.step(episode, rest[i]["content"])
        if not episode.turn_valid[-1]:
            return False, f"turn {i // 2} invalid: {episode.actions[-1].feedback}"
        if done:
            if i + 1 != len(rest):
                return False, "messages continue after the episode ended"
            break
        if i + 1 >= len(rest) or rest[i + 1] != {"role": proto.obs_role, "content": obs}:
            return False, f"observation after turn {i // 2} differs from the sandbox's"
    if not episode.done or episode.stop_reason != "answer" or not episode.final_sql:
        return False, f"no final answer (stop_reason={episode.stop_reason})"
    pred = env.run_sql(example["db_path"], episode.final_sql)
    gold = env.run_sql(example["db_path"], example["gold_sql"])
    if pred.error or gold.error:
        return False, f"execution error: {pred.error or gold.error}"
    mode = "spider" if example.get("source") == "spider" else "bird"
    order_matters = bool(re.search(r"order\s+by", example["gold_sql"], re.I))
    if not env.results_match(pred.rows, gold.rows, mode=mode, order_matters=order_matters):
        return False, "final SQL does not match gold"
    return True, None


def teach_all(examples, protocol="trust", *, max_turns=10, schema_mode="none", seed=0, **plan_kw):
    """Returns (kept records, {drop reason: count})."""
    kept = []
    dropped = {}
    for ex in examples:
        rec, reason = teach(ex, protocol, max_turns=max_turns, schema_mode=schema_mode, seed=seed, **plan_kw)
        if rec is None:
            dropped[reason] = dropped.get(reason, 0) + 1
        else:
            kept.append(rec)
    return kept, dropped


def write_teacher_data(examples, path, protocol="trust", **teach_kw):
    """teach_all -> JSONL at path, with a report of what was kept and why the rest was dropped; returns kept."""
    t0 = time.perf_counter()
    kept, dropped = teach_all(examples, protocol, **teach_kw)
    if not kept:
        raise ValueError(f"the teacher kept no trajectory out of {len(examples)} ({dropped})")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for rec in kept:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    print(f"teacher: kept {len(kept)}/{len(examples)} ({100 * len(kept) / len(examples):.1f}%) trajectories "
          f"in {time.perf_counter() - t0:.0f}s -> {path}")
    for reason, n in sorted(dropped.items(), key=lambda kv: -kv[1]):
        print(f"  dropped {n}: {reason}")
    return kept

# -----------------------------------------------------------------------------

if __name__ == "__main__":
    parser = cli.ArgumentParser(description=__doc__)
    parser.add_argument("--data", type=cli.existing_file, required=True, help="examples JSONL (a prepare.py output)")
    parser.add_argument("--protocol", default="trust", choices=["trust", "trail", "mtir", "skyrl"],
                        help="agent turn format (the recipe's)")
    parser.add_argument("--out", required=True, help="output JSONL of chat-message trajectories")
    parser.add_argument("--max-turns", type=cli.positive_int, default=10, help="turn budget the prompt states")
    parser.add_argument("--schema-mode", default="none", choices=env.SCHEMA_MODES,
                        help="none: unknown schema; prompt: schema in the prompt")
    parser.add_argument("--distractors", type=cli.nonneg_int, default=1, help="extra tables whose schema the teacher reads")
    parser.add_argument("--max-probes", type=cli.nonneg_int, default=2, help="filtered columns whose values it probes")
    parser.add_argument("--repair-rate", type=float, default=0.2, help="share with a failing first attempt")
    parser.add_argument("--list-tables", type=int, default=1, help="0: skip the list-tables turn (shorter)")
    parser.add_argument("--limit", type=cli.nonneg_int, default=0, help="only the first N examples (0 = all)")
    parser.add_argument("--seed", type=int, default=0, help="which plans, repairs and distractors")
    args = parser.parse_args()
    try:
        examples = env.load_examples(args.data)[: args.limit or None]
    except (FileNotFoundError, ValueError) as e:  # a bad record or a missing database
        cli.die(e)
    write_teacher_data(examples, args.out, args.protocol, max_turns=args.max_turns, schema_mode=args.schema_mode,
                       seed=args.seed, distractors=args.distractors, max_probes=args.max_probes,
                       repair_rate=args.repair_rate, list_tables=bool(args.list_tables))
