"""data/teacher.py: every kept trajectory replays as format-valid and matches gold, on the gym, on Spider dev and on
BIRD- and SynSQL-format fixtures.
python -m pytest -q tests/test_teacher.py"""
import copy
import json
import random

import pytest

import env
import protocols
from data.teacher import break_sql, check_trajectory, teach, teach_all, write_teacher_data

PROTOCOLS = ["trust", "trail", "mtir", "skyrl"]


@pytest.fixture(scope="module")
def gym_examples(gym_dir):
    examples = env.load_examples(gym_dir / "train.jsonl")
    by_level = {}
    for ex in examples:  # a few of every difficulty level, so joins and nested queries are covered
        by_level.setdefault(ex["difficulty"], [])
        if len(by_level[ex["difficulty"]]) < 6:
            by_level[ex["difficulty"]].append(ex)
    return [ex for level in sorted(by_level) for ex in by_level[level]]


def assert_valid(records, examples):
    by_id = {ex["id"]: ex for ex in examples}
    for rec in records:
        ok, reason = check_trajectory(rec, by_id[rec["id"]])
        assert ok, (rec["id"], reason)
        roles = [m["role"] for m in rec["messages"]]
        assert roles[-1] == "assistant"  # ends with the answer turn, no observation after it


# -----------------------------------------------------------------------------
# the gym


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_gym_trajectories_validate_and_match_gold(gym_examples, protocol):
    kept, dropped = teach_all(gym_examples, protocol, max_turns=10, seed=0)
    assert len(kept) >= 0.9 * len(gym_examples), dropped
    assert_valid(kept, gym_examples)
    levels = {ex["id"]: ex["difficulty"] for ex in gym_examples}
    assert {levels[r["id"]] for r in kept} == set(levels.values())  # every level survives the check


def test_trust_trajectory_follows_the_case_study(gym_examples):
    """TRUST App. E: list tables, read schemas, probe values, propose, generate, confirm - all four actions."""
    ex = next(e for e in gym_examples if "'" in e["gold_sql"])  # a question with a quoted literal to probe
    rec, reason = teach(ex, "trust", max_turns=10, seed=0, repair_rate=0.0)
    assert rec is not None, reason
    turns = [m["content"] for m in rec["messages"] if m["role"] == "assistant"]
    actions = [t.split("<action>")[1].split("</action>")[0] for t in turns]
    assert actions[:2] == ["explore_schema", "explore_schema"]
    assert "sqlite_master" in turns[0] and "SELECT DISTINCT" in turns[2]
    assert actions[-3:] == ["propose_schema", "generate_sql", "confirm_answer"]
    think = turns[-2].split("<think>")[1].split("</think>")[0]
    assert ex["question"] in think  # restated right before the SQL, so its values are a few tokens back
    schema = json.loads(turns[-3].split("<schema>")[1].split("</schema>")[0])
    from rewards import extract_schema
    gold = extract_schema(ex["gold_sql"], ex["db_path"])
    assert {t.lower() for t in schema["tables"]} == gold["tables"]
    assert {f"{t.lower()}.{c.lower()}" for t, cs in schema["columns"].items() for c in cs} == gold["columns"]


def test_mtir_tool_calls_use_the_name_in_mtirs_prompt(gym_examples):
    rec, reason = teach(gym_examples[0], "mtir", max_turns=10, seed=0)
    assert rec is not None, reason
    calls = [m["content"].split("<tool_call>")[1].split("</tool_call>")[0] for m in rec["messages"]
             if m["role"] == "assistant" and "<tool_call>" in m["content"]]
    assert calls and all(json.loads(c)["name"] == "sql-execute_sql_query" for c in calls)
    assert '"sql-execute_sql_query"' in protocols.PROTOCOLS["mtir"].build_messages(gym_examples[0], "none", 10)[0]["content"]


def test_repaired_first_attempt_shows_the_error_and_still_passes(gym_examples):
    recs = [teach(ex, "trust", max_turns=10, seed=0, repair_rate=1.0)[0] for ex in gym_examples[:8]]
    repaired = [r for r in recs if r is not None and r["repaired"]]
    assert repaired, "repair_rate=1.0 should produce failing first attempts"
    obs = [m["content"] for m in repaired[0]["messages"] if m["role"] == protocols.PROTOCOLS["trust"].obs_role]
    assert any("Error" in o for o in obs)
    assert_valid(repaired, gym_examples)


@pytest.mark.parametrize("gold, broken", [
    ("SELECT `School Name` FROM schools WHERE `City` = 'Fresno'",
     "SELECT `School Name` FROM schools WHERE `City_name` = 'Fresno'"),
    ('SELECT "School Name" FROM schools WHERE "City" = \'Fresno\'',
     'SELECT "School Name" FROM schools WHERE "City_name" = \'Fresno\''),
    ("SELECT T1.name FROM singer AS T1 WHERE T1.age > 30", "SELECT T1.name FROM singer AS T1 WHERE T1.age_name > 30"),
])
def test_broken_attempt_renames_one_column_and_keeps_golds_quoting(gold, broken):
    # the repair turn then differs from the broken attempt in one name, in the quotes the gold SQL uses
    seeds = [s for s in range(20) if break_sql(gold, {"t": ["x"]}, random.Random(s))[0] == broken]
    assert seeds, [break_sql(gold, {"t": ["x"]}, random.Random(s))[0] for s in range(3)]
    assert break_sql(gold, {"t": ["x"]}, random.Random(seeds[0]))[1] in broken


def test_check_rejects_wrong_answer_and_forged_observation(gym_examples):
    ex = gym_examples[0]
    rec, _ = teach(ex, "skyrl", max_turns=10, seed=0)
    wrong = copy.deepcopy(rec)
    last = wrong["messages"][-1]["content"]
    wrong["messages"][-1]["content"] = last.split("<solution>")[0] + "<solution>SELECT 12345</solution>"
    assert check_trajectory(wrong, ex) == (False, "final SQL does not match gold")
    forged = copy.deepcopy(rec)
    i = next(i for i, m in enumerate(forged["messages"]) if m["role"] == protocols.PROTOCOLS["skyrl"].obs_role
             and i > len(protocols.PROTOCOLS["skyrl"].build_messages(ex, "none", 10)))
    forged["messages"][i]["content"] += " 42"
    ok, reason = check_trajectory(forged, ex)
    assert not ok and "observation" in reason


def test_same_seed_same_data_and_thinking_varies(gym_examples):
    a, _ = teach_all(gym_examples[:6], "trust", seed=3)
    b, _ = teach_all(gym_examples[:6], "trust", seed=3)
    assert a == b
    thinks = {r["messages"][-1]["content"].split("</think>")[0] for r in a}
    assert len(thinks) > 1  # thinking text comes from templates that vary per example


def test_written_jsonl_holds_exactly_the_kept_trajectories_and_reports_the_dropped(gym_examples, tmp_path, capsys):
    broken = dict(gym_examples[0], id="broken", gold_sql="SELECT nope FROM nowhere")  # cannot be taught
    out = tmp_path / "sub" / "t.jsonl"
    kept = write_teacher_data([broken] + gym_examples[:4], out, "trust", seed=0)
    assert [json.loads(line) for line in out.read_text().splitlines()] == kept == teach_all(gym_examples[:4], seed=0)[0]
    report = capsys.readouterr().out
    assert "kept 4/5" in report and "dropped 1: plan" in report
    with pytest.raises(ValueError, match="kept no trajectory"):
        write_teacher_data([broken], tmp_path / "none.jsonl", "trust")
    assert not (tmp_path / "none.jsonl").exists()  # nothing half-written when nothing was kept


# -----------------------------------------------------------------------------
# real Spider dev


def spider_examples(spider_dir, n=40):
    """Spider dev records through the data engineer's loader, a spread of databases."""
    from data.spider.prepare import load_spider
    records, _ = load_spider(spider_dir)
    step = max(1, len(records) // n)
    return records[::step][:n]


def test_spider_dev_trajectories_validate(spider_dir):
    examples = spider_examples(spider_dir)
    kept, dropped = teach_all(examples, "trust", max_turns=10, seed=0)
    assert len(kept) >= 0.8 * len(examples), dropped
    assert_valid(kept, examples)
    assert len({r["db_id"] for r in kept}) >= 5


def make_bird_like_db(path):
    """Two joined tables with BIRD-style names (spaces, parentheses) and a coded column the evidence explains."""
    import sqlite3
    path.parent.mkdir(parents=True)
    conn = sqlite3.connect(path)
    conn.execute('CREATE TABLE schools ("CDSCode" TEXT PRIMARY KEY, "School Name" TEXT, "County Name" TEXT)')
    conn.execute('CREATE TABLE frpm ("CDSCode" TEXT REFERENCES schools("CDSCode"), "Charter School (Y/N)" INTEGER, '
                 '"Enrollment (K-12)" REAL)')
    conn.executemany("INSERT INTO schools VALUES (?, ?, ?)",
                     [("01", "Oak High", "Alameda"), ("02", "Elm Prep", "Fresno"), ("03", "Ash Middle", "Alameda")])
    conn.executemany("INSERT INTO frpm VALUES (?, ?, ?)", [("01", 1, 120.0), ("02", 0, 80.0), ("03", 1, 95.5)])
    conn.commit()
    conn.close()


BIRD_LIKE = [  # BIRD quotes with backticks; SynSQL with double quotes
    ("How many schools are in Alameda?", "Alameda refers to `County Name` = 'Alameda'",
     "SELECT COUNT(*) FROM schools WHERE `County Name` = 'Alameda'"),
    ("List the names of charter schools in Alameda.", "charter schools refers to `Charter School (Y/N)` = 1",
     "SELECT T1.`School Name` FROM schools AS T1 INNER JOIN frpm AS T2 ON T1.CDSCode = T2.CDSCode "
     "WHERE T2.`Charter School (Y/N)` = 1 AND T1.`County Name` = 'Alameda'"),
    ("What is the highest K-12 enrollment?", "", 'SELECT MAX("Enrollment (K-12)") FROM frpm'),
]


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_bird_and_synsql_format_trajectories_validate(tmp_path, protocol):
    # the loaders' own records, not hand-made dicts: the teacher must take what data/bird and data/synsql produce
    from data.bird.prepare import load_bird
    from data.synsql.prepare import load_synsql
    make_bird_like_db(tmp_path / "bird" / "dev_databases" / "schools" / "schools.sqlite")
    (tmp_path / "bird" / "dev.json").write_text(json.dumps(
        [dict(question_id=i, db_id="schools", question=q, evidence=e, SQL=sql, difficulty="simple")
         for i, (q, e, sql) in enumerate(BIRD_LIKE)]))
    make_bird_like_db(tmp_path / "syn" / "databases" / "db_1" / "db_1.sqlite")
    (tmp_path / "syn" / "data.json").write_text(json.dumps(
        [dict(db_id="db_1", question=q, external_knowledge=e, sql=sql.replace("`", '"'), sql_complexity="Simple")
         for q, e, sql in BIRD_LIKE]))
    examples = load_bird(tmp_path / "bird")[0] + load_synsql(tmp_path / "syn")[0]
    assert len(examples) == 6
    kept, dropped = teach_all(examples, protocol, max_turns=10, seed=0)
    assert len(kept) == 6, dropped
    assert_valid(kept, examples)
    join = next(r for r in kept if r["id"] == examples[1]["id"])  # the join reads and proposes both tables
    assert all(t in json.dumps(join["messages"]) for t in ("CREATE TABLE schools", "CREATE TABLE frpm"))


@pytest.mark.parametrize("schema_mode", ["explore_turn", "prompt"])
def test_prefilled_schema_skips_listing_but_still_validates(gym_examples, schema_mode):
    kept, dropped = teach_all(gym_examples[:8], "trust", max_turns=10, schema_mode=schema_mode, seed=0)
    assert len(kept) == 8, dropped
    assert_valid(kept, gym_examples)
    first = next(m["content"] for m in kept[0]["messages"][len(protocols.PROTOCOLS["trust"].build_messages(
        gym_examples[0], schema_mode, 10)):] if m["role"] == "assistant")
    assert "type = 'table' AND name IN" in first  # verifies the needed tables instead of listing them all


def test_trajectories_do_not_depend_on_python_hash_seed(gym_dir, tmp_path):
    # extract_schema returns sets, whose order follows PYTHONHASHSEED: the teacher must not leak that order into
    # the proposed schema, or the same seed would give different SFT data in different processes
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    outs = []
    for hash_seed in ["1", "2"]:
        out = tmp_path / f"t{hash_seed}.jsonl"
        subprocess.run([sys.executable, "data/teacher.py", "--data", str(gym_dir / "train.jsonl"), "--protocol",
                        "trust", "--limit", "60", "--out", str(out)], cwd=root, check=True, capture_output=True,
                       env={**__import__("os").environ, "PYTHONHASHSEED": hash_seed})
        outs.append(out.read_text())
    assert outs[0] == outs[1] and outs[0].count("\n") > 50
