"""Data tests: the built-in gym (determinism, every gold query answers, splits), the Spider loader and hardness on the
real dev set, and round trips of tiny BIRD- and SynSQL-format fixtures.    python -m pytest -q tests/test_data.py"""
import hashlib
import json
import re
import sqlite3
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from data.bird.prepare import load_bird
from data.gym.prepare import LEVELS, TEST_DBS, TRAIN_DBS, ensure_gym, prepare
from data.spider.prepare import check_gold, finish, hardness_level, iter_json_array, load_spider, spider_hardness
from data.synsql.prepare import load_synsql

ROOT = Path(__file__).resolve().parents[1]
FIELDS = {"id", "db_id", "db_path", "question", "evidence", "gold_sql", "difficulty", "source"}


def read_jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def tree_hashes(folder):
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(folder).rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def gym(gym_dir):
    return {split: read_jsonl(gym_dir / f"{split}.jsonl") for split in ("train", "dev", "test")}


# -----------------------------------------------------------------------------
# gym


def test_gym_same_seed_gives_identical_bytes_and_another_seed_differs(tmp_path):
    prepare(tmp_path / "a", seed=3)
    prepare(tmp_path / "b", seed=3)
    prepare(tmp_path / "c", seed=4)
    a, b, c = (tree_hashes(tmp_path / x) for x in "abc")
    assert len(a) == 4 + len(TRAIN_DBS) + len(TEST_DBS)  # 3 jsonl files, the stamp, one .sqlite per database
    assert a == b
    assert a.keys() == c.keys()
    assert a["train.jsonl"] != c["train.jsonl"] and a["databases/shop/shop.sqlite"] != c["databases/shop/shop.sqlite"]


def test_ensure_gym_is_a_no_op_when_built(gym_dir):
    before = {p: p.stat().st_mtime_ns for p in gym_dir.glob("*.jsonl")}
    assert ensure_gym() == gym_dir
    assert {p: p.stat().st_mtime_ns for p in gym_dir.glob("*.jsonl")} == before


def test_gym_records_follow_the_example_format(gym, gym_dir):
    for split, records in gym.items():
        assert len(records) >= 200
        assert len({r["id"] for r in records}) == len(records)
        for r in records:
            assert set(r) == FIELDS and r["source"] == "gym"
            assert not Path(r["db_path"]).is_absolute() and (gym_dir / r["db_path"]).exists()


def test_every_gym_gold_query_runs_and_returns_something(gym, gym_dir):
    conns = {}
    for split, records in gym.items():
        for r in records:
            conn = conns.setdefault(r["db_id"], sqlite3.connect(f"file:{gym_dir / r['db_path']}?mode=ro", uri=True))
            rows = conn.execute(r["gold_sql"]).fetchall()
            assert rows and rows != [(0,)] and any(v is not None for row in rows for v in row), (split, r)


def test_gym_difficulty_mix_has_all_four_levels_in_every_split(gym):
    for split, records in gym.items():
        share = {lv: n / len(records) for lv, n in Counter(r["difficulty"] for r in records).items()}
        assert set(share) == set(LEVELS), split
        assert all(0.15 <= s <= 0.40 for s in share.values()), (split, share)
    # the level names mean what they say about the SQL
    by_level = {lv: [r["gold_sql"] for r in gym["train"] if r["difficulty"] == lv] for lv in LEVELS}
    assert not any("JOIN" in s or "GROUP BY" in s or "LIMIT" in s for s in by_level["easy"])
    assert all("GROUP BY" in s or re.search(r"\b(AVG|SUM|MIN|MAX)\(", s) for s in by_level["medium"])
    assert all("ORDER BY" in s for s in by_level["hard"])
    assert all("JOIN" in s or "(SELECT" in s for s in by_level["extra"])


def test_gym_splits_hold_out_databases_templates_and_values(gym):
    train_dbs = {r["db_id"] for r in gym["train"]}
    assert train_dbs == set(TRAIN_DBS) and {r["db_id"] for r in gym["dev"]} <= train_dbs
    assert {r["db_id"] for r in gym["test"]} == set(TEST_DBS)
    # dev reuses the databases but never a train query; test uses query shapes train never shows
    assert not {r["gold_sql"] for r in gym["dev"]} & {r["gold_sql"] for r in gym["train"]}
    for shape in ["NOT IN", "IS NULL", "OFFSET", "HAVING AVG"]:
        assert not any(shape in r["gold_sql"] for r in gym["train"] + gym["dev"]), shape
        assert any(shape in r["gold_sql"] for r in gym["test"]), shape


def test_gym_questions_quote_values_exactly_as_the_sql_does(gym):
    # "... in the city 'Fresno'?" -> WHERE `City` = 'Fresno': same characters, so the same tokens to copy
    for r in gym["train"] + gym["test"]:
        for literal in re.findall(r"'[^']*'", r["gold_sql"]):
            if literal != "'%Y'":  # strftime's format, not a value
                assert literal in r["question"] or literal in r["evidence"], (literal, r)
    q = next(r for r in gym["train"] if "in the city '" in r["question"])
    city = re.search(r"in the city ('[^']*')", q["question"]).group(1)
    assert f'`City` = {city}' in q["gold_sql"]


def test_gym_names_read_the_same_in_evidence_schema_tool_call_and_answer(gym, gym_dir):
    # backticks, as in BIRD: a JSON tool call needs no escapes for them, so a model copies the same tokens it read
    for r in gym["train"] + gym["dev"] + gym["test"]:
        assert '"' not in r["gold_sql"] and json.dumps(r["gold_sql"]) == f'"{r["gold_sql"]}"', r["gold_sql"]
    coded = next(r for r in gym["train"] if "`Charter School (Y/N)` = 1" in r["evidence"])
    assert "`Charter School (Y/N)` = 1" in coded["gold_sql"]
    conn = sqlite3.connect(f"file:{gym_dir / 'databases/schools/schools.sqlite'}?mode=ro", uri=True)
    create = conn.execute("SELECT sql FROM sqlite_master WHERE name = 'schools'").fetchone()[0]
    assert "`Charter School (Y/N)` INTEGER" in create and '"' not in create


def test_gym_databases_are_messy_like_bird(gym, gym_dir):
    coded = [r for r in gym["train"] if r["evidence"]]
    assert len(coded) > 100 and all(" refers to " in r["evidence"] for r in coded)
    assert any("`Charter School (Y/N)` = 1" in r["gold_sql"] for r in coded)
    conn = sqlite3.connect(f"file:{gym_dir / 'databases/schools/schools.sqlite'}?mode=ro", uri=True)
    assert conn.execute("SELECT COUNT(*) FROM sqlite_master WHERE type = 'table'").fetchone()[0] >= 30
    assert conn.execute('SELECT COUNT(*) FROM schools WHERE "Phone" IS NULL').fetchone()[0] > 0
    assert conn.execute('SELECT typeof("Open Date") FROM schools LIMIT 1').fetchone()[0] == "text"
    assert conn.execute("PRAGMA foreign_key_list(teachers)").fetchall()  # real foreign keys


# -----------------------------------------------------------------------------
# Spider

WHERE_LIKE = 9  # index of 'like' in Spider's WHERE_OPS


def official_hardness(sql):
    """Independent oracle: the official rules on the parse Spider ships in dev.json ('sql' field)."""
    conds = sql["from"]["conds"][::2] + sql["where"][::2] + sql["having"][::2]
    nested = [v for c in conds for v in (c[3], c[4]) if isinstance(v, dict)]
    nested += [sql[k] for k in ("intersect", "except", "union") if sql[k]]
    c1 = sum(bool(sql[k]) for k in ("where", "groupBy", "orderBy")) + (sql["limit"] is not None)
    c1 += max(len(sql["from"]["table_units"]) - 1, 0)
    c1 += (sql["from"]["conds"][1::2] + sql["where"][1::2] + sql["having"][1::2]).count("or")
    c1 += sum(c[1] == WHERE_LIKE for c in conds)

    def agg(units):  # Spider's has_agg, quirks included
        return sum(u[0] != 0 for u in units)
    n_agg = agg(sql["select"][1]) + agg(sql["where"][::2]) + agg(sql["groupBy"]) + agg(sql["having"])
    if sql["orderBy"]:
        n_agg += agg([u[1] for u in sql["orderBy"][1] if u[1]] + [u[2] for u in sql["orderBy"][1] if u[2]])
    others = (n_agg > 1) + (len(sql["select"][1]) > 1) + (len(sql["where"]) > 1) + (len(sql["groupBy"]) > 1)
    return hardness_level(c1, len(nested), others)  # same thresholds; the counts are what is checked


@pytest.mark.parametrize("sql, level", [
    ("SELECT count(*) FROM singer", "easy"),
    ("SELECT name ,  country ,  age FROM singer ORDER BY age DESC", "medium"),
    ("SELECT name FROM stadium WHERE stadium_id NOT IN (SELECT stadium_id FROM concert)", "hard"),
    ("SELECT country FROM singer WHERE age  >  40 INTERSECT SELECT country FROM singer WHERE age  <  30", "hard"),
    ("SELECT T2.name FROM singer_in_concert AS T1 JOIN singer AS T2 ON T1.singer_id  =  T2.singer_id "
     "JOIN concert AS T3 ON T1.concert_id  =  T3.concert_id WHERE T3.year  =  2014", "hard"),
    ("SELECT T2.name ,  T2.location FROM concert AS T1 JOIN stadium AS T2 ON T1.stadium_id  =  T2.stadium_id "
     "WHERE T1.Year  =  2014 INTERSECT SELECT T2.name ,  T2.location FROM concert AS T1 JOIN stadium AS T2 "
     "ON T1.stadium_id  =  T2.stadium_id WHERE T1.Year  =  2015", "extra"),
    # a set operation inside FROM is a table unit, not a nested query: officially easy
    ("SELECT COUNT(*) FROM (SELECT Name FROM country INTERSECT SELECT Name FROM city)", "easy"),
])
def test_spider_hardness_on_known_queries(sql, level):
    assert spider_hardness(sql) == level


def test_spider_dev_loads_972_reports_62_and_every_gold_query_runs(spider_dir):
    records, skipped = load_spider(spider_dir, "dev.json")
    assert len(records) == 972 and len(skipped) == 62
    assert {s["db_id"] for s in skipped} == {"wta_1"} and all(s["reason"] == "database missing" for s in skipped)
    assert all(set(r) == FIELDS and Path(r["db_path"]).is_absolute() and r["source"] == "spider" for r in records)
    assert check_gold(records) == []


def test_spider_hardness_matches_the_official_rules_on_all_of_dev(spider_dir):
    dev = json.loads((spider_dir / "dev.json").read_text())
    ours = [spider_hardness(ex["query"]) for ex in dev]
    official = [official_hardness(ex["sql"]) for ex in dev]
    assert Counter(official) == {"easy": 248, "medium": 446, "hard": 174, "extra": 166}  # the published split
    assert [(ex["query"], o) for ex, a, o in zip(dev, ours, official) if a != o] == []


def test_spider_cli_reports_the_skipped_questions(spider_dir, tmp_path):
    out = subprocess.run([sys.executable, "data/spider/prepare.py", "--spider-dir", str(spider_dir),
                          "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert "kept 972 questions" in out and "skipped 62 questions (database missing)" in out and "wta_1" in out
    assert len(read_jsonl(tmp_path / "dev.jsonl")) == 972


def test_missing_spider_folder_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="Spider folder not found"):
        load_spider(tmp_path / "nope")


# -----------------------------------------------------------------------------
# BIRD and SynSQL fixtures


def make_db(path):
    path.parent.mkdir(parents=True)
    conn = sqlite3.connect(path)
    conn.execute('CREATE TABLE frpm ("CDSCode" TEXT PRIMARY KEY, "County Name" TEXT, "Enrollment (K-12)" REAL)')
    conn.executemany("INSERT INTO frpm VALUES (?, ?, ?)", [("01", "Alameda", 120.0), ("02", "Fresno", 80.0)])
    conn.commit()
    conn.close()


def test_bird_round_trip(tmp_path):
    bird = tmp_path / "bird"
    make_db(bird / "dev_databases" / "schools" / "schools.sqlite")
    dev = [
        dict(question_id=0, db_id="schools", question="How many schools are in Alameda?",
             evidence="Alameda refers to `County Name` = 'Alameda'",
             SQL="SELECT COUNT(*) FROM frpm WHERE `County Name` = 'Alameda'", difficulty="simple"),
        dict(question_id=1, db_id="schools", question="Highest enrollment?", evidence="",
             SQL="SELECT MAX(`Enrollment (K-12)`) FROM frpm", difficulty="moderate"),
        dict(question_id=2, db_id="schools", question="Broken gold?", evidence="",
             SQL="SELECT nope FROM frpm", difficulty="challenging"),
        dict(question_id=3, db_id="card_games", question="No database here", evidence="",
             SQL="SELECT 1", difficulty="simple"),
    ]
    (bird / "dev.json").write_text(json.dumps(dev, indent=2))
    records, skipped = load_bird(bird)
    assert [r["id"] for r in records] == ["bird-dev-0", "bird-dev-1", "bird-dev-2"]
    assert skipped == [dict(db_id="card_games", question="No database here", reason="database missing")]
    kept, skipped = finish("bird", records, skipped, tmp_path / "out" / "dev.jsonl")
    back = read_jsonl(tmp_path / "out" / "dev.jsonl")
    assert back == kept and len(back) == 2 and {s["reason"] for s in skipped} == {"database missing", "gold SQL fails"}
    assert back[0]["evidence"] == dev[0]["evidence"] and back[0]["gold_sql"] == dev[0]["SQL"]
    assert [r["difficulty"] for r in back] == ["simple", "moderate"] and back[0]["source"] == "bird"
    assert Path(back[0]["db_path"]).samefile(bird / "dev_databases" / "schools" / "schools.sqlite")


def test_bird_cli_runs_as_a_script_and_names_a_missing_folder(tmp_path):
    bird = tmp_path / "bird"
    make_db(bird / "dev_databases" / "schools" / "schools.sqlite")
    ex = dict(question_id=7, db_id="schools", question="How many?", evidence="", SQL="SELECT COUNT(*) FROM frpm",
              difficulty="simple")
    (bird / "dev.json").write_text(json.dumps([ex]))

    def run(d):
        return subprocess.run([sys.executable, "data/bird/prepare.py", "--bird-dir", str(d), "--out",
                               str(tmp_path / "out")], cwd=ROOT, capture_output=True, text=True)
    assert run(bird).returncode == 0 and read_jsonl(tmp_path / "out" / "dev.jsonl")[0]["id"] == "bird-dev-7"
    bad = run(tmp_path / "missing")
    assert bad.returncode != 0 and "BIRD folder not found" in bad.stderr


def test_synsql_round_trip_with_limit(tmp_path):
    syn = tmp_path / "synsql"
    make_db(syn / "databases" / "db_1" / "db_1.sqlite")
    data = [dict(db_id="db_1", question=f"Q{i}?", sql=f"SELECT COUNT(*) FROM frpm WHERE \"Enrollment (K-12)\" > {i}",
                 external_knowledge="K-12 means all grades" if i == 0 else "", sql_complexity="Simple", cot="...")
            for i in range(4)]
    data[1]["db_id"] = "db_missing"
    (syn / "data.json").write_text(json.dumps(data))
    records, skipped = load_synsql(syn, limit=3)
    assert [r["question"] for r in records] == ["Q0?", "Q2?"] and len(skipped) == 1
    kept, _ = finish("synsql", records, skipped, tmp_path / "out.jsonl")
    back = read_jsonl(tmp_path / "out.jsonl")
    assert back == kept and back[0]["evidence"] == "K-12 means all grades" and back[0]["difficulty"] == "Simple"
    assert all(set(r) == FIELDS and r["source"] == "synsql" for r in back)


def test_json_array_streaming_across_chunk_boundaries(tmp_path):
    items = [{"q": "a" * i, "n": i, "nested": {"x": [1, 2, "]"]}} for i in range(50)] + [12345, "tail"]
    path = tmp_path / "big.json"
    path.write_text(json.dumps(items, indent=1))
    assert list(iter_json_array(path, chunk_size=7)) == items
    path.write_text(json.dumps(items)[:-1])  # cut off: must not pass silently
    with pytest.raises(ValueError):
        list(iter_json_array(path, chunk_size=7))


def test_finish_keeps_a_slow_gold_query_but_drops_a_broken_one(tmp_path, capsys):
    db = tmp_path / "db" / "t.sqlite"
    make_db(db)
    slow = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c"
    records = [dict(id=str(i), db_id="t", db_path=str(db), question="q", evidence="", gold_sql=sql,
                    difficulty="easy", source="test") for i, sql in enumerate([slow, "SELECT nope FROM frpm"])]
    kept, skipped = finish("t", records, [], tmp_path / "out.jsonl", timeout_s=0.2)
    assert [r["id"] for r in kept] == ["0"] and [s["reason"] for s in skipped] == ["gold SQL fails"]
    assert "2 gold queries failed or timed out" in capsys.readouterr().out
