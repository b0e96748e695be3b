"""env.py: the read-only sandbox, result comparison, observations and episodes.

    python -m pytest -q tests/test_env.py
"""
import dataclasses
import doctest
import hashlib
import json
import multiprocessing
import os
import sqlite3
import subprocess
import sys
import tempfile
import time

import pytest

import env
import protocols
from conftest import build_db

RUNAWAYS = {  # each runs for minutes without the timeout
    "recursive CTE without LIMIT": "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) "
                                   "SELECT count(*) FROM c",
    "3-way cartesian join of a 4,000-row table": "SELECT count(*) FROM city a, city b, city c",
    "sorted cartesian join": "SELECT a.Name, b.Name FROM city a, city b, city c ORDER BY a.Name || c.Name DESC",
}

# -----------------------------------------------------------------------------
# fixtures: small databases built in tmp_path (so the sandbox tests need no Spider download, and file-level checks see
# only what we did); the episode and real-query tests use the Spider dev set itself

def _sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _temp_files():
    dirs = {tempfile.gettempdir(), "/tmp", "/var/tmp"}
    return {f for d in dirs if os.path.isdir(d) for f in os.listdir(d) if f.startswith("etilqs_")}


@pytest.fixture(scope="module")
def world(tmp_path_factory):  # a 4,000-row city table: a 3-way self-join is 6.4e10 rows, minutes without the timeout
    cities = [(i, f"City {i:04d}", f"C{i % 50:02d}") for i in range(1, 4001)]
    ddl = ["CREATE TABLE city (ID INTEGER PRIMARY KEY, Name TEXT, CountryCode TEXT)"]
    return build_db(tmp_path_factory.mktemp("world_1") / "world_1.sqlite", ddl, {"city": cities})


def _example(db_path, question="How many pets are there?", gold="SELECT count(*) FROM Pets"):
    return {"id": "t0", "db_id": "pets_1", "db_path": str(db_path), "question": question, "evidence": "",
            "gold_sql": gold, "difficulty": "easy", "source": "spider"}


@pytest.fixture
def spider_pets(spider_dir):
    return _example(spider_dir / "database" / "pets_1" / "pets_1.sqlite")

# -----------------------------------------------------------------------------
# sandbox


def test_select_returns_columns_rows_and_no_error(pets):
    r = env.run_sql(pets, "SELECT PetType, count(*) AS n FROM Pets GROUP BY PetType ORDER BY PetType")
    assert r.error is None and r.columns == ["PetType", "n"] and r.rows == [("cat", 1), ("dog", 2)]
    assert not r.truncated and r.elapsed_s >= 0


HOSTILE = {
    "insert": "INSERT INTO Pets VALUES (9999, 'cow', 3, 1.0)",
    "update": "UPDATE Pets SET weight = 0",
    "delete": "DELETE FROM Pets",
    "delete behind WITH": "WITH x AS (SELECT 1) DELETE FROM Pets",
    "upsert behind WITH": "WITH x AS (SELECT 1) INSERT INTO Pets SELECT * FROM Pets",
    "drop table": "DROP TABLE Pets",
    "create table": "CREATE TABLE t (x)",
    "create temp table": "CREATE TEMP TABLE t (x)",
    "create index": "CREATE INDEX i ON Pets (weight)",
    "alter table": "ALTER TABLE Pets ADD COLUMN y",
    "attach": "ATTACH DATABASE 'other.sqlite' AS other",
    "detach": "DETACH DATABASE main",
    "vacuum": "VACUUM",
    "vacuum into": "VACUUM INTO 'copy.sqlite'",
    "analyze": "ANALYZE",
    "reindex": "REINDEX",
    "begin": "BEGIN IMMEDIATE",
    "savepoint": "SAVEPOINT s",
    "pragma set journal_mode": "PRAGMA journal_mode = WAL",
    "pragma set writable_schema": "PRAGMA writable_schema = ON",
    "pragma set user_version": "PRAGMA user_version = 7",
    "pragma database_list (shows the file path)": "PRAGMA database_list",
    "pragma_database_list table": "SELECT * FROM pragma_database_list",
    "load_extension": "SELECT load_extension('/tmp/evil.so')",
    "multi-statement": "SELECT 1; DROP TABLE Pets",
    "multi-statement behind comment": "SELECT 1 /* x */; DELETE FROM Pets",
    "randomblob(1e9)": "SELECT randomblob(1e9)",
    "zeroblob(1e9)": "SELECT zeroblob(1000000000)",
    "string doubling past the length cap": "SELECT replace(hex(zeroblob(400000)), '0', '00')",
    "deep expression": "SELECT " + "1 + " * 5000 + "1",
    "deep parentheses": "SELECT " + "(" * 2000 + "1" + ")" * 2000,
    "NUL byte": "SELECT 1\x00; DROP TABLE Pets",
    "lone surrogate": "SELECT '\ud800'",
    "100k junk": "x" * 100_000,
    "200k junk": "SELECT " + "(1)," * 50_000,
    "empty": "",
    "only a comment": "-- nothing here",
    "not text (None)": None,
    "not text (int)": 7,
    "not text (bytes)": b"SELECT 1",
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_sql_fails_cleanly_and_leaves_the_db_untouched(pets, name):
    before_hash = _sha(pets)
    before_files = sorted(os.listdir(pets.parent))
    before_tmp = _temp_files()
    r = env.run_sql(pets, HOSTILE[name], timeout_s=2.0)
    assert r.error, f"{name} should fail"
    assert str(pets.parent) not in r.error and "pets_1.sqlite" not in r.error  # errors never show file paths
    assert _sha(pets) == before_hash
    assert sorted(os.listdir(pets.parent)) == before_files  # no -journal / -wal / -shm / copies
    assert _temp_files() <= before_tmp
    assert not os.path.exists("copy.sqlite") and not os.path.exists("other.sqlite")


def test_refusals_name_what_was_refused(pets):
    assert "PRAGMA journal_mode" in env.run_sql(pets, "PRAGMA journal_mode = WAL").error
    assert "load_extension" in env.run_sql(pets, "SELECT load_extension('x')").error
    assert "one statement" in env.run_sql(pets, "SELECT 1; SELECT 2").error
    assert "too big" in env.run_sql(pets, "SELECT randomblob(1e9)").error
    assert "DELETE" in env.run_sql(pets, "WITH x AS (SELECT 1) DELETE FROM Pets").error


def test_metadata_pragmas_and_sqlite_master_are_allowed(pets):
    r = env.run_sql(pets, "PRAGMA table_info(Pets)")
    assert r.error is None and [row[1] for row in r.rows] == ["PetID", "PetType", "pet_age", "weight"]
    r = env.run_sql(pets, "SELECT name FROM pragma_table_info('Has_Pet')")
    assert r.error is None and r.rows == [("StuID",), ("PetID",)]
    r = env.run_sql(pets, "PRAGMA foreign_key_list(Has_Pet)")
    assert r.error is None and {row[2] for row in r.rows} == {"Pets", "Student"}
    assert env.run_sql(pets, "PRAGMA index_list('Pets')").error is None
    r = env.run_sql(pets, "SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")
    assert r.rows == [("Has_Pet",), ("Pets",), ("Student",)]
    r = env.run_sql(pets, "  -- look first\nWITH t AS (SELECT 1 AS x) SELECT x FROM t;  /* trailing */ ")
    assert r.error is None and r.rows == [(1,)]


def test_errors_are_sqlites_own_words_and_a_missing_db_is_never_created(pets, tmp_path):
    r = env.run_sql(pets, "SELECT Wages FROM Pets")
    assert r.error == "no such column: Wages"
    missing = tmp_path / "nope" / "nope.sqlite"
    r = env.run_sql(missing, "SELECT 1")
    assert r.error and str(tmp_path) not in r.error and not missing.exists()


def test_row_cap_marks_the_result_truncated(pets):
    r = env.run_sql(pets, RUNAWAYS["recursive CTE without LIMIT"].replace("count(*)", "x"), max_rows=100)
    assert r.error is None and len(r.rows) == 100 and r.truncated


def test_result_bytes_are_capped_so_huge_rows_cannot_exhaust_memory(pets):
    rows_of_900kb = ("WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c LIMIT 10000) "
                     "SELECT zeroblob(900000) FROM c")
    r = env.run_sql(pets, rows_of_900kb)  # 9 GB if fetched in full
    assert r.error is None and r.truncated and len(r.rows) * 900_000 <= env.MAX_RESULT_BYTES + 900_000


def test_pragma_functions_join_like_agents_write_them(pets):
    r = env.run_sql(pets, "SELECT m.name, p.name FROM sqlite_master m JOIN pragma_table_info(m.name) p "
                          "WHERE m.type = 'table' AND m.name = 'Pets'")
    assert r.error is None and r.rows == [("Pets", "PetID"), ("Pets", "PetType"), ("Pets", "pet_age"), ("Pets", "weight")]


def test_non_utf8_text_is_replaced_not_an_error(tmp_path):
    db = tmp_path / "latin.sqlite"
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE t (name TEXT)")
        conn.execute("INSERT INTO t VALUES (CAST(x'4dfc6c6c6572' AS TEXT))")  # 'Müller' in latin-1
    conn.close()
    r = env.run_sql(db, "SELECT name FROM t")
    assert r.error is None and r.rows == [("M\ufffdller",)]
    assert "CAST it AS BLOB" in env.run_sql(db, "SELECT replace(name, 'l', 'L') FROM t").error  # guarded functions
    assert env.run_sql(db, "SELECT instr(CAST(name AS BLOB), 'l') FROM t").rows == [(3,)]


def test_wal_database_is_read_without_leaving_wal_files(tmp_path):
    db = tmp_path / "wal.sqlite"
    conn = sqlite3.connect(db)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("CREATE TABLE t (x)")
    conn.execute("INSERT INTO t VALUES (1)")
    conn.commit()
    conn.close()
    before = sorted(os.listdir(tmp_path))
    assert env.run_sql(db, "SELECT x FROM t").rows == [(1,)]
    assert sorted(os.listdir(tmp_path)) == before


@pytest.mark.parametrize("name", list(RUNAWAYS))
def test_runaway_query_times_out(world, name):
    t0 = time.monotonic()
    r = env.run_sql(world, RUNAWAYS[name], timeout_s=0.5)
    assert r.error == "query timed out after 0.5 s"
    assert time.monotonic() - t0 < 0.5 + 2.0  # generous: exact figures are in `python bench.py env`


def test_16_concurrent_runaways_all_return(world):
    before_hash = _sha(world)
    before_tmp = _temp_files()
    jobs = [(world, sql) for sql in RUNAWAYS.values()] * 6  # 18 jobs
    t0 = time.monotonic()
    results = env.run_many(jobs[:16], workers=16, timeout_s=0.5)
    assert time.monotonic() - t0 < 0.5 + 3.0
    assert [r.error for r in results] == ["query timed out after 0.5 s"] * 16
    assert _sha(world) == before_hash and _temp_files() <= before_tmp
    assert sorted(os.listdir(world.parent)) == ["world_1.sqlite"]


A = "replace(hex(zeroblob({})), '0', 'a')"  # 2n characters of 'a', built inside SQLite
A1MB = A.format(499_000)  # 998,000 bytes of 'a'
E4 = "replace(hex(zeroblob(249000)), '00', '\U0001F600')"  # 996,000 bytes of 😀 (249,000 four-byte characters)
PER_ROW = "WITH v(s) AS (SELECT {}) SELECT count(*) FROM city, v WHERE {}"  # one call per city row (4,000 rows)
ONE_STEP = {  # work inside one SQLite call, which nothing interrupts; (time for a 0.5 s timeout before the fix)
    "LIKE, 1 MB by a 20k pattern (15 s)": f"SELECT {A1MB} LIKE '%' || {A.format(10_000)} || 'b'",
    "GLOB [...], 1 MB by 20k (18 s)": f"SELECT {A1MB} GLOB '*[' || {A.format(10_000)} || 'b]c'",
    "instr, 1 MB by 0.5 MB (4.5 s)": f"SELECT instr({A1MB}, {A.format(250_000)} || 'b')",
    "replace, 1 MB by 0.5 MB (4.8 s)": f"SELECT length(replace({A1MB}, {A.format(250_000)} || 'b', 'x'))",
    "trim, 1 MB by an 80k set (>30 s)": f"SELECT length(trim({A1MB}, replace(hex(zeroblob(40000)), '0', 'b') || 'a'))",
    "json_patch, two 20k-key objects (1.1 s)": "WITH k(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM k LIMIT 20000) "
                                               "SELECT length(json_patch(json_group_object('a' || i, 0), "
                                               "json_group_object('b' || i, 0))) FROM k",
    # the largest calls still allowed, one per row, stopped between two rows now (25 s to minutes before)
    "LIKE at the pattern limit, every row": PER_ROW.format(A1MB, "substr(s, ID) LIKE '%" + "a" * 37 + "b'"),
    "GLOB [...] at its budget, every row": PER_ROW.format(A1MB, "substr(s, ID) GLOB '*[" + "b" * 15 + "a]c'"),
    "instr at its budget in 4-byte characters, every row": PER_ROW.format(E4, "instr(substr(s, ID), '"
                                                                          + "\U0001F600" * 599 + "\U0001F601')"),
    "trim at its budget, every row": PER_ROW.format(A1MB, "length(trim(substr(s, ID), '" + "b" * 18 + "a'))"),
    "randomblob(1e6) on every row (4.4 s)": "SELECT count(*) FROM city a, city b WHERE length(randomblob(999999 - "
                                            "a.ID - b.ID)) > 0",
}


@pytest.mark.parametrize("name", list(ONE_STEP))
def test_one_heavy_sqlite_step_cannot_outlast_the_timeout(world, name):
    t0 = time.monotonic()
    r = env.run_sql(world, ONE_STEP[name], timeout_s=0.5)
    elapsed = time.monotonic() - t0
    assert elapsed < 0.5 + 0.2, f"{name}: returned {elapsed - 0.5:+.3f} s after the timeout"
    assert r.error == "query timed out after 0.5 s" or "too long" in r.error or "too complex" in r.error


def test_guarded_functions_give_sqlites_own_results(pets):
    native = sqlite3.connect(":memory:")
    calls = ["instr('abcabc', 'ca')", "instr(x'616263', x'63')", "instr(12345, 34)", "instr(NULL, 'a')",
             "instr('\U0001F600abc', 'b')", "instr('abc', '')", "replace('abcabc', 'b', 'XY')",
             "replace('abc', '', 'x')", "replace(12.5, '.', ',')", "replace(x'616263', 'b', 'z')",
             "replace('a', 'a', NULL)", "trim('xxhixx', 'x')", "ltrim('xxhi', 'x')", "rtrim(1200, '0')",
             "trim('h\u00e9\u00e9', '\u00e9')", "'abc' GLOB 'A*'", "'abc' GLOB '[a-c]*'", "glob(NULL, 'a')",
             "json_patch('{\"a\": 1}', '{\"b\": 2}')"]
    for call in calls:
        want = native.execute(f"SELECT {call}, typeof({call})").fetchone()
        assert env.run_sql(pets, f"SELECT {call}, typeof({call})").rows == [want], call
    assert "too long" in env.run_sql(pets, f"SELECT instr({A1MB}, {A.format(1000)})").error
    assert env.run_sql(pets, f"SELECT instr({A1MB}, 'b')").rows == [(0,)]  # a long value, a short needle: fine


def test_a_lock_held_by_another_process_ends_at_the_deadline(tmp_path):
    db = tmp_path / "locked.sqlite"
    conn = sqlite3.connect(db)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("CREATE TABLE t (x)")
    conn.commit()
    conn.close()
    holder = subprocess.Popen([sys.executable, "-c", f"""import sqlite3, time
c = sqlite3.connect({str(db)!r}, isolation_level=None)
c.execute("SELECT * FROM t").fetchall()  # opens the WAL first, then takes the file for itself
c.execute("PRAGMA locking_mode = EXCLUSIVE")
c.execute("INSERT INTO t VALUES (1)")
print("locked", flush=True)
time.sleep(60)"""], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        before = sorted(os.listdir(tmp_path))
        t0 = time.monotonic()
        r = env.run_sql(db, "SELECT count(*) FROM t", timeout_s=0.5)  # was 5.0 s: Python's default busy timeout
        assert time.monotonic() - t0 < 0.5 + 0.2
        assert r.error in ("query timed out after 0.5 s", "database is locked")
        assert sorted(os.listdir(tmp_path)) == before
    finally:
        holder.kill()
        holder.wait()


def test_an_orphaned_wal_gets_no_shm_file_from_us(tmp_path):
    db = tmp_path / "orphan.sqlite"
    conn = sqlite3.connect(db)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("PRAGMA locking_mode = EXCLUSIVE")  # WAL index in heap memory: no -shm file
    conn.execute("CREATE TABLE t (x)")
    conn.commit()
    wal = (tmp_path / "orphan.sqlite-wal").read_bytes()  # what a writer that died mid-run leaves behind
    conn.close()
    (tmp_path / "orphan.sqlite-wal").write_bytes(wal)
    before = {p.name: _sha(p) for p in tmp_path.iterdir()}
    r = env.run_sql(db, "SELECT count(*) FROM t")
    assert r.error == "unable to open database file"  # SQLite would create orphan.sqlite-shm to read it
    assert {p.name: _sha(p) for p in tmp_path.iterdir()} == before


EXPOSERS = {  # compiled into the SQLite Python ships with (pragma function_list / module_list)
    "fts3_tokenizer() returns a library address": ("SELECT hex(fts3_tokenizer('simple'))", "fts3_tokenizer()"),
    "fts3_tokenizer() takes a pointer": ("SELECT FTS3_TOKENIZER('x', x'4141414141414141')", "fts3_tokenizer()"),
    "fts5() hands out an API pointer": ("SELECT fts5(NULL)", "fts5()"),
    "rtreenode() decodes a raw blob": ("SELECT rtreenode(2, zeroblob(100))", "rtreenode()"),
    "sqlite_log() writes to the process log": ("SELECT sqlite_log(1, 'x')", "sqlite_log()"),
    "dbstat shows the file's pages": ("SELECT count(*) FROM DBSTAT", "DBSTAT"),
    "sqlite_stmt shows engine internals": ("SELECT sql FROM sqlite_stmt", "sqlite_stmt"),
}


@pytest.mark.parametrize("name", list(EXPOSERS))
def test_functions_that_expose_memory_or_files_are_refused(pets, name):
    sql, what = EXPOSERS[name]
    assert env.run_sql(pets, sql).error.startswith(f"not authorized: {what} ")


def test_fts3_tokenizer_really_leaks_an_address_without_the_sandbox():
    # why it is refused: this build has ENABLE_FTS3_TOKENIZER, so plain sqlite3 returns a pointer
    assert len(sqlite3.connect(":memory:").execute("SELECT fts3_tokenizer('simple')").fetchone()[0]) == 8


def test_errors_and_observations_are_capped(pets):
    r = env.run_sql(pets, "SELECT * FROM " + "t" * 90_000)  # was a 90,014-character error
    assert r.error.startswith("no such table: ttt") and len(r.error) <= env.MAX_ERROR_CHARS + 40
    huge = env.SQLResult([], [], "x" * 90_000, False, 0.0)  # a result from somewhere other than run_sql
    assert len(env.format_observation(huge, max_chars=4000)) <= 4000 + 40
    ep = env.new_episode(_example(pets), protocols.get("trail"), max_turns=5)
    obs, _ = env.step(ep, "<reasoning>x</reasoning><sql>SELECT * FROM " + "t" * 90_000 + "</sql>")
    assert len(obs) < 1000 and len(ep.exec_errors[0]) <= env.MAX_ERROR_CHARS + 40
    def echo(text):  # a parser that echoes the malformed turn back in its feedback
        return env.Action("invalid", None, None, False, text)
    protocols.PROTOCOLS["trail-echo-test"] = dataclasses.replace(protocols.PROTOCOLS["trail"], name="trail-echo-test",
                                                           parse_turn=echo)
    try:
        obs, _ = env.step(env.new_episode(_example(pets), protocols.get("trail-echo-test"), 5), "junk " * 50_000)
        assert len(obs) < env.MAX_ERROR_CHARS + 500
    finally:
        protocols.PROTOCOLS.pop("trail-echo-test")


def test_a_nan_timeout_is_an_error_not_forever(pets):
    assert "timeout_s" in env.run_sql(pets, "SELECT 1", timeout_s=float("nan")).error
    assert env.run_sql(pets, "SELECT 1", timeout_s=float("inf")).rows == [(1,)]


def test_the_watchdog_works_in_a_forked_child(world):
    env.run_sql(world, "SELECT 1")  # the parent's watchdog thread exists; a forked child has none
    child = multiprocessing.get_context("fork").Process(target=_runaway_in_child, args=(str(world),))
    child.start()
    child.join(10)
    child.kill()  # a no-op once it has exited
    assert child.exitcode == 0


def _runaway_in_child(db):
    t0 = time.monotonic()
    r = env.run_sql(db, RUNAWAYS["recursive CTE without LIMIT"], timeout_s=0.3)
    os._exit(0 if r.error == "query timed out after 0.3 s" and time.monotonic() - t0 < 0.3 + 0.2 else 1)


def test_run_many_keeps_job_order_and_survives_bad_jobs(pets):
    jobs = [(pets, f"SELECT {i}") for i in range(20)] + ["not a pair", (pets, "DROP TABLE Pets")]
    results = env.run_many(jobs, workers=2)
    assert [r.rows for r in results[:20]] == [[(i,)] for i in range(20)]
    assert results[20].error and results[21].error

# -----------------------------------------------------------------------------
# result comparison


def test_results_match_docstring_examples():
    failures = doctest.DocTestRunner().run(doctest.DocTestFinder().find(env.results_match)[0], out=lambda s: None)
    assert failures.failed == 0 and failures.attempted >= 6


def test_bird_mode_is_set_equality_with_column_order():
    assert env.results_match([(1, "a"), (2, "b")], [(2, "b"), (1, "a"), (1, "a")], "bird")
    assert not env.results_match([("a", 1)], [(1, "a")], "bird")
    assert env.results_match([], [], "bird")
    assert not env.results_match([(1,)], [], "bird")
    assert env.results_match([[1.0]], [(1,)], "bird")  # lists are fine and 1.0 == 1, like Python's set()


def test_spider_mode_is_bag_equality_up_to_one_column_permutation():
    assert env.results_match([("a", 1), ("b", 2)], [(1, "a"), (2, "b")], "spider")
    assert not env.results_match([(1, "a"), (2, "b")], [("b", 1), ("a", 2)], "spider")  # no single permutation
    assert not env.results_match([(1,), (1,), (2,)], [(1,), (2,), (2,)], "spider")    # duplicates count
    assert not env.results_match([(1,), (1,), (2,)], [(1,), (2,)], "spider")            # row counts differ
    assert not env.results_match([(1, 2)], [(1,)], "spider")                            # column counts differ
    assert env.results_match([(2,), (1,)], [(1,), (2,)], "spider")
    assert not env.results_match([(2,), (1,)], [(1,), (2,)], "spider", order_matters=True)
    assert env.results_match([(2, "x"), (1, "y")], [("x", 2), ("y", 1)], "spider", order_matters=True)
    assert env.results_match([], [], "spider") and not env.results_match([], [(1,)], "spider")
    wide = [tuple([7] * 12)] * 3  # identical columns must not blow up the permutation search
    assert env.results_match(wide, wide, "spider")
    with pytest.raises(ValueError, match="mode"):
        env.results_match([], [], "exact")


def test_spider_mode_on_real_spider_queries(spider_dir):
    db = spider_dir / "database" / "concert_singer" / "concert_singer.sqlite"
    gold = env.run_sql(db, "SELECT Name, Country FROM singer").rows
    swapped = env.run_sql(db, "SELECT Country, Name FROM singer ORDER BY Age").rows
    assert env.results_match(swapped, gold, "spider") and not env.results_match(swapped, gold, "bird")
    fewer = env.run_sql(db, "SELECT Name, Country FROM singer WHERE Age > 30").rows
    assert not env.results_match(fewer, gold, "spider")

# -----------------------------------------------------------------------------
# what the agent sees


def test_observation_has_header_rows_and_explicit_truncation():
    rows = [(i, f"name{i}") for i in range(173)]
    obs = env.format_observation(env.SQLResult(["id", "name"], rows, None, False, 0.0), max_rows=30)
    lines = obs.splitlines()
    assert lines[0] == "id | name" and lines[1] == "0 | name0" and len(lines) == 32
    assert lines[-1] == "... 143 more rows"
    capped = env.format_observation(env.SQLResult(["id", "name"], rows, None, False, 0.0), max_rows=30, max_chars=60)
    assert len(capped) < 60 + 80 and "more rows (output limited to 60 characters)" in capped
    cut = env.format_observation(env.SQLResult(["x"], [(1,)] * 10_000, None, True, 0.0), max_rows=10)
    assert cut.endswith("... more than 9990 more rows (the result was cut at 10000 rows)")
    assert env.format_observation(env.SQLResult(["n"], [], None, False, 0.0)) == "n\n(0 rows)"
    assert env.format_observation(env.SQLResult([], [], "no such table: x", False, 0.0)) == "Error: no such table: x"
    odd = env.format_observation(env.SQLResult(["a", "b", "c"], [(None, b"\x00\x01", "two\nlines")], None, False, 0))
    assert odd.splitlines()[1] == "NULL | <blob 2 bytes> | two\\nlines"


def test_describe_schema_styles(pets):
    listed = env.describe_schema(pets, "list")
    assert listed.startswith("Table: Student\n- StuID (INTEGER, PRIMARY KEY)\n- LName (VARCHAR(12))")
    assert "Table: Pets\n- PetID (INTEGER, PRIMARY KEY)" in listed
    assert "Foreign keys:\n- Has_Pet.StuID = Student.StuID\n- Has_Pet.PetID = Pets.PetID" in listed
    created = env.describe_schema(pets, "create")
    assert created.count("CREATE TABLE") == 3 and "FOREIGN KEY(PetID) REFERENCES Pets(PetID)" in created
    assert "- PetType (VARCHAR(20), examples: 'cat', 'dog')" in env.describe_schema(pets, "list", example_values=2)
    assert "--   PetType: 'cat', 'dog'" in env.describe_schema(pets, "create", example_values=2)
    with pytest.raises(ValueError, match="style"):
        env.describe_schema(pets, "yaml")

# -----------------------------------------------------------------------------
# episodes on a real Spider database


def test_trust_episode_explore_propose_generate_confirm(spider_pets):
    ep = env.new_episode(spider_pets, protocols.get("trust"), max_turns=6)
    explore = ('<think>which tables?</think><action>explore_schema</action><tool_call>{"name": "execute_sql_query", '
               '"arguments": {"db_id": "../../etc/passwd", "sql": "SELECT name FROM sqlite_master WHERE type = '
               '\'table\'"}}</tool_call>')
    obs, done = env.step(ep, explore)
    assert not done and obs.startswith("name\nStudent\nHas_Pet\nPets") and "You have 5 turns left." in obs
    propose = ('<think>Pets it is</think><action>propose_schema</action><schema>{"tables": ["Pets"], '
               '"columns": {"Pets": ["PetID"]}, "joins": []}</schema>')
    obs, done = env.step(ep, propose)
    assert "Schema recorded: 1 tables, 1 columns" in obs and "You have 4 turns left." in obs
    wrong = ('<think>try</think><action>generate_sql</action><tool_call>{"name": "execute_sql_query", "arguments": '
             '{"db_id": "pets_1", "sql": "SELECT count(*) FROM Pet"}}</tool_call>')
    obs, done = env.step(ep, wrong)
    assert obs.startswith("Error: no such table: Pet")
    right = wrong.replace("FROM Pet\"", "FROM Pets\"")
    assert env.pending_sql(ep, right) == "SELECT count(*) FROM Pets"
    obs, done = env.step(ep, right)
    assert obs.startswith("count(*)\n3\n") and "You have 2 turns left." in obs
    obs, done = env.step(ep, "<think>3</think><action>confirm_answer</action><answer>SELECT count(*) FROM Pets</answer>")
    assert (obs, done, ep.stop_reason, ep.final_sql) == (None, True, "answer", "SELECT count(*) FROM Pets")
    assert ep.propose_turn == 1 and ep.proposed_schema["tables"] == ["Pets"] and ep.num_tool_calls == 3
    assert ep.turn_valid == [True] * 5 and ep.exec_errors == [None, None, "no such table: Pet", None, None]
    assert [a.name for a in ep.actions] == ["explore_schema", "propose_schema", "generate_sql", "generate_sql",
                                            "confirm_answer"]
    with pytest.raises(ValueError, match="finished episode"):
        env.step(ep, "<answer>SELECT 1</answer>")


def test_episode_runs_out_of_turns_and_accepts_batched_results(spider_pets):
    ep = env.new_episode(spider_pets, protocols.get("trail"), max_turns=2, schema_mode="prompt")
    turn = "<reasoning>look</reasoning><sql>SELECT PetType FROM Pets</sql>"
    [result] = env.run_many([(ep.example["db_path"], env.pending_sql(ep, turn))], workers=2)
    obs, done = env.step(ep, turn, result)
    assert obs.startswith("<observation>\nPetType\ncat\ndog\ndog\n") and "You have 1 turns left." in obs
    assert "This is your last turn" in obs and not done
    assert env.pending_sql(ep, "<reasoning>x</reasoning><solution>SELECT 1</solution>") is None
    obs, done = env.step(ep, "junk " * 20_000)
    assert (obs, done, ep.stop_reason, ep.final_sql) == (None, True, "max_turns", None)
    assert ep.turn_valid == [True, False] and ep.num_tool_calls == 1 and ep.propose_turn == -1


def test_new_episode_rejects_bad_arguments(pets):
    ex = _example(pets)
    with pytest.raises(ValueError, match="unknown protocol"):
        protocols.get("react")
    with pytest.raises(ValueError, match="takes a Protocol"):
        env.new_episode(ex, "trust", 3)
    with pytest.raises(ValueError, match="schema_mode"):
        env.new_episode(ex, protocols.get("trust"), 3, schema_mode="full")
    with pytest.raises(ValueError, match="max_turns"):
        env.new_episode(ex, protocols.get("trust"), 0)

# -----------------------------------------------------------------------------
# load_examples


def test_load_examples_resolves_paths_and_names_problems(pets, tmp_path):
    rec = {"id": "1", "db_id": "pets_1", "db_path": "pets_1/pets_1.sqlite", "question": "q", "evidence": "",
           "gold_sql": "SELECT 1", "difficulty": "easy", "source": "spider"}
    good = tmp_path / "dev.jsonl"
    good.write_text(json.dumps(rec) + "\n\n" + json.dumps({**rec, "id": "2", "db_path": str(pets)}) + "\n")
    exs = env.load_examples(good)
    assert [e["id"] for e in exs] == ["1", "2"] and all(e["db_path"] == str(pets.resolve()) for e in exs)
    cases = {"no_field.jsonl": (json.dumps({k: v for k, v in rec.items() if k != "gold_sql"}), "gold_sql"),
             "no_db.jsonl": (json.dumps({**rec, "db_path": "gone.sqlite"}), "database not found"),
             "empty.jsonl": ("\n", "no examples"), "bad.jsonl": ("{oops", "not valid JSON")}
    for fname, (text, msg) in cases.items():
        (tmp_path / fname).write_text(text)
        with pytest.raises((ValueError, FileNotFoundError), match=msg):
            env.load_examples(tmp_path / fname)
    with pytest.raises(FileNotFoundError, match="examples file not found"):
        env.load_examples(tmp_path / "missing.jsonl")


def test_prompt_keeps_braces_in_question_verbatim(tmp_path):
    # a question or evidence that itself contains "{max_turns}" or "{question}" must not be substituted
    db = tmp_path / "t.sqlite"
    sqlite3.connect(db).close()
    ex = {"id": "q", "db_id": "t", "db_path": str(db), "question": "What does {max_turns} mean?",
          "evidence": "see {question}", "gold_sql": "SELECT 1", "difficulty": "easy", "source": "test"}
    for name, proto in protocols.PROTOCOLS.items():
        text = "\n".join(m["content"] for m in proto.build_messages(ex, "none", 5))
        assert "What does {max_turns} mean?" in text, name
        assert "see {question}" in text, name


def test_out_of_turns_sql_trail_forces_one_final_answer_turn(pets):
    trail = protocols.protocol_variant("trail", False, 0, force_final=True)
    query = "<reasoning>r</reasoning><sql>SELECT 1</sql>"
    answer = "<reasoning>r</reasoning><solution>SELECT 1</solution>"
    ep = env.new_episode(_example(pets), protocols.get(trail), max_turns=2)
    env.step(ep, query)
    obs, done = env.step(ep, query)  # the budget is spent without an answer: Alg. 1 line 31 asks for one
    assert not done and "no turns left" in obs and "<solution>" in obs
    assert env.pending_sql(ep, query) is None  # the forced turn runs no SQL...
    obs, done = env.step(ep, answer)  # ...and an answer in it is the episode's answer, scored as any other
    assert done and ep.stop_reason == "answer" and ep.final_sql == "SELECT 1" and len(ep.actions) == 3
    ep = env.new_episode(_example(pets), protocols.get(trail), max_turns=2)
    env.step(ep, query), env.step(ep, query)
    _, done = env.step(ep, query)  # a forced turn that queries again ends the episode unanswered
    assert done and ep.stop_reason == "max_turns" and ep.final_sql is None and ep.num_tool_calls == 2
    plain = env.new_episode(_example(pets), protocols.get("trail"), max_turns=2)
    env.step(plain, query)
    assert env.step(plain, query) == (None, True) and plain.stop_reason == "max_turns"
