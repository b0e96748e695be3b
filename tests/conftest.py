"""Shared test fixtures. Tests that need the real Spider dev set skip when ../shared is absent (a user's clone)."""
import sqlite3
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SPIDER_DIR = ROOT.parent / "shared" / "data" / "spider"


@pytest.fixture(scope="session")
def spider_dir():
    if not (SPIDER_DIR / "dev.json").exists():
        pytest.skip(f"real Spider dev set not found at {SPIDER_DIR} (only CI and the dev machines have ../shared)")
    return SPIDER_DIR


@pytest.fixture(scope="session")
def gym_dir():
    from data.gym.prepare import ensure_gym
    return ensure_gym()


@pytest.fixture(scope="module")
def examples(gym_dir):
    """The gym's dev questions (module scope: a test may edit its copy)."""
    import env
    return env.load_examples(gym_dir / "dev.jsonl")


@pytest.fixture(scope="module")
def tiny():
    """(model, tokenizer): the tiny test fixture, SmolLM2's tokenizer on a small random Llama (module scope)."""
    from model import load_model
    return load_model("tiny", seed=0)


@pytest.fixture(scope="module")
def one_thread():
    """The tiny models' ops are too small to split across threads; on a shared 2-core box threads only contend."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


PETS_DDL = [  # Spider's pets_1 schema; the fixture holds its 3 pets and 3 of its students
    "CREATE TABLE Student (StuID INTEGER PRIMARY KEY, LName VARCHAR(12), Fname VARCHAR(12), Age INTEGER, "
    "Sex VARCHAR(1), Major INTEGER, Advisor INTEGER, city_code VARCHAR(3))",
    "CREATE TABLE Has_Pet (StuID INTEGER, PetID INTEGER, FOREIGN KEY(PetID) REFERENCES Pets(PetID), "
    "FOREIGN KEY(StuID) REFERENCES Student(StuID))",
    "CREATE TABLE Pets (PetID INTEGER PRIMARY KEY, PetType VARCHAR(20), pet_age INTEGER, weight REAL)",
]


def build_db(path, ddl, rows):
    """A small SQLite file at path: ddl statements, then rows {table: [tuple, ...]}."""
    path.parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA synchronous = OFF")  # a throwaway file: skip the fsyncs (~80 ms per fixture)
    for sql in ddl:
        conn.execute(sql)
    for table, values in rows.items():
        conn.executemany(f"INSERT INTO {table} VALUES ({', '.join('?' * len(values[0]))})", values)
    conn.commit()
    conn.close()
    return path


@pytest.fixture
def pets(tmp_path):
    """Spider's pets_1 in tmp_path: 3 pets and 3 students (env and protocol tests)."""
    students = [(1001, "Smith", "Linda", 18, "F", 600, 1121, "BAL"), (1002, "Kim", "Tracy", 19, "F", 600, 7712, "HKG"),
                (1003, "Jones", "Shiela", 21, "F", 600, 7792, "WAS")]
    return build_db(tmp_path / "pets_1" / "pets_1.sqlite", PETS_DDL, {
        "Student": students, "Has_Pet": [(1001, 2001), (1002, 2002), (1002, 2003)],
        "Pets": [(2001, "cat", 3, 12.0), (2002, "dog", 2, 13.4), (2003, "dog", 1, 9.3)]})


@pytest.fixture(scope="module")
def concert_db(tmp_path_factory):
    """A small concert/singer database (Spider's concert_singer, cut down) for scoring and taxonomy tests."""
    path = tmp_path_factory.mktemp("taxonomy") / "concert.sqlite"
    con = sqlite3.connect(path)
    con.executescript("""
        CREATE TABLE singer (singer_id INTEGER PRIMARY KEY, name TEXT, country TEXT, age INTEGER);
        CREATE TABLE concert (concert_id INTEGER PRIMARY KEY, concert_name TEXT, singer_id INTEGER, year INTEGER);
        INSERT INTO singer VALUES (1, 'Joe', 'France', 52), (2, 'Ann', 'Italy', 25), (3, 'Tim', 'France', 33);
        INSERT INTO concert VALUES (1, 'Spring', 1, 2014), (2, 'Autumn', 3, 2015);""")
    con.commit()
    con.close()
    return str(path)
