"""taxonomy.py: one crafted failure per class on a small fixture database, and no false alarms on real gold SQL.

    python -m pytest -q tests/test_taxonomy.py
"""
import json

import pytest

import taxonomy


@pytest.mark.parametrize("gold, pred, label, detail", [
    ("SELECT name FROM singer WHERE age > 30", None, "generation", "no final SQL"),
    ("SELECT name FROM singer WHERE age > 30", "  ", "generation", "no final SQL"),
    ("SELECT name FROM singer WHERE age > 30", "SELECT name FROM singer WHERE", "syntax", "parse"),
    # a JOIN loop of the tiny model's: sqlglot would take hours to parse it (rewards.bare_joins)
    ("SELECT name FROM singer WHERE age > 30", "SELECT name FROM singer" + " JOIN concert AS T1" * 30, "syntax",
     "JOINs without ON/USING"),
    ("SELECT name FROM singer WHERE age > 30", "SELECT nosuchfunc(name) FROM singer", "syntax", "nosuchfunc"),
    ("SELECT name FROM singer WHERE age > 30", "SELECT name FROM singers", "hallucination", "table singers"),
    ("SELECT name FROM singer WHERE age > 30", "SELECT nationality FROM singer", "hallucination", "nationality"),
    ("SELECT name FROM singer WHERE age > 30", "SELECT T1.nme FROM singer AS T1 JOIN concert AS T2 "
     "ON T1.singer_id = T2.singer_id", "hallucination", "T1.nme"),
    ("SELECT name FROM singer WHERE age > 30", "SELECT concert_name FROM concert", "schema_linking", "concert"),
    ("SELECT name FROM singer WHERE age > 30", "SELECT name FROM singer WHERE age < 30", "semantic", "gold schema"),
    # a backticked or bracketed name is always a column to SQLite ("no such column"): hallucinated, not syntax
    ("SELECT name FROM singer WHERE age > 30", "SELECT name FROM singer WHERE `nationality` = 'x'", "hallucination",
     "nationality"),
    ("SELECT name FROM singer WHERE age > 30", "SELECT [Stage Name] FROM singer", "hallucination", "Stage Name"),
    # SQLite reads "Mars" as a string, not a column: a wrong value, not a hallucinated column
    ("SELECT name FROM singer WHERE country = 'France'", 'SELECT name FROM singer WHERE country = "Mars"',
     "semantic", "gold schema"),
])
def test_error_taxonomy(concert_db, gold, pred, label, detail):
    example = {"db_path": concert_db, "gold_sql": gold, "question": "?"}
    got, why = taxonomy.classify_failure(example, pred)
    assert got == label, why
    assert detail in why


def test_gold_queries_reference_no_unknown_names(spider_dir):
    # the hallucination check must not fire on correct SQL: every Spider dev gold query passes it
    flagged = []
    for r in json.loads((spider_dir / "dev.json").read_text()):
        db = spider_dir / "database" / r["db_id"] / f"{r['db_id']}.sqlite"
        if db.exists():
            tree = taxonomy.parse_query(r["query"])
            if tree is None or taxonomy.unknown_names(r["query"], tree, str(db)):
                flagged.append(r["query"])
    assert flagged == []
