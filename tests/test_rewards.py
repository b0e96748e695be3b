"""rewards.py: the papers' worked examples, extract_schema scenarios and its agreement with Spider's annotations.

    python -m pytest -q tests/test_rewards.py
"""
import json
import sqlite3
from types import SimpleNamespace

import pytest

import rewards
from rewards import (REWARDS, bigram_jaccard, exec_arctic, exec_binary, exec_trust, extract_schema, format_mtir,
                     format_trust, mtir_exec_result, proposed_schema_items, schema_jaccard, schema_match,
                     skyrl_reward, trust_schema_reward, turn_budget, turn_reward)

# -----------------------------------------------------------------------------
# SQL-Trail A.4 worked examples


def test_bigram_paper_example():
    assert bigram_jaccard("SELECT name FROM teacher", "SELECT name FROM student") == 0.5


def test_bigram_ignores_whitespace_and_keyword_case_but_not_literals():
    assert bigram_jaccard("select  name\n FROM student", "SELECT name FROM student") == 1.0
    assert bigram_jaccard("SELECT a FROM t WHERE b = 'X'", "SELECT a FROM t WHERE b = 'x'") < 1.0
    assert bigram_jaccard(None, "SELECT 1") == 0.0 and bigram_jaccard("SELECT 'unclosed", "SELECT 1") == 0.0


def test_bigram_reads_a_quoted_name_as_one_token():
    # the paper's example with BIRD-style names: one name differs, so 1 of the 5 bigrams is shared, as with bare names
    assert bigram_jaccard("SELECT `School Name` FROM schools", "SELECT `School City` FROM schools") == 0.2
    assert bigram_jaccard('SELECT "School Name" FROM [schools]', "SELECT `school name` FROM schools") == 1.0


def test_schema_jaccard_paper_example():
    assert schema_jaccard({"employees", "wages"}, {"employees", "salary"}) == pytest.approx(1 / 3)
    assert schema_jaccard(set(), set()) == 0.0


@pytest.mark.parametrize("difficulty,turns,exec_ok,expected", [
    ("easy", 2, False, 1.0), ("simple", 3, True, 0.0),            # simple: t <= 2, correctness not required
    ("medium", 3, False, 1.0), ("moderate", 4, True, 0.0),        # medium: t <= 3
    ("hard", 9, True, 1.0), ("challenging", 10, True, 0.0),       # hard/extra: correct and t < T (T = 10)
    ("extra", 1, False, 0.0), ("extra", 4, True, 1.0),
    ("Simple", 2, False, 1.0), ("Moderate", 3, False, 1.0),     # SynSQL's labels, SQL-Trail's own RL data
    ("Complex", 4, False, 0.0), ("Highly Complex", 4, True, 1.0),
    ("unknown", 1, False, 0.0), ("unknown", 4, True, 1.0),      # unlabelled: the hard rule
])
def test_turn_reward_thresholds(difficulty, turns, exec_ok, expected):
    assert turn_reward(difficulty, turns, exec_ok, budget=10) == expected


def test_turn_reward_rejects_unknown_label():
    with pytest.raises(ValueError, match="unknown difficulty 'expert'"):
        turn_reward("expert", 1, True, 10)

# -----------------------------------------------------------------------------
# execution and format components


def test_execution_values_per_paper():
    outcomes = ["correct", "wrong", "error", "missing"]
    assert [exec_trust(o) for o in outcomes] == [1.0, 0.2, 0.0, 0.0]          # TRUST eq. 1
    assert [exec_binary(o) for o in outcomes] == [1.0, 0.0, 0.0, 0.0]         # SQL-Trail eq. 3
    assert [exec_arctic(o) for o in outcomes] == [1.0, 0.1, 0.0, 0.0]         # Arctic-Text2SQL-R1
    # MTIR eqs. 6-7 as (R_e, R_r); a bad format zeroes both
    assert [mtir_exec_result(o, True) for o in outcomes] == [(0.1, 1.0), (0.1, -1.0), (-0.1, 0.0), (0.0, 0.0)]
    assert mtir_exec_result("correct", False) == (0.0, 0.0)
    # SkyRL: -1 bad format, 0 wrong, 1 right
    assert [skyrl_reward("correct", False), skyrl_reward("wrong", True), skyrl_reward("correct", True)] == [-1, 0, 1]


def _episode(names, valid=None, errors=None, final_sql=None, proposed=None, propose_turn=-1, max_turns=10,
             schema_mode="none"):
    actions = [SimpleNamespace(name=n, valid=True if valid is None else valid[i]) for i, n in enumerate(names)]
    protocol = SimpleNamespace(answer_action="confirm_answer" if "confirm_answer" in names else "answer")
    return SimpleNamespace(actions=actions, turn_valid=[a.valid for a in actions], max_turns=max_turns,
                           exec_errors=errors or [None] * len(names), final_sql=final_sql, protocol=protocol,
                           proposed_schema=proposed, propose_turn=propose_turn, schema_mode=schema_mode)


TRUST4 = ["explore_schema", "propose_schema", "generate_sql", "confirm_answer"]


def test_trust_format_needs_all_four_actions_valid_turns_and_no_errors():
    assert format_trust(_episode(TRUST4)) == 0.1
    assert format_trust(_episode(TRUST4[:1] + TRUST4[2:])) == 0.0                         # never proposed
    assert format_trust(_episode(TRUST4, valid=[True, False, True, True])) == 0.0
    assert format_trust(_episode(TRUST4, errors=[None, None, "no such column: x", None])) == 0.0


def test_trust_format_counts_the_prefilled_explore_turn():
    # --schema-mode explore_turn: the prompt holds the explore_schema turn, so the agent's three actions are perfect
    assert format_trust(_episode(TRUST4[1:], schema_mode="explore_turn")) == 0.1
    assert format_trust(_episode(TRUST4[1:], schema_mode="none")) == 0.0


def test_mtir_format_is_plus_minus_point_one():
    assert format_mtir(_episode(["sql", "answer"])) == 0.1
    assert format_mtir(_episode(["sql", "answer"], valid=[False, True])) == -0.1
    assert format_mtir(_episode(["sql", "sql"])) == -0.1  # ran out of turns without an answer

# -----------------------------------------------------------------------------
# TRUST-SQL f_match variants (§5.2)

GOLD = {"singer", "singer.name", "singer.age"}


def test_f_match_sparse_is_exact_match_dense_gates_on_recall():
    assert schema_match(GOLD, GOLD) == 1.0
    assert schema_match(GOLD | {"singer.country"}, GOLD) == 0.0                       # extra item: sparse fails
    assert schema_match(GOLD | {"singer.country"}, GOLD, dense=True) == pytest.approx(3 / 4)  # precision
    assert schema_match(GOLD - {"singer.age"}, GOLD, dense=True) == 0.0              # recall gate


def test_f_match_coupling():
    assert trust_schema_reward(GOLD, GOLD, "wrong") == 0.0                            # default: sparse + coupled
    assert trust_schema_reward(GOLD, GOLD, "correct") == 1.0
    assert trust_schema_reward(GOLD, GOLD, "wrong", "sparse_uncoupled") == 1.0
    assert trust_schema_reward(GOLD | {"concert"}, GOLD, "correct", "dense_coupled") == pytest.approx(3 / 4)
    with pytest.raises(ValueError, match="f_match variant"):
        trust_schema_reward(GOLD, GOLD, "correct", "dense")


def test_proposed_schema_normalisation_tolerates_model_output():
    proposed = {"tables": ["Singer"], "columns": {"singer": ["Name", "`Age`", "*"]}, "joins": []}
    assert proposed_schema_items(proposed) == GOLD
    assert proposed_schema_items({"columns": ["singer.name"]}) == {"singer.name"}
    assert proposed_schema_items("not a dict") == set() and proposed_schema_items({"tables": [3]}) == set()

# -----------------------------------------------------------------------------
# extract_schema


@pytest.fixture(scope="module")
def quirky_db(tmp_path_factory):
    path = tmp_path_factory.mktemp("db") / "schools.sqlite"
    con = sqlite3.connect(path)
    con.executescript('''
        CREATE TABLE frpm ("CDSCode" TEXT, "Charter School (Y/N)" INTEGER, "Free Meal Count (K-12)" REAL);
        CREATE TABLE schools (CDSCode TEXT, City TEXT, "School Name" TEXT);
        INSERT INTO schools VALUES ('1', 'Fresno', 'A');''')
    con.close()
    return str(path)


@pytest.mark.parametrize("sql,tables,columns", [
    # aliases resolve to real tables; join-condition columns count; names lower-cased
    ("SELECT T2.City FROM frpm AS T1 JOIN schools AS T2 ON T1.CDSCode = T2.CDSCode",
     {"frpm", "schools"}, {"schools.city", "frpm.cdscode", "schools.cdscode"}),
    # quoted identifiers with spaces: double quotes, backticks, brackets
    ('SELECT "Free Meal Count (K-12)" FROM frpm WHERE `Charter School (Y/N)` = 1 AND [CDSCode] > 0',
     {"frpm"}, {"frpm.free meal count (k-12)", "frpm.charter school (y/n)", "frpm.cdscode"}),
    # `*` and count(*) add no columns
    ("SELECT * FROM schools", {"schools"}, set()),
    ("SELECT count(*) FROM frpm", {"frpm"}, set()),
    # a SELECT alias referenced in ORDER BY is not a column
    ("SELECT City, count(*) AS cnt FROM schools GROUP BY City ORDER BY cnt DESC", {"schools"}, {"schools.city"}),
    # CTE and derived table: the outer columns resolve to the inner real table
    ("WITH c AS (SELECT City AS town FROM schools) SELECT town FROM c", {"schools"}, {"schools.city"}),
    ("SELECT n FROM (SELECT \"School Name\" AS n FROM schools) AS s WHERE n LIKE 'A%'", {"schools"},
     {"schools.school name"}),
    # set operations and scalar subqueries collect from every branch
    ("SELECT CDSCode FROM frpm UNION SELECT CDSCode FROM schools", {"frpm", "schools"},
     {"frpm.cdscode", "schools.cdscode"}),
    ("SELECT City FROM schools WHERE CDSCode IN (SELECT CDSCode FROM frpm WHERE \"Charter School (Y/N)\" = 1)",
     {"frpm", "schools"}, {"schools.city", "schools.cdscode", "frpm.cdscode", "frpm.charter school (y/n)"}),
    # SQLite reads a double-quoted non-column as a string literal
    ('SELECT CDSCode FROM schools WHERE City = "Fresno"', {"schools"}, {"schools.cdscode", "schools.city"}),
    # ...but a backticked or bracketed one is always an identifier: SQLite fails on it, it is no string
    ("SELECT City FROM schools WHERE `Budget` > 5 AND [Rank] < 3", {"schools"},
     {"schools.city", "schools.budget", "schools.rank"}),
    # hallucinated names stay visible (the schema Jaccard should punish them)
    ("SELECT s.wages FROM schools AS s JOIN frpm AS f ON s.CDSCode = f.CDSCode", {"frpm", "schools"},
     {"schools.wages", "schools.cdscode", "frpm.cdscode"}),
])
def test_extract_schema(quirky_db, sql, tables, columns):
    assert extract_schema(sql, quirky_db) == {"tables": tables, "columns": columns}


def test_extract_schema_bad_input(quirky_db, tmp_path):
    with pytest.raises(FileNotFoundError, match="absolute db_path"):
        extract_schema("SELECT 1", tmp_path / "missing.sqlite")
    assert rewards.safe_schema_items("SELECT FROM WHERE (", quirky_db) == set()


# a loop the tiny model really wrote (gym test, seed 2's SFT checkpoint), 19 JOINs long: sqlglot took 11 s to parse
# it, doubling with each JOIN that has no ON/USING of its own, so 30 would take hours
JOIN_LOOP = "SELECT COUNT(*) FROM flights AS T1" + " JOIN members AS T1" * 30 + " JOIN members AS T2 ON T1.x = T2.x"


@pytest.mark.parametrize("sql, bare", [
    ("SELECT * FROM frpm AS a JOIN schools AS b ON a.CDSCode = b.CDSCode JOIN frpm AS c USING (CDSCode)", 0),
    ("SELECT * FROM frpm JOIN schools JOIN frpm AS c ON c.x = schools.x ON frpm.x = schools.x", 1),  # nested join
    ("SELECT * FROM frpm JOIN schools JOIN frpm AS f WHERE frpm.x = schools.x", 2),
    ("SELECT * FROM frpm JOIN (SELECT * FROM schools JOIN frpm) AS s ON s.x = frpm.x", 1),  # the inner one
    ("SELECT `Charter School (Y/N)` FROM frpm JOIN schools", 1),  # a ( in a quoted name is no parenthesis
    ("SELECT * FROM frpm" + " JOIN schools AS s ON s.x = frpm.x" * 8 + " JOIN schools" * 16, 16),
    (JOIN_LOOP, 30),
    ("SELECT * FROM frpm JOIN schools WHERE x = 'unclosed", 0),  # no tokens: sqlglot's parser fails on it at once
])
def test_bare_joins_counts_joins_without_their_own_condition(sql, bare):
    assert rewards.bare_joins(sql) == bare


def test_a_join_loop_from_the_model_is_refused_not_parsed_for_hours(quirky_db):
    assert rewards.safe_schema_items(JOIN_LOOP, quirky_db) == set()
    with pytest.raises(ValueError, match="JOINs without ON/USING"):
        extract_schema(JOIN_LOOP, quirky_db)
    # up to the limit, a bare join chain is still read (SQLite runs it as a cross join)
    eight = "SELECT * FROM frpm" + " JOIN schools" * rewards.MAX_BARE_JOINS
    assert extract_schema(eight, quirky_db)["tables"] == {"frpm", "schools"}


def _spider_gold(sql, t):
    """Tables and "table.column"s in Spider's own parse (column id 0 = "*" is excluded, as in extract_schema)."""
    tables = set()
    cols = set()

    def name(ti):
        return t["table_names_original"][ti].lower()

    def col_unit(cu):
        if cu and cu[1]:
            cols.add(f'{name(t["column_names_original"][cu[1]][0])}.'
                     f'{t["column_names_original"][cu[1]][1].lower()}')

    def val_unit(vu):
        if vu:
            col_unit(vu[1]), col_unit(vu[2])

    def conds(cs):
        for c in cs:
            if not isinstance(c, str):  # "and"/"or" separators
                val_unit(c[2])
                for v in c[3:5]:  # a value is a nested query, a column (join conditions) or a literal
                    walk(v) if isinstance(v, dict) else col_unit(v) if isinstance(v, list) else None

    def walk(s):
        for kind, unit in s["from"]["table_units"]:
            tables.add(name(unit)) if kind == "table_unit" else walk(unit)
        conds(s["from"]["conds"]), conds(s["where"]), conds(s["having"])
        for _, vu in s["select"][1]:
            val_unit(vu)
        for cu in s["groupBy"]:
            col_unit(cu)
        for vu in (s["orderBy"] or [None, []])[1]:
            val_unit(vu)
        for k in ("intersect", "union", "except"):
            if s[k]:
                walk(s[k])
    walk(sql)
    return tables, cols


def test_extract_schema_agrees_with_spider_annotations(spider_dir):
    # Measured: tables 972/972 (100%), columns 966/972 (99.38%). The 6 column disagreements are annotation quirks
    # counted against us: Spider's parser drops an OR-ed join condition (dev 225-228, flights.sourceairport) and maps
    # T1 to Likes instead of Friend across an INTERSECT (dev 900-901).
    dev = json.loads((spider_dir / "dev.json").read_text())
    schemas = {t["db_id"]: t for t in json.loads((spider_dir / "tables.json").read_text())}
    n = tables_ok = columns_ok = 0
    for ex in dev:
        db = spider_dir / "database" / ex["db_id"] / f'{ex["db_id"]}.sqlite'
        if not db.exists():  # wta_1
            continue
        gold_tables, gold_columns = _spider_gold(ex["sql"], schemas[ex["db_id"]])
        ours = extract_schema(ex["query"], str(db))
        n += 1
        tables_ok += (ours["tables"] == gold_tables)
        columns_ok += (ours["columns"] == gold_columns)
    print(f"extract_schema vs Spider dev annotations: tables {tables_ok}/{n} = {tables_ok / n:.2%}, "
          f"columns {columns_ok}/{n} = {columns_ok / n:.2%}")
    assert n == 972
    assert tables_ok / n >= 0.99 and columns_ok / n >= 0.99

# -----------------------------------------------------------------------------
# recipes end to end on a real Spider database (execution through env.run_sql)


@pytest.fixture(scope="module")
def singer_example(spider_dir):
    db = spider_dir / "database" / "concert_singer" / "concert_singer.sqlite"
    return {"id": "t0", "db_id": "concert_singer", "db_path": str(db), "question": "Names of singers older than 40?",
            "evidence": "", "gold_sql": "SELECT Name FROM singer WHERE Age > 40", "difficulty": "easy",
            "source": "spider"}


def _traj(episode):
    return SimpleNamespace(episode=episode, num_turns=len(episode.actions))


RIGHT = "SELECT name FROM singer WHERE age > 40"
WRONG = "SELECT name FROM singer WHERE age > 30"
BROKEN = "SELECT nme FROM singer"


def test_trust_recipe(singer_example):
    proposal = {"tables": ["singer"], "columns": {"singer": ["name", "age"]}, "joins": []}
    ep = _episode(TRUST4, final_sql=RIGHT, proposed=proposal, propose_turn=1)
    assert REWARDS["trust"](_traj(ep), singer_example) == {"full": 1.1, "schema": 1.0, "exec": 1.0, "format": 0.1,
                                                           "correct": 1.0}
    ep = _episode(TRUST4, final_sql=WRONG, proposed=proposal, propose_turn=1)
    r = REWARDS["trust"](_traj(ep), singer_example)
    assert (r["full"], r["schema"]) == (pytest.approx(0.3), 0.0)  # coupled: a wrong answer earns no schema reward
    assert REWARDS["trust_sparse_uncoupled"](_traj(ep), singer_example)["schema"] == 1.0
    ep = _episode(TRUST4[:1] + TRUST4[2:], final_sql=BROKEN)
    assert REWARDS["trust"](_traj(ep), singer_example) | {"correct": 0} == {"full": 0.0, "schema": 0.0, "exec": 0.0,
                                                                            "format": 0.0, "correct": 0}


def test_trail_recipe(singer_example):
    # correct in 2 turns on an easy question: 5·1 + 2·1 + schema 1 + bigram 1 (same tokens) + syntax 1 + format 1
    ep = _episode(["sql", "answer"], final_sql=RIGHT)
    r = REWARDS["trail"](_traj(ep), singer_example)
    assert r["full"] == pytest.approx(11.0) and r["schema"] is None and r["turns"] == 1.0
    # wrong in 3 turns: no exec, no turns (easy needs t <= 2); same schema; 6 shared of 8 distinct bigrams
    ep = _episode(["sql", "sql", "answer"], final_sql=WRONG)
    r = REWARDS["trail"](_traj(ep), singer_example)
    assert (r["exec"], r["turns"], r["schema_jaccard"], r["syntax"], r["format"]) == (0.0, 0.0, 1.0, 1.0, 1.0)
    assert r["bigram"] == 0.75 and r["full"] == pytest.approx(3.75)
    # cut by max_tokens in turn 1 of an easy question: no answer, no finishing turn, no turn reward (eq. 7, A.4)
    r = REWARDS["trail"](_traj(_episode(["invalid"], valid=[False])), singer_example)
    assert (r["turns"], r["exec"], r["full"]) == (0.0, 0.0, 0.0)
    # broken SQL: schema {singer, singer.nme} vs {singer, singer.name, singer.age} -> 1/4
    r = REWARDS["trail"](_traj(_episode(["answer"], final_sql=BROKEN)), singer_example)
    assert (r["syntax"], r["schema_jaccard"]) == (0.0, pytest.approx(1 / 4))


def test_mtir_skyrl_arctic_recipes(singer_example):
    good = _traj(_episode(["sql", "answer"], final_sql=RIGHT))
    wrong = _traj(_episode(["sql", "answer"], final_sql=WRONG))
    broken = _traj(_episode(["sql", "answer"], final_sql=BROKEN))
    bad_format = _traj(_episode(["invalid", "answer"], valid=[False, True], final_sql=RIGHT))

    def full(name, t):
        return REWARDS[name](t, singer_example)["full"]
    assert [full("mtir", t) for t in (good, wrong, broken, bad_format)] == pytest.approx([1.2, -0.8, 0.0, -0.1])
    assert [full("skyrl", t) for t in (good, wrong, broken, bad_format)] == [1.0, 0.0, 0.0, -1.0]
    assert [full("arctic", t) for t in (good, wrong, broken, bad_format)] == [1.0, 0.1, 0.0, 1.0]


def test_gold_executed_once(singer_example, monkeypatch):
    rewards.GOLD_CACHE.clear()
    gold_runs = []
    real = rewards.run_many
    monkeypatch.setattr(rewards, "run_many", lambda jobs, **kw: gold_runs.extend(jobs) or real(jobs, **kw))
    for sql in (RIGHT, WRONG, RIGHT):
        REWARDS["arctic"](_traj(_episode(["answer"], final_sql=sql)), singer_example)
    assert gold_runs == [(singer_example["db_path"], singer_example["gold_sql"])]


def test_recipes_on_real_env_episodes(singer_example):
    # the same contract through env's own parser and state machine (what rollout.py produces)
    import env
    import protocols

    def call(sql):
        return '{"name": "execute_sql_query", "arguments": {"db_id": "concert_singer", "sql": "%s"}}' % sql
    ep = env.new_episode(singer_example, protocols.get("trust"), max_turns=6)
    for turn in [
        f"<think>tables?</think><action>explore_schema</action><tool_call>{call('PRAGMA table_info(singer)')}"
        "</tool_call>",
        '<think>verified</think><action>propose_schema</action><schema>{"tables": ["singer"], '
        '"columns": {"singer": ["Name", "Age"]}, "joins": []}</schema>',
        f"<think>try it</think><action>generate_sql</action><tool_call>{call(RIGHT)}</tool_call>",
        f"<think>done</think><action>confirm_answer</action><answer>{RIGHT}</answer>",
    ]:
        env.step(ep, turn)
    assert (ep.done, ep.propose_turn, ep.final_sql) == (True, 1, RIGHT)
    r = REWARDS["trust"](_traj(ep), singer_example)
    assert (r["full"], r["schema"]) == (pytest.approx(1.1), 1.0)
    # the other papers' format checks read TRUST's confirm_answer as its answer turn
    assert REWARDS["skyrl"](_traj(ep), singer_example)["full"] == 1.0
    assert REWARDS["trail"](_traj(ep), singer_example)["format"] == 1.0

    ep = env.new_episode(singer_example, protocols.get("trail"), max_turns=5)
    env.step(ep, "<reasoning>look</reasoning><sql>SELECT * FROM singer LIMIT 3</sql>")
    env.step(ep, f"<reasoning>answer</reasoning><solution>{RIGHT}</solution>")
    assert REWARDS["trail"](_traj(ep), singer_example)["full"] == pytest.approx(11.0)


def test_adaptive_turn_budget_follows_the_difficulty_label():
    # T = 10: a simple question gets a third (4), medium half (5), hard and unlabelled all 10; never more than T
    assert [turn_budget(d, 10) for d in ("easy", "Moderate", "Highly Complex", "unknown")] == [4, 5, 10, 10]
    assert [turn_budget(d, 6) for d in ("simple", "medium", "hard")] == [3, 4, 6]  # eq. 7's 2 and 3 turns still fit
    assert turn_budget("easy", 2) == 2
