"""
The SQLite tool environment, the agent's whole world: the read-only sandbox every query of the agent, the teacher,
the rewards and the scorers goes through, result comparison, what the agent sees (observations, schema text), the
four agent protocols (TRUST-SQL, SQL-Trail, MTIR-SQL, SkyRL-SQL) and a small Episode state machine. Pure Python +
sqlite3, no model involved.

    python -m pytest -q tests/test_env.py     # the sandbox, result comparison and episodes at work

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
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Callable


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


def _lossy_text(raw: bytes) -> str:
    """SQLite text as str, undecodable bytes replaced: a database or an expression may hold any bytes."""
    return raw.decode("utf-8", "replace")


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
            conn.text_factory = _lossy_text  # replace(CAST(x AS BLOB), ..) is any bytes
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
    _watched = {}
    _watch_lock = threading.Lock()
    _watch_wake = threading.Event()
    _watch_thread = None
    _watch_next = float("inf")
    _local = threading.local()


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
        wake = deadline < _watch_next  # before _watch_next moves
        _watch_next = min(deadline, _watch_next)
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
        # freed on close). temp_store=MEMORY would keep a runaway ORDER BY's every row in RAM instead, and freeing
        # it overruns the deadline (docs/environment.md).
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
    cur = conn.execute(sql)
    rows = []
    nbytes = 0
    truncated = False
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
    error = _refusal(sql)
    reasons = []
    timed_out = []
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
                    conn.text_factory = _lossy_text
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
    msg = str(e)
    full = os.path.abspath(str(db_path))
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
    pred = [tuple(r) for r in pred_rows]
    gold = [tuple(r) for r in gold_rows]
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
    size = len(lines[0])
    shown = 0
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
    out = []
    fks = []
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
    examples = []
    seen_dbs = set()
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
# what a protocol gives the environment (protocols.py holds the four papers' protocols)


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
    feedback: Callable         # (why a turn is invalid) -> what the agent is told
    answer_action: str = "answer"
    force_final: bool = False  # SQL-Trail Alg. 1 line 31: out of turns without an answer, one more turn must answer


SCHEMA_MODES = ("none", "prompt", "explore_turn")

# -----------------------------------------------------------------------------
# episodes


@dataclass
class Episode:
    example: dict
    protocol: Protocol
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
    if not isinstance(protocol, Protocol):
        raise ValueError(f"new_episode takes a Protocol, not {protocol!r}: protocols.get(name) gives one")
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
    action = episode.protocol.parse_turn(turn_text)
    return action.sql if _runs_sql(action) else None


def step(episode, turn_text, result: SQLResult | None = None):
    """Apply one sampled turn. Runs its SQL unless `result` (from run_many over pending_sql) is given. Returns
    (observation already wrapped with "You have N turns left", done); the observation is None once done."""
    if episode.done:
        raise ValueError(f"step() on a finished episode (stop_reason={episode.stop_reason!r}); start a new one")
    proto = episode.protocol
    action = proto.parse_turn(turn_text)
    turn = len(episode.actions)
    episode.actions.append(action)
    episode.turn_valid.append(action.valid)
    error = None  # carried-out turns that fail the format check still say why
    reason = _cap(str(action.feedback), MAX_ERROR_CHARS)  # the parsers may echo the agent's own text
    warning = f"Format problem: {reason}.\n" if not action.valid and action.name != "invalid" else ""
    if action.name == proto.answer_action:
        episode.final_sql = action.sql
        episode.done = True
        episode.stop_reason = "answer"
    elif turn >= episode.max_turns:  # the forced final turn did not answer: it ends the episode, nothing runs
        episode.done = True
        episode.stop_reason = "max_turns"
    elif _runs_sql(action):
        result = result if result is not None else run_sql(episode.example["db_path"], action.sql)
        episode.num_tool_calls += 1
        error = result.error
        obs = warning + format_observation(result, max_rows=proto.max_rows)
    elif action.name == "propose_schema":
        episode.propose_turn = turn
        episode.proposed_schema = action.schema
        n_cols = sum(len(c) for c in action.schema["columns"].values())
        obs = (warning + f"Schema recorded: {len(action.schema['tables'])} tables, {n_cols} columns, "
               f"{len(action.schema['joins'])} joins. Continue with generate_sql, or explore_schema if anything is "
               f"missing.")
    else:
        obs = proto.feedback(reason)
    episode.exec_errors.append(error)
    turns_left = episode.max_turns - len(episode.actions)
    if not episode.done and turns_left <= 0 and not (proto.force_final and turns_left == 0):
        episode.done = True
        episode.stop_reason = "max_turns"
    if episode.done:
        return None, True
    return proto.wrap_observation(_cap(obs, MAX_OBS_CHARS), turns_left), False
