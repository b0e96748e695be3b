"""
The SQLite tool environment, the agent's whole world: the read-only sandbox every query of the agent, the teacher,
the rewards and the scorers goes through, result comparison, what the agent sees (observations, schema text), the
four agent protocols (TRUST-SQL, SQL-Trail, MTIR-SQL, SkyRL-SQL) and a small Episode state machine. Pure Python +
sqlite3, no model involved.

    python env.py data/gym/dev.jsonl --protocol trail --schema-mode prompt   # print one episode's prompt

    >>> r = run_sql("db.sqlite", "SELECT name FROM singer")       # never raises; r.error holds any failure
    >>> ep = new_episode(example, "trail", max_turns=5)
    >>> obs, done = step(ep, "<reasoning>count them</reasoning><sql>SELECT count(*) FROM singer</sql>")
"""
import json
import os
import re
import sqlite3
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Callable

from cli import ArgumentParser, die, existing_file, nonneg_int, positive_int

# -----------------------------------------------------------------------------
# The sandbox: guarantees in docs/environment.md. The database file is opened read-only and never changed; only
# reads run (an authorizer, not a keyword list); every query has a wall-clock deadline; results, errors and values
# are bounded.

TIMEOUT_S = 5.0
MAX_SQL_CHARS = 100_000         # longer SQL is refused before SQLite sees it
MAX_VALUE_BYTES = 1_000_000     # SQLITE_LIMIT_LENGTH: any string/blob/row; randomblob(1e9) fails cleanly
MAX_LIKE_PATTERN = 40           # SQLITE_LIMIT_LIKE_PATTERN_LENGTH, bytes (see "one SQLite step" below)
MAX_EXPR_DEPTH = 200            # SQLITE_LIMIT_EXPR_DEPTH (SQLite's default is 1000)
MAX_RESULT_BYTES = 32_000_000   # text/blob bytes fetched per result before it is cut (and marked truncated)
MAX_ERROR_CHARS = 500           # errors are cut here: one naming a 90,000-character table is that long
LIMITS = ((sqlite3.SQLITE_LIMIT_LENGTH, MAX_VALUE_BYTES), (sqlite3.SQLITE_LIMIT_SQL_LENGTH, MAX_SQL_CHARS * 4),
          (sqlite3.SQLITE_LIMIT_LIKE_PATTERN_LENGTH, MAX_LIKE_PATTERN),
          (sqlite3.SQLITE_LIMIT_EXPR_DEPTH, MAX_EXPR_DEPTH), (sqlite3.SQLITE_LIMIT_ATTACHED, 0))  # 0: no VACUUM INTO
READ_PRAGMAS = {"table_info", "table_xinfo", "table_list", "index_list", "index_info", "index_xinfo",
                "foreign_key_list"}  # metadata only; database_list is left out because it shows the file path
# From `pragma function_list` / `module_list` of the SQLite we ship: fts3_tokenizer returns a library address and
# takes a pointer (ENABLE_FTS3_TOKENIZER), fts5() hands out an API pointer, rtreenode/rtreedepth decode raw blobs,
# sqlite_log writes to the process log, dbstat/sqlite_stmt show file pages and engine internals. No agent needs them.
# (readfile/writefile/edit and sqlite_dbpage are not compiled in.)
DENIED_FUNCTIONS = {"load_extension", "fts3_tokenizer", "fts5", "rtreenode", "rtreedepth", "sqlite_log"}
DENIED_TABLES = {"dbstat", "sqlite_stmt"}
# One SQLite step: neither the deadline nor interrupt() stops work inside a function call (instr() of two 1 MB strings
# ran 4.6 s after an interrupt at 0.3 s), so each call is bounded. LIKE costs ~1.5 ns x len(value) x len(pattern):
# the pattern limit holds a call on a 1 MB value near 60 ms. These cost len(arg1) x len(arg2) (GLOB's [...] 2.3 ns a
# step, hence here) and get a guard that refuses a call over its budget, ~50 ms by measurement (instr/replace 0.02 ns
# per byte pair, up to 16 per character pair; trim 1.6 ns; json_patch 3 ns per key pair), else runs SQLite's own.
# Before: instr/replace of 1 MB by 0.5 MB 4.7-4.9 s, trim() by an 80k-character set >30 s, json_patch of 50k keys 9 s.
# Guards are installed only for a query whose text names one (always: 10% slower queries); views in the database
# may call these functions too, but only on its own values (views do not see the query's CTEs).
GUARDED = {"instr": (2, 1.5e8), "replace": (3, 1.5e8), "glob": (2, 2e7), "trim": (2, 2e7), "ltrim": (2, 2e7),
           "rtrim": (2, 2e7), "json_patch": (2, 3e8)}
FIRST_WORDS = ("SELECT", "WITH", "VALUES", "PRAGMA", "EXPLAIN")
# The first word after whitespace and comments. Linear time on hostile input: the group can match empty, so the
# regex never fails and never backtracks; an unclosed /* comment runs to the end.
FIRST_WORD = re.compile(r"(?:\s+|--[^\n]*|/\*.*?(?:\*/|\Z))*(\w{0,40})", re.S)
ALLOWED = {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_RECURSIVE}
_ACTION_NAMES = {getattr(sqlite3, f"SQLITE_{k}"): k.replace("_", " ") for k in (
    "CREATE_INDEX CREATE_TABLE CREATE_TEMP_INDEX CREATE_TEMP_TABLE CREATE_TEMP_TRIGGER CREATE_TEMP_VIEW "
    "CREATE_TRIGGER CREATE_VIEW DELETE DROP_INDEX DROP_TABLE DROP_TEMP_INDEX DROP_TEMP_TABLE DROP_TEMP_TRIGGER "
    "DROP_TEMP_VIEW DROP_TRIGGER DROP_VIEW INSERT TRANSACTION UPDATE ATTACH DETACH ALTER_TABLE REINDEX ANALYZE "
    "CREATE_VTABLE DROP_VTABLE SAVEPOINT").split()}


@dataclass
class SQLResult:
    columns: list[str]
    rows: list[tuple]
    error: str | None
    truncated: bool
    elapsed_s: float


def _authorizer(reasons):
    # Second wall after mode=ro: reads only. `reasons` collects the refusal, to name it in the error.
    def auth(action, arg1, arg2, db_name, source):
        if action in ALLOWED and (action != sqlite3.SQLITE_READ or arg1.lower() not in DENIED_TABLES):
            return sqlite3.SQLITE_OK
        if action == sqlite3.SQLITE_FUNCTION and arg2 not in DENIED_FUNCTIONS:
            return sqlite3.SQLITE_OK
        if action == sqlite3.SQLITE_PRAGMA and arg1 in READ_PRAGMAS:
            return sqlite3.SQLITE_OK
        if action == sqlite3.SQLITE_UPDATE and arg1 == "sqlite_master":
            return sqlite3.SQLITE_IGNORE  # SQLite asks this when a pragma_* table first loads; IGNORE = never write
        what = {sqlite3.SQLITE_PRAGMA: f"PRAGMA {arg1}", sqlite3.SQLITE_FUNCTION: f"{arg2}()",
                sqlite3.SQLITE_READ: arg1}.get(action) or _ACTION_NAMES.get(action, "this statement")
        reasons.append(f"not authorized: {what} (the database is read-only; only SELECT, WITH and metadata PRAGMAs "
                       f"such as table_info are allowed)")
        return sqlite3.SQLITE_DENY
    return auth


def _guard(name, nargs, budget, reasons):
    sql = f"SELECT {name}({', '.join('?' * nargs)})"

    def guarded(*args):
        a, b = (len(v) if isinstance(v, (str, bytes)) else 24 for v in args[:2])
        if a * b > budget:
            reasons.append(f"{name}() on values this long ({a:,} and {b:,} characters) takes too long; shorten one")
            raise ValueError(name)
        conn = getattr(_local, "conn", None)  # SQLite's own function, on this thread's private in-memory db
        if conn is None:
            conn = _local.conn = sqlite3.connect(":memory:")
            conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, MAX_VALUE_BYTES)
            conn.text_factory = lambda b: b.decode("utf-8", "replace")  # replace(CAST(x AS BLOB), ..) is any bytes
        try:
            return conn.execute(sql, args).fetchone()[0]
        except sqlite3.Error as e:  # e.g. "string or blob too big": SQLite's own words, as without the guard
            reasons.append(str(e))
            raise
    return guarded

# --- the watchdog: one thread interrupts each connection at its deadline. SQLite checks for an interrupt at every
# row, so a heavy function on every row stops within one call; the progress handler this replaces ran every 20,000
# VM steps (randomblob(1e6) per row: 1.7 s late). A threading.Timer per query cost ~1.5 ms; this, a dict entry.


def _watch_init():  # also in a forked child, which has no watchdog thread and may hold a copy of a taken lock
    global _watched, _watch_lock, _watch_wake, _watch_thread, _watch_next, _local
    _watched, _watch_lock, _watch_wake, _watch_thread = {}, threading.Lock(), threading.Event(), None
    _watch_next, _local = float("inf"), threading.local()


_watch_init()
os.register_at_fork(after_in_child=_watch_init)


def _watchdog():
    global _watch_next
    while True:
        with _watch_lock:
            now = time.monotonic()
            for conn, (deadline, timed_out) in list(_watched.items()):
                if now >= deadline:  # under the lock: _open unwatches before close, so conn is still open
                    timed_out.append(True)
                    conn.interrupt()
                    del _watched[conn]
            _watch_next = min([d for d, _ in _watched.values()] + [now + 60.0])  # inf would overflow wait()
            _watch_wake.clear()
        _watch_wake.wait(_watch_next - now)


def _watch(conn, deadline, timed_out):
    global _watch_thread, _watch_next
    with _watch_lock:
        if _watch_thread is None:
            _watch_thread = threading.Thread(target=_watchdog, name="sqlrl-sql-watchdog", daemon=True)
            _watch_thread.start()
        _watched[conn] = (deadline, timed_out)
        # it sleeps until _watch_next: only an earlier deadline wakes it (waking it per query cost 20% throughput)
        wake, _watch_next = deadline < _watch_next, min(deadline, _watch_next)
    if wake:
        _watch_wake.set()


@contextmanager
def _open(db_path, deadline, reasons, timed_out, guard=False):
    """A read-only, locked-down connection, always closed on exit (an unclosed one is how temp files pile up).
    mode=ro refuses writes; immutable=1 also skips locking and never creates -journal/-wal/-shm files (datasets are
    static). Only a db with a -wal file beside it is opened without immutable, so SQLite reads the pages in its WAL;
    then readonly_shm=1 keeps SQLite from creating a -shm beside an orphaned -wal (it fails to open instead), and the
    busy timeout (Python's default: 5 s) ends any wait for another process's lock at the deadline."""
    path = os.path.abspath(os.fspath(db_path))
    flags = "&readonly_shm=1" if os.path.exists(path + "-wal") else "&immutable=1"
    try:
        conn = sqlite3.connect(f"{_uri(path)}?mode=ro{flags}", uri=True, isolation_level=None,
                               timeout=min(max(deadline - time.monotonic(), 0.0), 1e6))
    except sqlite3.OperationalError:
        if not os.path.isfile(path):
            raise FileNotFoundError("database file not found") from None
        raise
    try:
        _watch(conn, deadline, timed_out)
        # Big sorts spill to SQLite temp files, which are unlinked the moment they are opened (never left behind,
        # freed on close). temp_store=MEMORY would keep a runaway ORDER BY's every row in RAM instead: measured
        # 458 MB after 5 s and 0.6 s past the deadline just to free it, vs 13 MB and 0.06 s with files.
        conn.execute("PRAGMA temp_store = FILE")
        for limit, value in LIMITS:
            conn.setlimit(limit, value)
        if hasattr(conn, "enable_load_extension"):
            conn.enable_load_extension(False)
        for name, (nargs, budget) in GUARDED.items() if guard else ():
            conn.create_function(name, nargs, _guard(name, nargs, budget, reasons), deterministic=True)
        conn.set_authorizer(_authorizer(reasons))
        yield conn
    finally:
        with _watch_lock:
            _watched.pop(conn, None)
        conn.close()


@lru_cache(maxsize=4096)
def _uri(abs_path):  # percent-encodes odd characters; cached because it is ~15% of a simple query's time
    return Path(abs_path).as_uri()


def _fetch(conn, sql, max_rows):
    cur, rows, nbytes, truncated = conn.execute(sql), [], 0, False
    for row in cur:
        if len(rows) >= max_rows or nbytes > MAX_RESULT_BYTES:
            truncated = True
            break
        for v in row:
            if v.__class__ is str or v.__class__ is bytes:
                nbytes += len(v)
        rows.append(row)
    return [d[0] for d in cur.description or []], rows, truncated


def _refusal(sql):
    """Why `sql` is refused before SQLite sees it, or None."""
    if not isinstance(sql, str):
        return f"the query must be text, got {type(sql).__name__}"
    if len(sql) > MAX_SQL_CHARS:
        return f"query too long ({len(sql)} characters, limit {MAX_SQL_CHARS})"
    if "\x00" in sql:
        return "the query contains a NUL character"
    m = FIRST_WORD.match(sql)
    word = m.group(1).upper() or sql[m.end():m.end() + 1]
    if word == "":
        return "empty query: write one SELECT statement"
    if word not in FIRST_WORDS:
        return f"only read-only queries are allowed (SELECT, WITH, VALUES, metadata PRAGMA, EXPLAIN), not {word}"
    return None


def run_sql(db_path, sql, timeout_s=TIMEOUT_S, max_rows=10_000) -> SQLResult:
    """Run one read-only statement within timeout_s + 0.2 s. Never raises: every failure comes back in .error
    (at most MAX_ERROR_CHARS, without file paths)."""
    t0 = time.monotonic()
    error, reasons, timed_out = _refusal(sql), [], []
    columns, rows, truncated = [], [], False
    try:
        if error is None:
            if not float(timeout_s) >= 0:  # NaN would never time out
                raise ValueError(f"timeout_s must be a number >= 0, got {timeout_s!r}")
            guard = any(map(sql.lower().__contains__, GUARDED))
            with _open(db_path, t0 + float(timeout_s), reasons, timed_out, guard) as conn:
                try:
                    columns, rows, truncated = _fetch(conn, sql, int(max_rows))
                except sqlite3.OperationalError as e:
                    if "decode" not in str(e) or timed_out:
                        raise
                    # Non-UTF-8 text in the database: fetch again, replacing the undecodable bytes.
                    conn.text_factory = lambda b: b.decode("utf-8", "replace")
                    columns, rows, truncated = _fetch(conn, sql, int(max_rows))
    except Exception as e:  # noqa: BLE001 - untrusted SQL: anything that goes wrong becomes the agent's error text
        columns, rows, truncated = [], [], False
        error = (f"query timed out after {float(timeout_s)!r} s" if timed_out else reasons[0] if reasons else
                 "the query is not valid UTF-8 text" if isinstance(e, UnicodeEncodeError) else
                 "out of memory: the result is too large" if isinstance(e, MemoryError) else
                 f"{'/'.join(GUARDED)} got text that is not valid UTF-8 (CAST it AS BLOB first)"
                 if "user-defined function" in str(e) else _clean_error(e, db_path))
    return SQLResult(columns, rows, error and _cap(error, MAX_ERROR_CHARS), truncated,
                     time.monotonic() - t0)  # elapsed includes closing


def _cap(text, n):  # every text the agent sees is bounded, whatever produced it
    return text if len(text) <= n else f"{text[:n]}... ({len(text) - n:,} more characters)"


def _clean_error(e, db_path):
    # SQLite messages name tables/columns, not files, but scrub the path anyway in case one ever leaks through.
    msg, full = str(e), os.path.abspath(str(db_path))
    for p in (full, os.path.dirname(full), str(db_path)):
        if len(p) > 1:
            msg = msg.replace(p, "<db>")
    return msg or "query failed"


def run_many(jobs, workers=4, timeout_s=TIMEOUT_S, max_rows=10_000) -> list[SQLResult]:
    """run_sql over [(db_path, sql), ...] in parallel threads (sqlite3 releases the GIL); results in job order."""
    def one(job):
        try:
            db_path, sql = job
        except (TypeError, ValueError):
            return SQLResult([], [], "each job must be a (db_path, sql) pair", False, 0.0)
        return run_sql(db_path, sql, timeout_s, max_rows)
    jobs = list(jobs)
    if workers <= 1 or len(jobs) <= 1:
        return [one(j) for j in jobs]
    with ThreadPoolExecutor(max_workers=min(workers, len(jobs))) as pool:
        return list(pool.map(one, jobs))

# -----------------------------------------------------------------------------
# result comparison


def results_match(pred_rows, gold_rows, mode="bird", order_matters=False) -> bool:
    """Does the predicted result equal the gold result? Compare full results, never a truncated observation.

    mode="bird": the official BIRD scorer, set(pred) == set(gold). Row order and duplicates are ignored; column
    order matters.
    >>> results_match([(1, 'a'), (1, 'a'), (2, 'b')], [(2, 'b'), (1, 'a')], "bird")
    True
    >>> results_match([('a', 1)], [(1, 'a')], "bird")
    False

    mode="spider": the test-suite scorer (taoyds/test-suite-sql-eval): equal bags (multisets) of rows, up to one
    column permutation applied to every row; row order counts only when order_matters (gold has ORDER BY).
    Two empty results match; different row or column counts do not.
    >>> results_match([('a', 1), ('b', 2)], [(2, 'b'), (1, 'a')], "spider")
    True
    >>> results_match([(1,), (1,), (2,)], [(1,), (2,), (2,)], "spider")
    False
    >>> results_match([(1,), (2,)], [(2,), (1,)], "spider", order_matters=True)
    False
    >>> results_match([], [], "spider"), results_match([(1,)], [(1, 1)], "spider")
    (True, False)
    """
    pred, gold = [tuple(r) for r in pred_rows], [tuple(r) for r in gold_rows]
    if mode == "bird":
        return set(pred) == set(gold)
    if mode != "spider":
        raise ValueError(f"results_match mode must be 'bird' or 'spider', got {mode!r}")
    if not pred and not gold:
        return True
    if len(pred) != len(gold):
        return False
    ncols = len(gold[0])
    if any(len(r) != ncols for r in pred) or any(len(r) != ncols for r in gold):
        return False
    # Prune: a gold column can only map to a pred column holding the same multiset of values.
    pcols = [Counter(r[i] for r in pred) for i in range(ncols)]
    gcols = [Counter(r[j] for r in gold) for j in range(ncols)]
    cands = [[i for i in range(ncols) if pcols[i] == gcols[j]] for j in range(ncols)]
    if any(not c for c in cands):
        return False
    gold_bag = None if order_matters else Counter(gold)
    pred_seq = [tuple(r[i] for r in pred) for i in range(ncols)]  # identical pred columns are interchangeable

    def search(j, perm, used):
        if j == ncols:
            permuted = [tuple(r[i] for i in perm) for r in pred]
            return permuted == gold if order_matters else Counter(permuted) == gold_bag
        tried = set()
        for i in cands[j]:
            if i in used or pred_seq[i] in tried:
                continue
            tried.add(pred_seq[i])
            if search(j + 1, perm + [i], used | {i}):
                return True
        return False
    return search(0, [], frozenset())

# -----------------------------------------------------------------------------
# what the agent sees

MAX_CELL_CHARS = 500  # a CREATE TABLE statement whole: the agent reads the schema from sqlite_master
MAX_OBS_CHARS = 6000  # any observation step() returns, before its turns note


def _cell(v):
    if v is None:
        return "NULL"
    if isinstance(v, bytes):
        return f"<blob {len(v)} bytes>"
    s = str(v).replace("\r", "\\r").replace("\n", "\\n")
    return s if len(s) <= MAX_CELL_CHARS else s[:MAX_CELL_CHARS] + "..."


def format_observation(result, max_rows=30, max_chars=4000) -> str:
    """Header row of column names, then one ' | '-separated line per row. Truncation is always spelled out."""
    if result.error is not None:  # capped again here: a result may come from elsewhere than run_sql
        return _cap(f"Error: {result.error}", max_chars)
    lines = [" | ".join(map(str, result.columns))[:max_chars]]
    if not result.rows:
        return lines[0] + "\n(0 rows)"
    size, shown = len(lines[0]), 0
    for row in result.rows[:max_rows]:
        line = " | ".join(map(_cell, row))
        if size + 1 + len(line) > max_chars:
            break
        lines.append(line)
        size += 1 + len(line)
        shown += 1
    hidden = len(result.rows) - shown
    if result.truncated:
        lines.append(f"... more than {hidden} more rows (the result was cut at {len(result.rows)} rows)")
    elif hidden:
        cut = f" (output limited to {max_chars} characters)" if shown < min(max_rows, len(result.rows)) else ""
        lines.append(f"... {hidden} more rows{cut}")
    return "\n".join(lines)


def quote_ident(name):  # backticks (SQLite and BIRD accept them) stay the same text inside a JSON tool call
    return "`" + name.replace("`", "``") + "`"


def _literal(v):  # an example value as the SQL literal the agent would type
    return "'" + v[:40].replace("'", "''") + "'" if isinstance(v, str) else _cell(v)


def _ident(name):
    return name if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name) else quote_ident(name)


def describe_schema(db_path, style="list", example_values=0) -> str:
    """Schema text for prompts: style "create" (the CREATE TABLE statements) or "list" (SQL-Trail/SkyRL style
    "Table: x" / "- col (TYPE, PRIMARY KEY)"), with foreign keys and optionally a few example values per column."""
    if style not in ("list", "create"):
        raise ValueError(f"describe_schema style must be 'list' or 'create', got {style!r}")
    path = Path(db_path).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"database not found: {path} (check the example's db_path)")
    st = path.stat()
    return _describe(str(path), st.st_mtime_ns, st.st_size, style, int(example_values))


@lru_cache(maxsize=512)  # prompts are built for every rollout; the key includes mtime so a rebuilt db is re-read
def _describe(path, mtime_ns, size, style, k):
    out, fks = [], []
    with _open(path, time.monotonic() + 60.0, [], []) as conn:
        for name, create in conn.execute("SELECT name, sql FROM sqlite_master WHERE type = 'table' AND sql IS NOT "
                                         "NULL AND name NOT LIKE 'sqlite_%' ORDER BY rowid").fetchall():
            cols = conn.execute(f"PRAGMA table_info({quote_ident(name)})").fetchall()  # (cid, name, type, nn, dflt, pk)
            examples = {}
            for c in cols if k > 0 else []:
                col = quote_ident(c[1])
                vals = conn.execute(f"SELECT DISTINCT {col} FROM {quote_ident(name)} WHERE {col} IS NOT NULL "
                                    f"LIMIT {k}").fetchall()
                examples[c[1]] = ", ".join(_literal(v[0]) for v in vals)
            for fk in conn.execute(f"PRAGMA foreign_key_list({quote_ident(name)})").fetchall():
                # (id, seq, table, from, to, ...); `to` is NULL when it means the other table's primary key
                to = fk[4]
                if not to:
                    parent_cols = conn.execute(f"PRAGMA table_info({quote_ident(fk[2])})").fetchall()
                    to = next((c[1] for c in parent_cols if c[5]), fk[3])
                fks.append(f"{_ident(name)}.{_ident(fk[3])} = {_ident(fk[2])}.{_ident(to)}")
            if style == "create":
                ex = "".join(f"\n--   {_ident(c)}: {v}" for c, v in examples.items() if v)
                out.append(create.strip() + ";" + (f"\n-- Example values:{ex}" if ex else ""))
                continue
            lines = [f"Table: {_ident(name)}"]
            for c in cols:
                attrs = [a for a in (c[2], "PRIMARY KEY" if c[5] else "") if a]
                if examples.get(c[1]):
                    attrs.append(f"examples: {examples[c[1]]}")
                lines.append(f"- {_ident(c[1])}" + (f" ({', '.join(attrs)})" if attrs else ""))
            out.append("\n".join(lines))
    if style == "list" and fks:
        out.append("Foreign keys:\n" + "\n".join(f"- {f}" for f in fks))
    return "\n\n".join(out)


REQUIRED_FIELDS = ("id", "db_id", "db_path", "question", "evidence", "gold_sql", "difficulty", "source")


def load_examples(jsonl_path) -> list[dict]:
    """Read an example JSONL file; db_path comes back absolute. Raises a clear error on any bad record."""
    jsonl_path = Path(jsonl_path)
    if not jsonl_path.is_file():
        raise FileNotFoundError(f"examples file not found: {jsonl_path} (run the dataset's prepare.py first)")
    examples, seen_dbs = [], set()
    for n, line in enumerate(jsonl_path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            ex = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{jsonl_path}:{n}: not valid JSON ({e})") from None
        missing = [f for f in REQUIRED_FIELDS if not isinstance(ex, dict) or f not in ex]
        if missing:
            raise ValueError(f"{jsonl_path}:{n}: record is missing field(s) {missing}; every record needs "
                             f"{list(REQUIRED_FIELDS)}")
        db = Path(ex["db_path"])
        db = (db if db.is_absolute() else jsonl_path.parent / db).resolve()
        if db not in seen_dbs:
            if not db.is_file():
                raise FileNotFoundError(f"{jsonl_path}:{n}: database not found: {db}")
            seen_dbs.add(db)
        examples.append({**ex, "db_path": str(db)})
    if not examples:
        raise ValueError(f"{jsonl_path}: no examples in the file")
    return examples

# -----------------------------------------------------------------------------
# protocols: prompts (after each paper's appendix, adapted to our one SQL tool), turn parsing, observations


@dataclass
class Action:
    name: str            # trust: explore_schema|propose_schema|generate_sql|confirm_answer;
                         # trail/skyrl/mtir: "sql" (tool call) | "answer"; any protocol: "invalid"
    sql: str | None      # SQL to execute (tool call) or the final answer SQL
    schema: dict | None  # trust propose_schema: {"tables": [...], "columns": {...}, "joins": [...]}
    valid: bool          # passes the protocol's per-turn format check (TRUST App. C.2 for trust)
    feedback: str | None # why it is invalid; becomes (part of) the observation


@dataclass
class Protocol:
    """One agent protocol. A turn ends at EOS or at one of `stop`; turn_text passed to parse_turn/step must keep the
    stop string that ended it. The episode ends on an `answer_action` with SQL in it, or when the turns run out."""
    name: str
    stop: list[str]
    obs_role: str
    max_rows: int
    build_messages: Callable   # (example, schema_mode, max_turns) -> [{"role", "content"}, ...]
    parse_turn: Callable       # (text) -> Action
    wrap_observation: Callable # (obs_text, turns_left) -> str
    answer_action: str = "answer"
    force_final: bool = False  # SQL-Trail Alg. 1 line 31: out of turns without an answer, one more turn must answer


SCHEMA_MODES = ("none", "prompt", "explore_turn")
SCHEMA_SQL = "SELECT sql FROM sqlite_master WHERE type = 'table'"
NO_SCHEMA = ("You are not given the database schema. Explore it with SQL first, e.g. "
             "SELECT name FROM sqlite_master WHERE type = 'table' and PRAGMA table_info(<table>).")


def _blocks(text, tag):
    """Contents of every <tag>...</tag> in order, plus the index of the first one; or an error for unbalanced tags."""
    o, c = f"<{tag}>", f"</{tag}>"
    n_open, n_close = text.count(o), text.count(c)
    if n_open != n_close:
        return [], -1, f"unclosed <{tag}> tag" if n_open > n_close else f"</{tag}> without an opening <{tag}>"
    out, i = [], 0
    for _ in range(n_open):
        a = text.find(o, i)
        b = text.find(c, a + len(o)) if a >= 0 else -1
        if b < 0:
            return [], -1, f"</{tag}> before <{tag}>"
        out.append(text[a + len(o):b])
        i = b + len(c)
    return out, text.find(o), None


def _strip_fence(s):
    s = s.strip()
    if s.startswith("```"):  # MTIR's answers may wrap the SQL in a ```sql fence (closed or not)
        s = s[3:]
        s = s[3:] if s[:3].lower() == "sql" else s
        s = s[:s.rfind("```")] if "```" in s else s
    return s.strip()


def _tool_sql(body):
    """SQL from a JSON tool call {"name": "...execute_sql_query", "arguments": {"sql": ..., <db id ignored>}}."""
    try:
        call = json.loads(body, strict=False)  # strict=False: raw newlines inside the SQL string are fine
        args = call.get("arguments", {}) if isinstance(call, dict) else None
        args = json.loads(args, strict=False) if isinstance(args, str) else args
    except (ValueError, RecursionError) as e:
        return None, f"the <tool_call> is not valid JSON ({str(e)[:80]})"
    if not isinstance(args, dict) or not str(call.get("name", "")).endswith("execute_sql_query"):
        return None, 'the <tool_call> must be {"name": "execute_sql_query", "arguments": {..., "sql": "..."}}'
    sql = args.get("sql")
    if not isinstance(sql, str) or not sql.strip():
        return None, "empty SQL in the tool call"
    return sql.strip(), None


def _parse_schema(body):
    try:
        s = json.loads(body, strict=False)
    except (ValueError, RecursionError) as e:
        return None, f"the <schema> is not valid JSON ({str(e)[:80]})"
    strs = lambda x: isinstance(x, list) and all(isinstance(v, str) for v in x)  # noqa: E731
    if not (isinstance(s, dict) and strs(s.get("tables")) and isinstance(s.get("columns"), dict)
            and all(isinstance(k, str) and strs(v) for k, v in s["columns"].items())
            and isinstance(s.get("joins", []), list)):
        return None, ('the <schema> must be {"tables": ["t1", ...], "columns": {"t1": ["c1", ...]}, '
                      '"joins": [...]}')
    return {"tables": s["tables"], "columns": s["columns"], "joins": s.get("joins", [])}, None


def _invalid(reason):
    return Action("invalid", None, None, False, reason)


def _parse_simple(text, think, call, answer, json_call):
    """trail/skyrl/mtir: <think-tag> then exactly one tool call (<call>) or one final answer (<answer>)."""
    if not isinstance(text, str):
        return _invalid("the turn is not text")
    thinks, i_think, err1 = _blocks(text, think)
    calls, i_call, err2 = _blocks(text, call)
    answers, i_ans, err3 = _blocks(text, answer)
    if err1 or err2 or err3:
        return _invalid(err2 or err3 or err1)
    if len(calls) + len(answers) == 0:
        return _invalid(f"no <{call}> or <{answer}> block")
    if len(calls) + len(answers) > 1:
        return _invalid(f"more than one action in one turn: use exactly one <{call}> or one <{answer}>")
    issue = (f"missing <{think}> block" if not thinks else f"more than one <{think}> block" if len(thinks) > 1
             else f"the <{think}> block must come first" if i_think > max(i_call, i_ans) else None)
    if calls:
        sql, err = _tool_sql(calls[0]) if json_call else (calls[0].strip() or None, f"empty SQL in <{call}>")
        return _invalid(err) if sql is None else Action("sql", sql, None, issue is None, issue)
    sql = _strip_fence(answers[0])
    return Action("answer", sql, None, issue is None, issue) if sql else _invalid(f"empty SQL in <{answer}>")


TRUST_CONTENT = {"explore_schema": "tool_call", "generate_sql": "tool_call", "propose_schema": "schema",
                 "confirm_answer": "answer"}


def parse_trust(text) -> Action:
    """TRUST App. C.2: exactly one <think>, exactly one <action> naming one of the four actions, and that action's
    content block (<tool_call> JSON, <schema> JSON or <answer> SQL). A turn with a clear action and content but a bad
    <think> is still carried out (valid=False); anything less is an "invalid" action."""
    if not isinstance(text, str):
        return _invalid("the turn is not text")
    found = {t: _blocks(text, t) for t in ("think", "action", "tool_call", "schema", "answer")}
    errs = [e for _, _, e in found.values() if e]
    if errs:
        return _invalid(errs[0])
    actions = found["action"][0]
    if len(actions) != 1:
        return _invalid("missing <action> block" if not actions else "more than one <action> in one turn")
    name = actions[0].strip()
    if name not in TRUST_CONTENT:
        return _invalid(f"unknown action {name[:40]!r}")
    need = TRUST_CONTENT[name]
    if not found[need][0]:
        return _invalid(f"{name} needs a <{need}> block")
    if sum(len(found[t][0]) for t in ("tool_call", "schema", "answer")) > 1:
        return _invalid("more than one content block in one turn: one action per turn")
    n_think = len(found["think"][0])
    issue = None if n_think == 1 else "missing <think> block" if n_think == 0 else "more than one <think> block"
    body = found[need][0][0]
    if need == "schema":
        schema, err = _parse_schema(body)
        return _invalid(err) if err else Action(name, None, schema, issue is None, issue)
    sql, err = _tool_sql(body) if need == "tool_call" else (_strip_fence(body) or None, "empty SQL in <answer>")
    return _invalid(err) if sql is None else Action(name, sql, None, issue is None, issue)


def _turns_note(n, final_hint):
    if n <= 0:  # the forced final turn (Protocol.force_final)
        return f"You have no turns left: {final_hint}"
    return f"You have {n} turns left." + (f" This is your last turn: {final_hint}" if n == 1 else "")


def _schema_text(example, schema_mode, style, example_values):
    if schema_mode == "prompt":
        return describe_schema(example["db_path"], style, example_values)
    return NO_SCHEMA if schema_mode == "none" else "The full schema is shown in the first tool result below."


def _messages(system, user, schema, explore_call, wrap, obs_role, example, schema_mode, max_turns):
    """System + filled-in user message (+ for schema_mode="explore_turn" the explore turn and its observation)."""
    if schema_mode not in SCHEMA_MODES:
        raise ValueError(f"schema_mode must be one of {SCHEMA_MODES}, got {schema_mode!r}")
    evidence = f"External Knowledge: {example['evidence']}\n" if example.get("evidence") else ""
    user = _fill(user, db_id=example["db_id"], schema=schema, evidence=evidence, question=example["question"],
                 max_turns=max_turns)
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    if schema_mode == "explore_turn":  # TRUST's prefill variant: a synthetic explore turn, not a sampled turn
        schema = describe_schema(example["db_path"], "create")
        msgs += [{"role": "assistant", "content": explore_call}, {"role": obs_role, "content": wrap(schema, max_turns)}]
    return msgs


def _prompt(name):
    """A paper's prompt text, data/prompts/<name>.txt (edit it there; the file's final newline is not part of it)."""
    return (Path(__file__).resolve().parent / "data" / "prompts" / f"{name}.txt").read_text().removesuffix("\n")


def _fill(template, **kw):
    # one pass over the template only: questions and schemas may themselves contain "{question}" or other braces
    return re.sub(r"\{(\w+)\}", lambda m: str(kw[m[1]]) if m[1] in kw else m[0], template)

# --- TRUST-SQL (App. C.3): four actions, tool results come back in "tool" messages

TRUST_SYSTEM = _prompt("trust_system")

TRUST_USER = _prompt("trust_user")


def _trust_messages(example, schema_mode, max_turns):
    schema = f"Database Schema:\n{describe_schema(example['db_path'], 'create')}\n" if schema_mode == "prompt" else ""
    call = json.dumps({"name": "execute_sql_query", "arguments": {"db_id": example["db_id"], "sql": SCHEMA_SQL}})
    explore = ("<think>I know nothing about this database yet, so I read every table's CREATE statement.</think>\n"
               f"<action>explore_schema</action>\n<tool_call>\n{call}\n</tool_call>")
    return _messages(TRUST_SYSTEM, TRUST_USER, schema, explore, _wrap_trust, "tool", example, schema_mode, max_turns)


def _wrap_trust(obs, turns_left):
    return f"{obs}\n\n{_turns_note(turns_left, 'confirm_answer now.')}"

# --- SQL-Trail (App. A.3, Algorithm 1) and SkyRL-SQL (App. A): <sql> tool calls, <observation> in user messages


SQL_AGENT_SYSTEM = _prompt("sql_agent_system")

SQL_AGENT_USER = _prompt("sql_agent_user")


def _sql_agent_messages(think, role, step3, example_values):
    system = _fill(SQL_AGENT_SYSTEM, think=think, role=role, step3=step3)

    def build(example, schema_mode, max_turns):
        schema = _schema_text(example, schema_mode, "list", example_values)
        explore = (f"<{think}>I first read the CREATE statement of every table.</{think}>\n"
                   f"<sql>{SCHEMA_SQL}</sql>")
        return _messages(system, SQL_AGENT_USER, schema, explore, _wrap_observation_tag, "user", example, schema_mode,
                         max_turns)
    return build


def _wrap_observation_tag(obs, turns_left):  # Algorithm 1 line 26 of SQL-Trail
    return f"<observation>\n{obs}\n{_turns_note(turns_left, 'give the final SQL in <solution>.')}\n</observation>"

# --- MTIR-SQL (App. C): JSON <tool_call>, results in <tool_response> user messages, final SQL in <answer>


MTIR_SYSTEM = _prompt("mtir_system")

MTIR_USER = _prompt("mtir_user")


def _mtir_messages(example, schema_mode, max_turns):
    schema = _schema_text(example, schema_mode, "create", 2)
    call = json.dumps({"name": "sql-execute_sql_query", "arguments": {"db_name": example["db_id"], "sql": SCHEMA_SQL}})
    explore = f"<think>I first read the CREATE statement of every table.</think>\n<tool_call>\n{call}\n</tool_call>"
    return _messages(MTIR_SYSTEM, MTIR_USER, schema, explore, _wrap_mtir, "user", example, schema_mode, max_turns)


def _wrap_mtir(obs, turns_left):
    return f"<tool_response>\n{obs}\n</tool_response>\n{_turns_note(turns_left, 'give the final SQL in <answer>.')}"


def _feedback(proto, reason):
    """What an invalid turn gets back, in each paper's words where it has any."""
    proto = proto.split("-")[0]  # variants registered as "<base>-..." (protocol_variant) keep their base's feedback
    if proto == "mtir":
        return (f"My action is not correct. Let me rethink. ({reason}; use <think>...</think> and then either one "
                f"<tool_call>...</tool_call> or one <answer>...</answer>)")
    if proto == "trust":
        return (f"Invalid response: {reason}. Every response needs exactly one <think>...</think>, one "
                f"<action>...</action> (explore_schema, propose_schema, generate_sql or confirm_answer) and that "
                f"action's block: <tool_call>, <schema> or <answer>.")
    think = "reasoning" if proto == "trail" else "think"
    return (f"Your previous action is invalid: {reason}. Think and try again: <{think}>...</{think}> and then either "
            f"one <sql>...</sql> or one <solution>...</solution>.")


PROTOCOLS = {
    "trust": Protocol("trust", ["</tool_call>", "</schema>", "</answer>"], "tool", 30, _trust_messages,
                      parse_trust, _wrap_trust, answer_action="confirm_answer"),
    "trail": Protocol("trail", ["</sql>", "</solution>"], "user", 50,
                      _sql_agent_messages("reasoning", "helpful text-to-SQL expert assistant",
                                          "In your first response, identify all tables and columns from the database "
                                          "schema that are relevant to answering the question.", 0),
                      lambda t: _parse_simple(t, "reasoning", "sql", "solution", False), _wrap_observation_tag),
    "skyrl": Protocol("skyrl", ["</sql>", "</solution>"], "user", 50,
                      _sql_agent_messages("think", "data science expert",
                                          "Think through how to write the query: analyse the question, summarise "
                                          "relevant findings, verify the current steps and revisit previous ones.", 2),
                      lambda t: _parse_simple(t, "think", "sql", "solution", False), _wrap_observation_tag),
    "mtir": Protocol("mtir", ["</tool_call>", "</answer>"], "user", 10, _mtir_messages,
                     lambda t: _parse_simple(t, "think", "tool_call", "answer", True), _wrap_mtir),
}

# --- variants (train.py --brief-prompt / --obs-rows): the paper prompts cost hundreds of tokens
# per sequence, which the CPU demo pays on every step. A variant is registered as "<base>-..." and otherwise unchanged.

BRIEF_SYSTEM = {
    "trust": "Answer with SQL. Each turn: <think>, then one <action>: explore_schema or generate_sql with a "
             "<tool_call>, propose_schema with a <schema>, confirm_answer with an <answer>.",
    "trail": "Answer with SQL. Each turn: <reasoning>, then <sql> to run a query or <solution> to answer.",
    "skyrl": "Answer with SQL. Each turn: <think>, then <sql> to run a query or <solution> to answer.",
    "mtir": "Answer with SQL. Each turn: <think>, then a <tool_call> to run a query or an <answer>.",
}


def protocol_variant(name, brief, obs_rows, force_final=False):
    """Register (idempotently) and return the protocol name to use: name itself, or e.g. "trust-brief-rows40"."""
    if not brief and not obs_rows and not force_final:
        return name
    base = PROTOCOLS[name]
    variant = name + ("-brief" if brief else "") + (f"-rows{obs_rows}" if obs_rows else "") + \
        ("-final" if force_final else "")

    def build_messages(example, schema_mode, max_turns):
        msgs = base.build_messages(example, schema_mode, max_turns)
        return [{"role": "system", "content": BRIEF_SYSTEM[name]}] + msgs[1:] if brief else msgs
    PROTOCOLS[variant] = replace(base, name=variant, build_messages=build_messages, max_rows=obs_rows or base.max_rows,
                                 force_final=bool(force_final))
    return variant

# -----------------------------------------------------------------------------
# episodes


@dataclass
class Episode:
    example: dict
    protocol: str
    max_turns: int
    schema_mode: str = "none"
    actions: list[Action] = field(default_factory=list)   # one entry per sampled turn, like the next two
    turn_valid: list[bool] = field(default_factory=list)
    exec_errors: list[str | None] = field(default_factory=list)
    propose_turn: int = -1          # index of the LAST propose_schema turn, -1 if never
    proposed_schema: dict | None = None
    final_sql: str | None = None
    num_tool_calls: int = 0
    done: bool = False
    stop_reason: str | None = None  # "answer" | "max_turns" (rollout adds its own: max_tokens, context)


def new_episode(example, protocol, max_turns, schema_mode="none") -> Episode:
    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown protocol {protocol!r}; choose one of {sorted(PROTOCOLS)}")
    if schema_mode not in SCHEMA_MODES:
        raise ValueError(f"schema_mode must be one of {SCHEMA_MODES}, got {schema_mode!r}")
    if int(max_turns) < 1:
        raise ValueError(f"max_turns must be >= 1, got {max_turns}")
    return Episode(example, protocol, int(max_turns), schema_mode)


def _runs_sql(action):
    return action.name in ("sql", "explore_schema", "generate_sql")


def pending_sql(episode, turn_text) -> str | None:
    """The SQL this turn would execute (None if it executes nothing), so callers can batch them through run_many."""
    if episode.done or len(episode.actions) >= episode.max_turns:  # a forced final turn runs nothing
        return None
    action = PROTOCOLS[episode.protocol].parse_turn(turn_text)
    return action.sql if _runs_sql(action) else None


def step(episode, turn_text, result: SQLResult | None = None):
    """Apply one sampled turn. Runs its SQL unless `result` (from run_many over pending_sql) is given. Returns
    (observation already wrapped with "You have N turns left", done); the observation is None once done."""
    if episode.done:
        raise ValueError(f"step() on a finished episode (stop_reason={episode.stop_reason!r}); start a new one")
    proto = PROTOCOLS[episode.protocol]
    action = proto.parse_turn(turn_text)
    turn = len(episode.actions)
    episode.actions.append(action)
    episode.turn_valid.append(action.valid)
    error = None  # carried-out turns that fail the format check still say why
    reason = _cap(str(action.feedback), MAX_ERROR_CHARS)  # the parsers may echo the agent's own text
    warning = f"Format problem: {reason}.\n" if not action.valid and action.name != "invalid" else ""
    if action.name == proto.answer_action:
        episode.final_sql, episode.done, episode.stop_reason = action.sql, True, "answer"
    elif turn >= episode.max_turns:  # the forced final turn did not answer: it ends the episode, nothing runs
        episode.done, episode.stop_reason = True, "max_turns"
    elif _runs_sql(action):
        result = result if result is not None else run_sql(episode.example["db_path"], action.sql)
        episode.num_tool_calls += 1
        error = result.error
        obs = warning + format_observation(result, max_rows=proto.max_rows)
    elif action.name == "propose_schema":
        episode.propose_turn, episode.proposed_schema = turn, action.schema
        n_cols = sum(len(c) for c in action.schema["columns"].values())
        obs = (warning + f"Schema recorded: {len(action.schema['tables'])} tables, {n_cols} columns, "
               f"{len(action.schema['joins'])} joins. Continue with generate_sql, or explore_schema if anything is "
               f"missing.")
    else:
        obs = _feedback(proto.name, reason)
    episode.exec_errors.append(error)
    turns_left = episode.max_turns - len(episode.actions)
    if not episode.done and turns_left <= 0 and not (proto.force_final and turns_left == 0):
        episode.done, episode.stop_reason = True, "max_turns"
    if episode.done:
        return None, True
    return proto.wrap_observation(_cap(obs, MAX_OBS_CHARS), turns_left), False

# -----------------------------------------------------------------------------

if __name__ == "__main__":
    parser = ArgumentParser(description=__doc__)
    parser.add_argument("examples", type=existing_file, help="example JSONL file (see the README for the format)")
    parser.add_argument("--protocol", default="trail", choices=sorted(PROTOCOLS), help="agent turn format")
    parser.add_argument("--schema-mode", default="prompt", choices=SCHEMA_MODES, help="none: unknown schema; prompt: "
                        "schema in the prompt; explore_turn: a prefilled exploring turn")
    parser.add_argument("--max-turns", type=positive_int, default=5, help="assistant turns per episode")
    parser.add_argument("--index", type=nonneg_int, default=0, help="which example to show")
    args = parser.parse_args()
    try:
        examples = load_examples(args.examples)
    except (FileNotFoundError, ValueError) as e:
        die(e)
    if args.index >= len(examples):
        die(f"--index {args.index}: {args.examples} has {len(examples)} examples")
    ex = examples[args.index]
    for m in PROTOCOLS[args.protocol].build_messages(ex, args.schema_mode, args.max_turns):
        print(f"--- {m['role']}\n{m['content']}")
    print(f"--- gold SQL\n{ex['gold_sql']}\n--- result\n{format_observation(run_sql(ex['db_path'], ex['gold_sql']))}")
