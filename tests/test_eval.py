"""eval.py: maj@K voting, the pass@k estimator, the error taxonomy, scoring as the official Spider and BIRD scorers
do it (test-suite rules and the files of data/spider/prepare.py, VES of data/bird/prepare.py), user errors, the
Spider gold self-check and an end-to-end run of the tiny model on the gym.   python -m pytest -q tests/test_eval.py"""
import itertools
import json
import math
import runpy
import sqlite3
import subprocess
import sys
from types import SimpleNamespace
from pathlib import Path

import pytest

import eval as ev
from data.bird.prepare import bird_ves, load_bird, machine, r_ves_reward, time_ratio, write_bird_predictions
from data.spider.prepare import MISSING_SQL, load_spider, remove_distinct, spider_hardness, write_spider_files
from env import SQLResult

ROOT = Path(__file__).resolve().parents[1]


def res(rows, error=None):
    return SQLResult(columns=["c"], rows=rows, error=error, truncated=False, elapsed_s=0.0)


# -----------------------------------------------------------------------------
# maj@K: execution-consensus voting (OmniSQL)

def test_majority_vote_largest_group_wins():
    a, b = [(1, "x")], [(2, "y")]
    # a gets 3 votes, b 2; the error and the missing SQL don't vote
    results = [res(b), res(a), res([], error="no such table: t"), res(a), None, res(b), res(a)]
    assert ev.majority_vote(results) == 1  # the first member of the winning group


def test_majority_vote_tie_goes_to_first_seen():
    a, b = [(1,)], [(2,)]
    assert ev.majority_vote([res(b), res(a), res(a), res(b)]) == 0
    assert ev.majority_vote([res([], error="syntax error"), res(a), res(b)]) == 1


def test_majority_vote_groups_by_row_set_and_empty_results_vote():
    # row order does not split a group: the key is a frozenset of rows
    assert ev.majority_vote([res([(1,)]), res([(2,), (3,)]), res([(3,), (2,)])]) == 1
    # two empty results outvote one non-empty result
    assert ev.majority_vote([res([(5,)]), res([]), res([])]) == 1


def test_majority_vote_all_failed_is_a_failure():
    assert ev.majority_vote([res([], error="interrupted: timeout"), None, res([], error="no such column: x")]) is None
    assert ev.majority_vote([]) is None


# -----------------------------------------------------------------------------
# pass@k: unbiased estimator vs brute-force enumeration of k-subsets

def test_pass_at_k_matches_brute_force():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(range(n), k))  # samples 0..c-1 are the correct ones
                brute = sum(any(i < c for i in s) for s in subsets) / len(subsets)
                assert math.isclose(ev.pass_at_k(n, c, k), brute, abs_tol=1e-12), (n, c, k)


def test_pass_at_k_edge_cases():
    assert ev.pass_at_k(8, 0, 8) == 0.0 and ev.pass_at_k(8, 1, 8) == 1.0
    assert math.isclose(ev.pass_at_k(200, 3, 1), 3 / 200)  # large n stays finite and exact
    assert ev.pass_ks(8) == [1, 2, 4, 6, 8] and ev.pass_ks(5) == [1, 2, 4, 5]
    with pytest.raises(ValueError, match="k <= n"):
        ev.pass_at_k(4, 1, 5)


# -----------------------------------------------------------------------------
# scoring: outermost ORDER BY, bird vs spider comparison

def test_wilson_interval_of_30_of_100_is_about_nine_points_either_side():
    lo, hi = ev.wilson_interval(30, 100)
    assert (round(lo, 3), round(hi, 3)) == (0.219, 0.396)
    assert ev.wilson_interval(0, 20)[0] == 0.0 and 0.1 < ev.wilson_interval(0, 20)[1] < 0.2  # never below 0


def test_paired_bootstrap_sees_a_gain_on_the_same_questions_and_none_without_one():
    before = [0, 1] * 50
    assert ev.paired_bootstrap(before, before) == (0.0, 0.0)  # the same answers: no change, no spread
    after = [1] * 100  # every question now solved: +50 points, and the interval excludes 0
    lo, hi = ev.paired_bootstrap(before, after)
    assert 0.35 < lo < 0.5 < hi < 0.65
    # a 2-question swap (one gained, one lost) is no gain: the interval straddles 0
    swapped = [1, 0] + before[2:]
    lo, hi = ev.paired_bootstrap(before, swapped)
    assert lo < 0 < hi


def test_gold_order_matters_only_for_the_outermost_order_by():
    assert ev.gold_order_matters("SELECT name FROM singer ORDER BY age DESC")
    assert ev.gold_order_matters("SELECT name FROM singer UNION SELECT name FROM stadium ORDER BY name")
    assert not ev.gold_order_matters("SELECT count(*) FROM concert WHERE stadium_id = "
                                     "(SELECT stadium_id FROM stadium ORDER BY capacity DESC LIMIT 1)")
    assert not ev.gold_order_matters("SELECT count(*) FROM singer")


def test_spider_scoring_respects_order_bird_does_not():
    gold, pred = res([(1,), (2,)]), res([(2,), (1,)])
    assert ev.is_correct(pred, gold, "bird", order_matters=True)
    assert not ev.is_correct(pred, gold, "spider", order_matters=True)
    assert ev.is_correct(pred, gold, "spider", order_matters=False)
    assert not ev.is_correct(None, gold, "bird", False)
    assert not ev.is_correct(res([], error="boom"), res([]), "bird", False)


# -----------------------------------------------------------------------------
# difficulty: Spider hardness from the gold SQL (official eval_hardness)

@pytest.mark.parametrize("sql, level", [
    ("SELECT count(*) FROM singer", "easy"),
    ("SELECT name , country , age FROM singer ORDER BY age DESC", "medium"),
    ("SELECT name FROM stadium WHERE stadium_id NOT IN (SELECT stadium_id FROM concert)", "hard"),
    ("SELECT T2.name , T2.capacity FROM concert AS T1 JOIN stadium AS T2 ON T1.stadium_id = T2.stadium_id "
     "WHERE T1.year >= 2014 GROUP BY T2.stadium_id ORDER BY count(*) DESC LIMIT 1", "extra"),
])
def test_spider_hardness(sql, level):
    assert spider_hardness(sql) == level
    assert ev.difficulty_of({"gold_sql": sql, "source": "spider", "difficulty": ""}) == level


# -----------------------------------------------------------------------------
# self-check: the gold SQL as the prediction scores 100 % on the real Spider dev set, in every mode

def test_spider_gold_as_prediction_scores_100(spider_dir):
    examples = []
    for i, r in enumerate(json.loads((spider_dir / "dev.json").read_text())):
        db = spider_dir / "database" / r["db_id"] / f"{r['db_id']}.sqlite"
        if db.exists():  # wta_1 has no database
            examples.append({"id": i, "db_id": r["db_id"], "db_path": str(db), "gold_sql": r["query"]})
    assert len(examples) == 972
    golds = [ex["gold_sql"] for ex in examples]
    for scoring in ev.SCORINGS:
        ok = ev.score_sqls(examples, golds, scoring)
        assert sum(ok) == len(examples), [ex["gold_sql"] for ex, o in zip(examples, ok) if not o][:5]
    # and a wrong prediction scores wrong
    assert ev.score_sqls(examples[:1], ["SELECT 12345"], "spider") == [False]


# -----------------------------------------------------------------------------
# spider scoring = the official test-suite evaluator's verdicts (exec_eval.eval_exec_match, defaults); spider-strict
# = the queries as written. Each case: gold, prediction, official verdict, strict verdict.

def singer_example(db, gold, db_id="concert"):
    return {"id": "q", "db_id": db_id, "db_path": str(db), "question": "?", "evidence": "", "gold_sql": gold,
            "difficulty": "easy", "source": "spider"}


def test_remove_distinct_drops_the_keyword_tokens_only():
    assert remove_distinct("SELECT DISTINCT T1.Year FROM cars_data AS T1") == "SELECT  T1.Year FROM cars_data AS T1"
    assert remove_distinct("select count(distinct(x)) from t") == "select count((x)) from t"
    # names and strings spelled distinct stay; so do comments and spacing
    keep = "SELECT \"distinct\", [distinct], distinct_x FROM t WHERE a = 'distinct' -- distinct\n"
    assert remove_distinct(keep) == keep
    # sqlparse.parse(s)[0] there: only the first statement is run
    assert remove_distinct("SELECT DISTINCT a FROM t; SELECT 1") == "SELECT  a FROM t;"


@pytest.mark.parametrize("gold, pred, official, strict", [
    # DISTINCT removed from both: a prediction without it is right
    ("SELECT DISTINCT country FROM singer", "SELECT country FROM singer", True, False),
    # COUNT(DISTINCT x) becomes COUNT(x): count(country) = 3 is right, the 2 countries are wrong
    ("SELECT count(DISTINCT country) FROM singer", "SELECT count(country) FROM singer", True, False),
    ("SELECT count(DISTINCT country) FROM singer",
     "SELECT count(*) FROM (SELECT country FROM singer GROUP BY country)", False, True),
    # "order by" in a subquery: row order counts (gold Joe, Tim; prediction Tim, Joe)
    ("SELECT name FROM singer WHERE age > (SELECT age FROM singer ORDER BY age LIMIT 1)",
     "SELECT name FROM singer WHERE age > 25 ORDER BY name DESC", False, True),
    # the `value` placeholder becomes 1 between spaces; at the end of the line it stays (no such column: value)
    ("SELECT name FROM singer WHERE singer_id = 1 AND age > 30",
     "SELECT name FROM singer WHERE singer_id = value AND age > 30", True, False),
    ("SELECT name FROM singer WHERE age > 30 AND singer_id = 1",
     "SELECT name FROM singer WHERE age > 30 AND singer_id = value", False, False),
    # postprocess joins "> =", and a second statement is dropped
    ("SELECT name FROM singer WHERE age >= 33", "SELECT name FROM singer WHERE age > = 33", True, False),
    ("SELECT name FROM singer WHERE age > 30", "SELECT name FROM singer WHERE age > 30; SELECT 1", True, False),
])
def test_official_spider_rules(concert_db, gold, pred, official, strict):
    examples = [singer_example(concert_db, gold)]
    assert ev.score_sqls(examples, [pred], "spider") == [official]
    assert ev.score_sqls(examples, [pred], "spider-strict") == [strict]


def test_official_spider_cars_example_from_issue_32(spider_dir):
    db = spider_dir / "database" / "car_1" / "car_1.sqlite"
    gold = "SELECT DISTINCT T1.Year FROM CARS_DATA AS T1 WHERE T1.Weight > 3000 AND T1.weight < 4000"
    pred = "SELECT T1.Year FROM CARS_DATA AS T1 WHERE T1.Weight > 3000 AND T1.weight < 4000"  # 107 rows, 13 years
    examples = [singer_example(db, gold, "car_1")]
    assert ev.score_sqls(examples, [pred], "spider") == [True]
    assert ev.score_sqls(examples, [pred], "spider-strict") == [False]


def make_singer_db(path, ages):
    path.parent.mkdir(parents=True, exist_ok=True)
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE singer (singer_id INTEGER PRIMARY KEY, name TEXT, country TEXT, age INTEGER)")
    con.executemany("INSERT INTO singer VALUES (?, ?, 'France', ?)", [(i, n, a) for i, (n, a) in
                                                                     enumerate(zip(["Joe", "Ann", "Tim"], ages), 1)])
    con.commit()
    con.close()
    return path


@pytest.fixture
def test_suite(tmp_path):
    """Two databases of one schema, as the test-suite's distilled ones: Tim is 33 in one and 31 in the other."""
    first = make_singer_db(tmp_path / "ts" / "concert" / "concert.sqlite", [52, 25, 33])
    make_singer_db(tmp_path / "ts" / "concert" / "concert_1.sqlite", [52, 25, 31])
    return tmp_path / "ts", singer_example(first, "SELECT name FROM singer WHERE age > 30")


def test_test_suite_prediction_must_match_on_every_database(test_suite):
    ts_dir, example = test_suite
    lucky, right = "SELECT name FROM singer WHERE age >= 33", "SELECT name FROM singer WHERE age > 30"
    assert ev.score_sqls([example, example], [lucky, right], "spider") == [True, True]  # the one database
    for scoring in ("spider", "spider-strict"):
        assert ev.score_sqls([example, example], [lucky, right], scoring, ts_dir=ts_dir) == [False, True]


# -----------------------------------------------------------------------------
# BIRD's VES: the official time ratio (outliers dropped, sqrt), positive for a correct answer, 0 for a wrong one

def test_time_ratio_drops_outliers_as_bird_does():
    assert time_ratio([1.0] * 20 + [100.0]) == 1.0  # 100 lies 4.5 std above the mean
    assert time_ratio([0.5, 1.0, 1.5]) == 1.0
    assert time_ratio([2.0] * 5) == 0.0  # nothing strictly inside mean +- 0: the official division by zero
    assert [r_ves_reward(r) for r in (0, 0.1, 0.25, 0.7, 1.0, 1.9, 2.0)] == [0, 0.25, 0.5, 0.75, 1, 1, 1.25]


def test_ves_positive_for_correct_and_zero_for_wrong(concert_db):
    gold = "SELECT name FROM singer WHERE age > 30"
    examples = [singer_example(concert_db, gold)] * 2
    sqls = ["SELECT name FROM singer WHERE age >= 31", "SELECT name FROM singer"]
    correct = ev.score_sqls(examples, sqls, "bird")
    assert correct == [True, False]
    (ves, r_ves), wrong = bird_ves(examples, sqls, correct, runs=5)
    assert ves > 0 and r_ves >= 0.5 and wrong == (0.0, 0.0)
    assert "cores" in machine()


# -----------------------------------------------------------------------------
# the files the official scorers read: right lines and keys for exactly the questions evaluated

def test_spider_file_pair_has_one_line_per_evaluated_question(spider_dir, tmp_path):
    dev = json.loads((spider_dir / "dev.json").read_text())
    picked = (428, 429, 430, 491)  # 429 and 430 ask wta_1, which has no database: skipped
    (tmp_path / "dev.json").write_text(json.dumps([dev[i] for i in picked]))
    records, skipped = load_spider(tmp_path, db_dir=spider_dir / "database")
    assert len(records) == 2 and len(skipped) == 2
    write_spider_files(tmp_path / "out", records, ["SELECT count(*)\n  FROM singer", None])
    assert (tmp_path / "out" / "pred.txt").read_text().splitlines() == ["SELECT count(*) FROM singer", MISSING_SQL]
    assert (tmp_path / "out" / "gold.txt").read_text().splitlines() == [
        f"{dev[i]['query']}\t{dev[i]['db_id']}" for i in (428, 491)]


def test_bird_prediction_keys_are_question_ids(tmp_path):
    bird = tmp_path / "bird"
    make_singer_db(bird / "dev_databases" / "concert" / "concert.sqlite", [52, 25, 33])
    dev = [{"question_id": q, "db_id": db, "question": f"q{q}", "SQL": f"SELECT {q}", "difficulty": "simple"}
           for q, db in ((0, "concert"), (1, "financial"), (2, "concert"), (3, "concert"))]
    (bird / "dev.json").write_text(json.dumps(dev))
    records, skipped = load_bird(bird)
    assert len(skipped) == 1  # financial's database is missing
    write_bird_predictions(tmp_path / "out" / "predict_dev.json", records[:2], ["SELECT 1", None])  # --limit 2
    assert json.loads((tmp_path / "out" / "predict_dev.json").read_text()) == {
        "0": "SELECT 1\t----- bird -----\tconcert", "2": "\t----- bird -----\tconcert"}
    assert (tmp_path / "out" / "dev_gold.sql").read_text() == "SELECT 0\tconcert\nSELECT 2\tconcert\n"


def test_default_output_names_differ_for_gym_and_spider():
    assert ev.output_name("out/ckpt/", "trust", "none", "data/gym/dev.jsonl") == "ckpt-trust-none-gym-dev"
    assert ev.output_name("out/ckpt", "trust", "none", "data/spider/dev.jsonl") == "ckpt-trust-none-spider-dev"


@pytest.mark.parametrize("rank, shown", [("0", True), ("1", False)])
def test_progress_bar_reaches_a_log_file_from_rank_0_only(monkeypatch, capsys, rank, shown):
    # captured stderr is not a terminal, as under `python train.py > log 2>&1`: the bar must still be written
    import rollout

    def fake_rollout(model, tokenizer, examples, protocol, *, group_size, max_rows, bar, **kw):
        bar.update(len(examples) * group_size)
        return [SimpleNamespace(turn_times=[0.5, 0.25])] * (len(examples) * group_size)
    monkeypatch.setattr(rollout, "rollout", fake_rollout)
    monkeypatch.setenv("RANK", rank)
    trajs, latency = ev.run_agent(None, None, [{}, {}, {}], ev.RolloutConfig(), group_size=2, batch_size=4,
                                   desc="greedy", seed=0)
    assert len(trajs) == 6 and latency == [0.75] * 3
    assert ("greedy: 100%" in capsys.readouterr().err) == shown


# -----------------------------------------------------------------------------
# the CLI on test-suite databases; user errors: one line "error: ...", exit status 2, before any work

def run_cli(*args):
    return subprocess.run([sys.executable, str(ROOT / "eval.py"), "--gold-as-prediction", *map(str, args)],
                          capture_output=True, text=True, cwd=ROOT)


def test_cli_spider_ts_dir_and_user_errors(test_suite, tmp_path, monkeypatch, capsys):
    ts_dir, example = test_suite
    data = tmp_path / "data" / "dev.jsonl"
    data.parent.mkdir()
    data.write_text(json.dumps(example) + "\n")
    out = run_cli("--data", data, "--spider-ts-dir", ts_dir)
    assert out.returncode == 0 and "100.00% EX (1/1" in out.stdout, out.stderr
    for bad, why in [(["--spider-ts-dir", tmp_path / "nowhere"], "is not a folder"),
                     (["--spider-ts-dir", tmp_path], "no .sqlite files for 1 database(s), e.g. concert"),
                     (["--spider-ts-dir", ts_dir, "--scoring", "bird"], "needs --scoring spider"),
                     (["--ves-runs", "-1"], "--ves-runs: must be an integer >= 0")]:
        # the same command line in this interpreter (torch is already imported): a user error stops before any work
        monkeypatch.setattr(sys, "argv", [str(ROOT / "eval.py"), "--gold-as-prediction", "--data", str(data),
                                          *map(str, bad)])
        with pytest.raises(SystemExit) as stop:
            runpy.run_path(str(ROOT / "eval.py"), run_name="__main__")
        out = capsys.readouterr()
        assert stop.value.code == 2 and out.out == "", out.err
        assert out.err.startswith("error: ") and why in out.err and out.err.count("\n") == 1


# -----------------------------------------------------------------------------
# evaluate() with a scripted policy: known answers give known greedy EX, maj@K, pass@k and error labels

GOLD = {"q0": "SELECT name FROM singer WHERE age > 30",
        "q1": "SELECT count(*) FROM singer",
        "q2": "SELECT concert_name FROM concert WHERE year = 2014",
        "q3": "SELECT name FROM singer WHERE country = 'Italy'"}
SCRIPT = {  # id -> (greedy final SQL, the K=3 sampled final SQLs)
    "q0": (GOLD["q0"], [GOLD["q0"], GOLD["q0"], "SELECT name FROM singer"]),                  # maj right, c=2
    "q1": ("SELECT count(*) + 1 FROM singer", ["SELECT 7", GOLD["q1"], GOLD["q1"]]),         # semantic; c=2
    "q2": (None, ["SELECT nosuch FROM concert", None, GOLD["q2"]]),                        # errors don't vote; c=1
    "q3": ("SELECT name FROM singers", ["SELECT name FROM singer WHERE country = 'Mars'", GOLD["q3"],
                                        "SELECT name FROM singer WHERE country = 'Spain'"]),  # empty results win; c=1
}


def scripted_rollout(model, tokenizer, examples, protocol, *, group_size, temperature, **kw):
    trajs = []
    for g, ex in enumerate(examples):
        greedy, sampled = SCRIPT[ex["id"]]
        for sql in ([greedy] if temperature == 0 else sampled)[:group_size]:
            trajs.append(SimpleNamespace(token_ids=[1] * 12, prompt_len=7, loss_mask=[0] * 7 + [1] * 5, num_turns=2,
                                         num_tool_calls=1, stop_reason="answer", group=g, example=ex,
                                         turn_times=[0.5, 0.25], episode=SimpleNamespace(final_sql=sql)))
    return trajs


def test_evaluate_scripted_policy(concert_db, tmp_path, monkeypatch):
    import rollout
    monkeypatch.setattr(rollout, "rollout", scripted_rollout)
    examples = [{"id": q, "db_id": "concert", "db_path": concert_db, "question": f"question {q}", "gold_sql": sql,
                 "difficulty": "easy" if q in ("q0", "q1") else "hard", "source": "gym"} for q, sql in GOLD.items()]
    tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens=False: "trajectory text")
    s = ev.evaluate(None, tokenizer, examples, samples=3, scoring="bird", batch_size=3, out_dir=tmp_path, name="s")
    # c = [2, 2, 1, 1] correct samples of 3; pass@2 for c=1 is 1 - C(2,2)/C(3,2) = 2/3
    expected = {"greedy_ex": 1 / 4, "maj@3": 3 / 4, "pass@1": 6 / 12, "pass@2": (1 + 1 + 2 / 3 + 2 / 3) / 4,
                "pass@3": 1.0}
    assert s["metrics"] == pytest.approx(expected)
    assert s["by_difficulty"]["easy"]["greedy_ex"] == 0.5 and s["by_difficulty"]["hard"]["maj@3"] == 0.5
    assert s["errors"]["counts"] == {"generation": 1, "syntax": 0, "hallucination": 1, "schema_linking": 0,
                                     "semantic": 1, "gold_error": 0}
    assert s["errors"]["examples"]["hallucination"]["final_sql"] == "SELECT name FROM singers"
    assert s["cost"]["greedy"] == pytest.approx({"latency_s": s["cost"]["greedy"]["latency_s"], "output_tokens": 5,
                                                 "turns": 2, "tool_calls": 1})
    rows = [json.loads(line) for line in (tmp_path / "predictions.jsonl").read_text().splitlines()]
    assert [r["n_correct"] for r in rows] == [2, 2, 1, 1]
    assert [r["maj_correct"] for r in rows] == [True, True, True, False]
    assert rows[3]["maj_sql"] == SCRIPT["q3"][1][0]  # the first member of the winning (empty) group
    assert [r["error_label"] for r in rows] == [None, "semantic", "generation", "hallucination"]


def test_evaluate_reports_ves_for_bird(concert_db, monkeypatch):
    import rollout
    monkeypatch.setattr(rollout, "rollout", scripted_rollout)
    examples = [{"id": q, "db_id": "concert", "db_path": concert_db, "question": q, "gold_sql": sql,
                 "difficulty": "easy" if q == "q0" else "hard", "source": "gym"} for q, sql in GOLD.items()]
    tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens=False: "")
    s = ev.evaluate(None, tokenizer, examples, scoring="bird", ves_runs=3)
    assert set(s["metrics"]) == {"greedy_ex", "ves", "r_ves"} and s["metrics"]["greedy_ex"] == 1 / 4
    assert s["by_difficulty"]["easy"]["ves"] > 0 and s["by_difficulty"]["hard"]["ves"] == 0  # only q0 is right
    assert "VES and R-VES timed on" in ev.markdown_report(s) and s["ves_machine"] == machine()


def test_evaluate_writes_the_spider_file_pair(concert_db, tmp_path, monkeypatch):
    import rollout
    monkeypatch.setattr(rollout, "rollout", scripted_rollout)
    examples = [{"id": q, "db_id": "concert", "db_path": concert_db, "question": q, "gold_sql": sql,
                 "difficulty": "easy", "source": "spider"} for q, sql in GOLD.items()]
    tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens=False: "")
    s = ev.evaluate(None, tokenizer, examples, scoring="spider", out_dir=tmp_path, name="s")
    assert s["metrics"] == {"greedy_ex": 1 / 4} and s["scoring"] == "spider"
    assert (tmp_path / "pred.txt").read_text().splitlines() == [SCRIPT[q][0] or MISSING_SQL for q in GOLD]
    assert (tmp_path / "gold.txt").read_text().splitlines() == [f"{sql}\tconcert" for sql in GOLD.values()]


# -----------------------------------------------------------------------------
# end to end: the untrained tiny model on 20 gym dev questions writes every output (EX ~ 0, not asserted)

def test_end_to_end_tiny_model_on_gym(gym_dir, tmp_path):
    import torch
    from env import load_examples
    from model import load_model
    examples = load_examples(gym_dir / "dev.jsonl")
    examples = examples[::len(examples) // 20][:20]  # spread over the levels
    model, tokenizer = load_model("tiny", seed=0)
    with torch.no_grad():
        cfg = ev.RolloutConfig(protocol="trust", schema_mode="none", max_turns=2, max_new_tokens=16,
                               max_total_tokens=800, temperature=0.8)
        summary = ev.evaluate(model, tokenizer, examples, cfg, samples=2, scoring="bird", batch_size=40, seed=0,
                              out_dir=tmp_path / "tiny", name="tiny")
    assert set(summary["metrics"]) == {"greedy_ex", "maj@2", "pass@1", "pass@2"}
    assert all(0.0 <= v <= 1.0 for v in summary["metrics"].values())
    assert summary["metrics"]["pass@2"] >= summary["metrics"]["pass@1"]
    assert sum(row["n"] for row in summary["by_difficulty"].values()) == 20
    assert set(summary["cost"]) == {"greedy", "sampled x2"}
    assert summary["cost"]["greedy"]["turns"] >= 1 and summary["cost"]["greedy"]["output_tokens"] > 0
    counts = summary["errors"]["counts"]
    n_wrong = round(20 * (1 - summary["metrics"]["greedy_ex"]))
    assert sum(counts.values()) == n_wrong  # one label per greedy failure
    assert set(summary["errors"]["examples"]) == {c for c, v in counts.items() if v}

    assert json.loads((tmp_path / "tiny" / "summary.json").read_text())["n"] == 20
    lines = [json.loads(line) for line in (tmp_path / "tiny" / "predictions.jsonl").read_text().splitlines()]
    assert len(lines) == 20 and [r["id"] for r in lines] == [ex["id"] for ex in examples]
    for r in lines:
        assert {"final_sql", "correct", "turns", "output_tokens", "text", "error_label", "maj_correct"} <= set(r)
        assert r["question"] in r["text"] and 1 <= r["turns"] <= 2 and len(r["samples"]) == 2
        assert (r["error_label"] is None) == r["correct"]
    assert "| greedy_ex |" in ev.markdown_report(summary)


def test_cli_decodes_fewer_rows_in_a_smaller_kv_budget_and_stops_when_one_row_does_not_fit(gym_dir, tmp_path,
                                                                                           monkeypatch, capsys):
    import torch
    import memory
    from model import load_model
    per_row = memory.kv_bytes_per_row(load_model("tiny")[0].config, 256, torch.float32)
    flags = ["--model", "tiny", "--dtype", "fp32", "--device", "cpu", "--data", str(gym_dir / "dev.jsonl"),
             "--limit", "3", "--samples", "1", "--ves-runs", "0", "--max-turns", "1", "--max-new-tokens", "4",
             "--max-total-tokens", "256", "--batch-size", "3", "--out-dir", str(tmp_path)]

    def run_eval(rows_of_budget):
        monkeypatch.setattr(sys, "argv", ["eval.py", *flags, "--kv-cache-gb", str(rows_of_budget * per_row / 2 ** 30)])
        runpy.run_path(str(ROOT / "eval.py"), run_name="__main__")
        return capsys.readouterr()

    out = run_eval(2.5)  # room for two rows of three
    assert "decoding 2 rows at once" in out.out and len(list(tmp_path.glob("*/predictions.jsonl"))) == 1
    with pytest.raises(SystemExit) as stop:
        run_eval(0.5)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith("error: one row of 257 KV slots") and "--kv-cache-gb" in err


def test_cli_gold_as_prediction_on_gym(gym_dir):
    out = subprocess.run([sys.executable, str(ROOT / "eval.py"), "--gold-as-prediction", "--limit", "50",
                          "--data", str(gym_dir / "dev.jsonl")], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "100.00% EX (50/50" in out.stdout
