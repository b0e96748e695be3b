"""
Rewards for multi-turn text-to-SQL RL: pure component functions plus the REWARDS dict of paper recipes.

Each recipe maps (trajectory, example) -> {"full": float, "schema": float | None, **components}. "full" is the
trajectory reward; "schema" is the schema-track reward of TRUST-SQL's dual-track GRPO (None for single-track recipes).
A trajectory is anything with `.episode` (env.Episode) and `.num_turns`.

    python rewards.py --db ../shared/data/spider/database/concert_singer/concert_singer.sqlite \
        --sql "SELECT T2.name, count(*) AS cnt FROM concert AS T1 JOIN stadium AS T2 USING (stadium_id) GROUP BY 1" \
        --gold-sql "SELECT T2.name FROM concert AS T1 JOIN stadium AS T2 ON T1.stadium_id = T2.stadium_id"

Adding a reward shape = one function `def my_reward(traj, example) -> dict` + one entry in REWARDS.
"""
import functools
import json
import math
import sqlite3
from pathlib import Path

import sqlglot
from sqlglot import exp
from sqlglot.errors import OptimizeError, SqlglotError
from sqlglot.optimizer.qualify import qualify
from sqlglot.optimizer.scope import traverse_scope
from sqlglot.schema import MappingSchema
from sqlglot.tokens import TokenType

from env import quote_ident, results_match, run_many, run_sql

# -----------------------------------------------------------------------------
# K*: the minimal schema (tables, "table.column") a SQL query touches

@functools.lru_cache(maxsize=None)
def db_schema(db_path: str) -> dict:
    """{table: {column: type}} of a SQLite file, names lower-cased (SQLite identifiers are case-insensitive)."""
    if not Path(db_path).is_file():
        raise FileNotFoundError(f"database {db_path} not found; pass the example's absolute db_path "
                                "(env.load_examples resolves it)")
    con = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)  # read-only: the schema reader never writes
    try:
        names = [r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type IN ('table', 'view')")]
        return {n.lower(): {c[1].lower(): c[2] or "TEXT" for c in con.execute(f"PRAGMA table_info({quote_ident(n)})")}
                for n in names}
    finally:
        con.close()


@functools.lru_cache(maxsize=None)
def db_columns(db_path: str) -> frozenset:
    """Every column name of the database, lower-cased, whatever its table."""
    return frozenset(c for cols in db_schema(db_path).values() for c in cols)


@functools.lru_cache(maxsize=None)
def _qualify_schema(db_path: str) -> MappingSchema:
    # what qualify() builds from the dict on every call, built once per database (half the teacher's time with 30+
    # distractor tables); qualify only reads it
    return MappingSchema(db_schema(db_path), dialect="sqlite")


MAX_BARE_JOINS = 8


def bare_joins(sql: str) -> int:
    """JOINs with no ON/USING of their own before the next JOIN at their level. sqlglot tries each such JOIN as the
    start of a nested join (a JOIN b JOIN c ON .. ON ..) and backtracks, so its parse time doubles with every one:
    a model's 19-JOIN loop took 11 s to parse, and 30 would take hours. Linear: tokens only. 0 for SQL that does
    not even tokenize (an unclosed quote): the parser then fails on it at once."""
    try:
        tokens = sqlglot.tokenize(sql, read="sqlite")
    except SqlglotError:
        return 0
    depth = 0
    pending = {}  # pending[d]: the last JOIN at paren depth d still lacks its ON/USING
    bare = 0
    for kind in (t.token_type for t in tokens):
        if kind == TokenType.L_PAREN:
            depth += 1
        elif kind == TokenType.R_PAREN:
            bare += pending.pop(depth, False)
            depth -= 1
        elif kind == TokenType.JOIN:
            bare += pending.get(depth, False)
            pending[depth] = True
        elif kind in (TokenType.ON, TokenType.USING):
            pending[depth] = False
    return bare + sum(pending.values())


def sqlite_string_names(sql: str, db_path: str) -> set:
    """Names in sql that SQLite reads as string literals, lower-cased: double-quoted ones no column of the database
    has (WHERE airline = "JetBlue Airways", which Spider's gold SQL relies on). A `backticked` or [bracketed] name
    is always an identifier, so an unknown one is an error; sqlglot's tree marks all three alike as quoted."""
    try:
        tokens = sqlglot.tokenize(sql, read="sqlite")
    except SqlglotError:
        return set()
    quoted = {t.text.lower() for t in tokens if t.token_type == TokenType.IDENTIFIER and sql[t.start] == '"'}
    return quoted - db_columns(db_path)


@functools.lru_cache(maxsize=65536)
def _extract_schema(sql: str, db_path: str) -> tuple[frozenset, frozenset]:
    if bare_joins(sql) > MAX_BARE_JOINS:  # model output: refuse what sqlglot would take hours to parse
        raise ValueError(f"more than {MAX_BARE_JOINS} JOINs without ON/USING: too costly to parse")
    tree = sqlglot.parse_one(sql, read="sqlite")
    strings = sqlite_string_names(sql, db_path)
    for col in list(tree.find_all(exp.Column)):
        if not col.table and col.name.lower() in strings:
            col.replace(exp.Literal.string(col.name))
    # qualify resolves aliases/CTEs/subqueries against the real schema; `*` stays a star (adds no columns),
    # and columns it cannot resolve (hallucinated) are kept rather than raising
    opts = dict(dialect="sqlite", expand_stars=False, validate_qualify_columns=False, quote_identifiers=False,
                identify=False)
    try:
        tree = qualify(tree.copy(), schema=_qualify_schema(db_path), **opts)
    except OptimizeError:  # e.g. `a.wages` on a table without `wages`: resolve aliases without the schema
        tree = qualify(tree, **opts)
    tables = set()
    columns = set()
    for scope in traverse_scope(tree):
        real = {alias: src.name.lower() for alias, src in scope.sources.items() if isinstance(src, exp.Table)}
        tables.update(real.values())
        for col in scope.columns:
            if col.table in real:
                columns.add(f"{real[col.table]}.{col.name.lower()}")
            elif not col.table and len(real) == len(scope.sources) == 1:
                # unresolvable column in a single-table scope (not a SELECT alias, qualify drops those)
                columns.add(f"{next(iter(real.values()))}.{col.name.lower()}")
            # columns of a CTE / derived table are counted where that subquery reads its real tables
    return frozenset(tables), frozenset(columns)


def extract_schema(sql: str, db_path: str) -> dict:
    """The tables and "table.column"s a query reads, lower-cased. Raises sqlglot's ParseError on bad SQL.

    >>> extract_schema("SELECT T2.name FROM concert AS T1 JOIN stadium AS T2 ON T1.stadium_id = T2.stadium_id", db)
    {'tables': {'concert', 'stadium'}, 'columns': {'stadium.name', 'concert.stadium_id', 'stadium.stadium_id'}}
    """
    tables, columns = _extract_schema(sql, str(db_path))
    return {"tables": set(tables), "columns": set(columns)}


def schema_items(schema: dict) -> set:
    """Flatten {"tables", "columns"} into one set of items, the S / K of the Jaccard and match rewards."""
    return set(schema["tables"]) | set(schema["columns"])


def safe_schema_items(sql: str | None, db_path: str) -> set:
    """schema_items of untrusted (model) SQL; unparseable or missing SQL touches nothing."""
    if not sql:
        return set()
    try:
        return schema_items(extract_schema(sql, db_path))
    except (SqlglotError, ValueError, KeyError, RecursionError):
        return set()


def proposed_schema_items(proposed: dict | None) -> set:
    """Normalise a TRUST <schema> proposal {"tables": [...], "columns": {table: [col]}, "joins": [...]} to items.
    Model output is untrusted: tolerate a list of "table.column" strings, quoting and odd types."""
    if not isinstance(proposed, dict):
        return set()

    def clean(s):
        return str(s).strip().strip('"`[]').lower()
    tables = {clean(t) for t in proposed.get("tables") or [] if isinstance(t, str)}
    columns = set()
    cols = proposed.get("columns") or {}
    if isinstance(cols, dict):
        for table, names in cols.items():
            tables.add(clean(table))
            for name in names if isinstance(names, list) else []:
                if isinstance(name, str) and clean(name) != "*":
                    columns.add(f"{clean(table)}.{clean(name)}")
    elif isinstance(cols, list):
        columns = {".".join(clean(p) for p in c.split(".", 1)) for c in cols if isinstance(c, str) and "." in c}
    return tables | columns

# -----------------------------------------------------------------------------
# execution: run the prediction once, the gold once per (db_path, gold_sql)

SCORE_MAX_ROWS = 1_000_000  # full results: a truncated one would make set comparison unreliable
GOLD_CACHE: dict = {}  # (db_path, gold_sql) -> SQLResult; databases are read-only, so it never goes stale


def gold_results(examples: list[dict], timeout_s: float = 30.0, workers: int = 4) -> list:
    """Gold results of many examples, each (db_path, gold_sql) executed once (in parallel) and cached for the whole
    run; a failing gold query comes back with its .error (eval reports it)."""
    todo = sorted({(ex["db_path"], ex["gold_sql"]) for ex in examples} - GOLD_CACHE.keys())
    for job, res in zip(todo, run_many(todo, workers=workers, timeout_s=timeout_s, max_rows=SCORE_MAX_ROWS)):
        GOLD_CACHE[job] = res
    return [GOLD_CACHE[(ex["db_path"], ex["gold_sql"])] for ex in examples]


def gold_result(db_path: str, gold_sql: str):
    """One gold result from the same cache; during training a failing gold query is a data error."""
    result = gold_results([{"db_path": db_path, "gold_sql": gold_sql}])[0]
    if result.error:
        raise ValueError(f"gold SQL fails on {db_path}: {result.error}\n{gold_sql}\nfix or drop this example")
    return result


def gold_order_matters(gold_sql: str) -> bool:
    """Test-suite rule: row order counts when the gold query sorts. Only the outermost ORDER BY counts, since an
    ORDER BY ... LIMIT inside a subquery does not order the final rows."""
    try:
        tree = sqlglot.parse_one(gold_sql, read="sqlite")
    except SqlglotError:
        return "order by" in gold_sql.lower()  # the test-suite evaluator's own substring rule
    return tree.args.get("order") is not None


def is_correct(pred, gold, scoring: str, order_matters: bool) -> bool:
    """pred, gold: SQLResult (pred None = no final SQL). bird: set equality; spider: test-suite semantics."""
    if pred is None or pred.error is not None or gold.error is not None:
        return False
    return results_match(pred.rows, gold.rows, mode=scoring, order_matters=order_matters and scoring == "spider")


def execution_outcome(pred_sql: str | None, example: dict) -> str:
    """"correct" | "wrong" (executes, different result) | "error" (fails / times out) | "missing" (no answer)."""
    if not pred_sql or not pred_sql.strip():
        return "missing"
    pred = run_sql(example["db_path"], pred_sql, max_rows=SCORE_MAX_ROWS)
    if pred.error:
        return "error"
    gold = gold_result(example["db_path"], example["gold_sql"])
    mode = "spider" if example.get("source") == "spider" else "bird"
    return "correct" if is_correct(pred, gold, mode, gold_order_matters(example["gold_sql"])) else "wrong"


def exec_trust(outcome: str) -> float:
    """TRUST-SQL eq. 1: 1.0 correct, 0.2 executable but wrong, 0.0 not executable / no answer."""
    return {"correct": 1.0, "wrong": 0.2}.get(outcome, 0.0)


def exec_binary(outcome: str) -> float:
    """SQL-Trail eq. 3: 1 iff the result matches the gold result."""
    return float(outcome == "correct")


def exec_arctic(outcome: str) -> float:
    """Arctic-Text2SQL-R1: 1 correct, 0.1 executable but wrong, 0 otherwise."""
    return {"correct": 1.0, "wrong": 0.1}.get(outcome, 0.0)


def syntax_reward(outcome: str) -> float:
    """SQL-Trail eq. 8: 1 iff the predicted SQL executes."""
    return float(outcome in ("correct", "wrong"))


def mtir_exec_result(outcome: str, format_ok: bool) -> tuple[float, float]:
    """MTIR-SQL eqs. 6-7 -> (R_e, R_r). A bad format earns 0 for both; a failing SQL gets no result reward."""
    if not format_ok or outcome == "missing":
        return 0.0, 0.0
    if outcome == "error":
        return -0.1, 0.0
    return 0.1, (1.0 if outcome == "correct" else -1.0)


def skyrl_reward(outcome: str, format_ok: bool) -> float:
    """SkyRL-SQL §4.1: -1 invalid format, 0 valid but wrong, 1 valid and correct."""
    if not format_ok:
        return -1.0
    return 1.0 if outcome == "correct" else 0.0

# -----------------------------------------------------------------------------
# format: per-turn validity comes from env's parse_turn (Action.valid), the single place that knows the tags

def format_trust(episode) -> float:
    """TRUST-SQL eq. 2: 0.1 iff every turn is valid, all four actions appear and no observation is an error.
    In schema_mode explore_turn the prompt already holds an explore_schema turn (not sampled, so not in actions)."""
    prefilled = {"explore_schema"} if episode.schema_mode == "explore_turn" else set()
    names = {a.name for a in episode.actions} | prefilled
    four = {"explore_schema", "propose_schema", "generate_sql", "confirm_answer"}
    ok = all(episode.turn_valid) and four <= names and all(e is None for e in episode.exec_errors)
    return 0.1 if ok else 0.0


def format_final(episode) -> float:
    """SQL-Trail eq. 11: 1 iff the final output is a well-formed answer turn (reasoning + solution tags), the
    protocol's own answer action (TRUST's is confirm_answer)."""
    last = episode.actions[-1] if episode.actions else None
    return float(last is not None and last.name == episode.protocol.answer_action and last.valid)


def format_all_turns(episode) -> bool:
    """MTIR / SkyRL format: every turn follows the tag order and the trajectory ends with a final answer."""
    return bool(episode.actions) and all(episode.turn_valid) and format_final(episode) == 1.0


def format_mtir(episode) -> float:
    """MTIR-SQL eq. 5: +0.1 correct tag order, -0.1 otherwise."""
    return 0.1 if format_all_turns(episode) else -0.1

# -----------------------------------------------------------------------------
# similarity shaping (SQL-Trail A.4) and the turn budget reward

def sql_tokens(sql: str) -> list[str]:
    """SQL tokens via sqlglot's SQLite tokenizer; keywords/identifiers lower-cased, string literals kept as written.
    SQLite's, so that a `quoted name` (BIRD, the gym) is one token, as "name" and [name] are: the generic tokenizer
    splits `School Name` into `, school, name, `, and the name then half-matches `School City`."""
    return [t.text if t.token_type == TokenType.STRING else t.text.lower()
            for t in sqlglot.tokenize(sql, read="sqlite")]


def bigram_jaccard(pred_sql: str | None, gold_sql: str) -> float:
    """SQL-Trail eq. 9: Jaccard of the token-bigram sets. "SELECT name FROM student" vs "... teacher" -> 2/4."""
    try:
        pred = sql_tokens(pred_sql or "")
    except SqlglotError:  # untrusted text that does not even tokenize (e.g. an unclosed quote)
        return 0.0
    gold = sql_tokens(gold_sql)
    bp = set(zip(pred, pred[1:]))
    bg = set(zip(gold, gold[1:]))
    return len(bp & bg) / len(bp | bg) if bp | bg else 0.0


def schema_jaccard(pred_items: set, gold_items: set) -> float:
    """SQL-Trail eq. 10: |S_pred ∩ S_gold| / |S_pred ∪ S_gold|. {employees, salary} vs {employees, wages} -> 1/3."""
    union = pred_items | gold_items
    return len(pred_items & gold_items) / len(union) if union else 0.0


# every dataset's labels: Spider and the gym (easy/medium/hard/extra), BIRD (simple/moderate/challenging), SynSQL
# (Simple/Moderate/Complex/Highly Complex). "unknown" (a record without a label) gets the hard rule: no reward for
# being fast unless correct, the one rule that cannot pay a wrong answer.
LEVELS = {"easy": "simple", "simple": "simple", "medium": "medium", "moderate": "medium", "hard": "hard",
          "challenging": "hard", "extra": "hard", "complex": "hard", "highly complex": "hard", "unknown": "hard"}


def difficulty_score(pass_rate: float) -> float:
    """SQL-Trail's S(q) (eq. 13): the pass rate when the policy sometimes solves q, else 1 (a group of its rollouts
    would carry no signal). Lowest first: hard but solvable."""
    return pass_rate if 0 < pass_rate < 1 else 1.0


def turn_budget(difficulty: str, max_turns: int) -> int:
    """Per-question turns for --adaptive-turns: our reading of SQL-Trail's difficulty-aware budget (eq. 7 pays simple
    questions for <= 2 turns, medium for <= 3, hard ones for < T): simple a third of T (at least 3), medium half (at
    least 4), hard and unlabelled all of T; never more than T."""
    floor, share = {"simple": (3, 1 / 3), "medium": (4, 1 / 2)}.get(LEVELS.get(str(difficulty).strip().lower()),
                                                                   (max_turns, 1.0))
    return min(max_turns, max(floor, math.ceil(max_turns * share)))


def turn_reward(difficulty: str, turns: int, exec_ok: bool, budget: int, answered: bool = True) -> float:
    """SQL-Trail eq. 7: 1 if simple and t<=2, medium and t<=3, or hard/extra and correct and t<T; else 0.
    t is "the finishing turn number" (A.4), and a trajectory finishes with its <solution> (Algorithm 1): one that
    never answered, cut by a limit or out of turns, has no finishing turn and earns 0. Labels of every dataset we
    load are accepted, in any case (LEVELS)."""
    level = LEVELS.get(str(difficulty).strip().lower())
    if level is None:
        raise ValueError(f"unknown difficulty {difficulty!r}; expected one of {sorted(LEVELS)} (any case)")
    if not answered:
        return 0.0
    if level == "simple":
        return float(turns <= 2)
    if level == "medium":
        return float(turns <= 3)
    return float(exec_ok and turns < budget)

# -----------------------------------------------------------------------------
# TRUST-SQL schema reward f_match (§3.3, §5.2)

def schema_match(proposed: set, gold: set, dense: bool = False) -> float:
    """Sparse: 1 iff the proposal equals K* (full recall and full precision). Dense: full recall is a hard gate,
    then the reward is the precision |K^ ∩ K*| / |K^|, so every unneeded item costs a little."""
    if not gold or not gold <= proposed:
        return 0.0
    precision = len(gold) / len(proposed)
    return precision if dense else float(precision == 1.0)


def trust_schema_reward(proposed: set, gold: set, outcome: str, variant: str = "sparse_coupled") -> float:
    """Variants of §5.2: sparse_coupled (default; paid only when R_exec = 1.0), sparse_uncoupled, dense_coupled."""
    if variant not in ("sparse_coupled", "sparse_uncoupled", "dense_coupled"):
        raise ValueError(f"unknown f_match variant {variant!r}; use sparse_coupled, sparse_uncoupled or dense_coupled")
    match = schema_match(proposed, gold, dense=variant.startswith("dense"))
    coupled = variant.endswith("_coupled")
    return match * (exec_trust(outcome) == 1.0) if coupled else match

# -----------------------------------------------------------------------------
# recipes: (traj, example) -> {"full", "schema", **components}

def gold_items(example: dict) -> set:
    """K* of the example's gold SQL (cached by extract_schema)."""
    try:
        return schema_items(extract_schema(example["gold_sql"], example["db_path"]))
    except SqlglotError as e:
        raise ValueError(f"example {example.get('id')!r}: sqlglot cannot read the gold SQL ({e}); fix it or drop the "
                         "example in its data/*/prepare.py") from e


def trust_reward(traj, example, variant="sparse_coupled"):
    """TRUST-SQL eq. 4: full = R_exec + R_fmt; schema = f_match(K^, K*) on the schema track."""
    ep = traj.episode
    outcome = execution_outcome(ep.final_sql, example)
    r_exec = exec_trust(outcome)
    r_fmt = format_trust(ep)
    proposed = proposed_schema_items(ep.proposed_schema) if ep.propose_turn >= 0 else set()
    r_schema = trust_schema_reward(proposed, gold_items(example), outcome, variant)
    return {"full": r_exec + r_fmt, "schema": r_schema, "exec": r_exec, "format": r_fmt,
            "correct": float(outcome == "correct")}


def trail_reward(traj, example):
    """SQL-Trail eq. 4: 5·exec + 2·turns + schema + bigram + syntax + format."""
    ep = traj.episode
    outcome = execution_outcome(ep.final_sql, example)
    parts = {
        "exec": exec_binary(outcome),
        "turns": turn_reward(example["difficulty"], traj.num_turns, outcome == "correct", ep.max_turns,
                             answered=ep.final_sql is not None),
        "schema_jaccard": schema_jaccard(safe_schema_items(ep.final_sql, example["db_path"]), gold_items(example)),
        "bigram": bigram_jaccard(ep.final_sql, example["gold_sql"]),
        "syntax": syntax_reward(outcome),
        "format": format_final(ep),
    }
    full = 5 * parts["exec"] + 2 * parts["turns"] + parts["schema_jaccard"] + parts["bigram"] + parts["syntax"] \
        + parts["format"]
    return {"full": full, "schema": None, **parts, "correct": float(outcome == "correct")}


def mtir_reward(traj, example):
    """MTIR-SQL eqs. 5-7: R_f (±0.1) + R_e (+0.1/0/-0.1) + R_r (+1/0/-1)."""
    ep = traj.episode
    outcome = execution_outcome(ep.final_sql, example)
    fmt_ok = format_all_turns(ep)
    r_exec, r_result = mtir_exec_result(outcome, fmt_ok)
    r_fmt = format_mtir(ep)
    return {"full": r_fmt + r_exec + r_result, "schema": None, "format": r_fmt, "exec": r_exec, "result": r_result,
            "correct": float(outcome == "correct")}


def skyrl_recipe(traj, example):
    """SkyRL-SQL §4.1: -1 / 0 / 1."""
    ep = traj.episode
    outcome = execution_outcome(ep.final_sql, example)
    r = skyrl_reward(outcome, format_all_turns(ep))
    return {"full": r, "schema": None, "correct": float(outcome == "correct")}


def arctic_reward(traj, example):
    """Arctic-Text2SQL-R1: 1 / 0.1 / 0 on the final answer alone."""
    outcome = execution_outcome(traj.episode.final_sql, example)
    return {"full": exec_arctic(outcome), "schema": None, "correct": float(outcome == "correct")}


REWARDS = {
    "trust": trust_reward,
    "trust_sparse_uncoupled": functools.partial(trust_reward, variant="sparse_uncoupled"),
    "trust_dense_coupled": functools.partial(trust_reward, variant="dense_coupled"),
    "trail": trail_reward,
    "mtir": mtir_reward,
    "skyrl": skyrl_recipe,
    "arctic": arctic_reward,
}

# -----------------------------------------------------------------------------

if __name__ == "__main__":
    from cli import ArgumentParser
    parser = ArgumentParser(description=__doc__)
    parser.add_argument("--db", required=True, help="SQLite file the query runs against")
    parser.add_argument("--sql", required=True, help="query whose minimal schema K* to print")
    parser.add_argument("--gold-sql", default=None, help="also print bigram and schema Jaccard against this query")
    args = parser.parse_args()
    schema = extract_schema(args.sql, args.db)
    print(json.dumps({k: sorted(v) for k, v in schema.items()}, indent=2))
    if args.gold_sql:
        gold = schema_items(extract_schema(args.gold_sql, args.db))
        print(f"bigram_jaccard {bigram_jaccard(args.sql, args.gold_sql):.4f}  "
              f"schema_jaccard {schema_jaccard(schema_items(schema), gold):.4f}")
