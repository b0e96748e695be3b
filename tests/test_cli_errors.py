"""A user's mistake on any entry point is one line, `error: <what is wrong and what to do>`, exit status 2, no
traceback, and it is found before any work: no model loads in these tests.
python -m pytest -q tests/test_cli_errors.py"""
import contextlib
import io
import json
import os
import runpy
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(cwd, script, *flags, **env):
    out = subprocess.run([sys.executable, str(ROOT / script), *map(str, flags)], cwd=cwd, capture_output=True,
                         text=True, timeout=300, env={**os.environ, **env})
    return {"returncode": out.returncode, "stderr": out.stderr}


def assert_one_line_error(out, words):
    assert out["returncode"] == 2, out["stderr"][-3000:]
    assert out["stderr"].startswith("error: ") and out["stderr"].count("\n") == 1, out["stderr"][-3000:]
    assert words in out["stderr"] and "Traceback" not in out["stderr"], out["stderr"]


def run_as_scripts(cases):
    """This file run as a script: each (script, flags) as `python SCRIPT FLAGS` would run it, one after another in
    this one interpreter (torch is imported once, not once per case); prints [{returncode, stderr}] as JSON."""
    results = []
    for script, flags in cases:
        path = ROOT / script
        sys.argv = [str(path), *flags]
        sys.path[0] = str(path.parent)  # what `python SCRIPT` puts first
        err = io.StringIO()
        code = 0
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                runpy.run_path(str(path), run_name="__main__")
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else int(e.code is not None)
                if isinstance(e.code, str):  # the interpreter prints sys.exit's message
                    print(e.code, file=sys.stderr)
            except BaseException:  # what would reach the user as a traceback
                traceback.print_exc()
                code = 1
        results.append({"returncode": code, "stderr": err.getvalue()})
    print(json.dumps(results))


MISSING_MODEL = "out/no-such-run/ckpt-000100"
CASES = [  # the list first, then one case for each other entry point
    ("train.py", ["--reward", "bogus"], "invalid choice: 'bogus'"),
    ("train.py", ["--schema-mode", "bogus"], "argument --schema-mode: invalid choice"),
    ("train.py", ["--sft-steps", "-1"], "--sft-steps: must be an integer >= 1, got -1"),
    ("train.py", ["--scale-std", "maybe"], "--scale-std: must be 1 or 0 (true or false), got maybe"),
    ("train.py", ["--sft-batch-size", "-4"], "--sft-batch-size: must be an integer >= 1"),
    ("train.py", ["--rl-batch-size", "-2"], "--rl-batch-size: must be an integer >= 1"),
    ("eval.py", ["--samples", "-3"], "--samples: must be an integer >= 1"),
    ("eval.py", ["--batch-size", "-1"], "--batch-size: must be an integer >= 1"),
    ("train.py", ["--model", MISSING_MODEL], f"model folder {MISSING_MODEL} does not exist"),
    ("eval.py", ["--model", MISSING_MODEL], f"model folder {MISSING_MODEL} does not exist"),
    ("train.py", ["--sft-data", "no/such.jsonl"], "--sft-data: no file no/such.jsonl"),
    ("rollout.py", ["--group-size", "0"], "--group-size: must be an integer >= 1, got 0"),
    ("protocols.py", ["no/such.jsonl"], "no file no/such.jsonl"),
    ("data/teacher.py", ["--data", "no/such.jsonl", "--out", "t.jsonl"], "--data: no file"),
    ("data/teacher.py", ["--data", ROOT / "README.md"], "the following arguments are required: --out"),
    ("data/spider/prepare.py", ["--spider-dir", "no/such/dir"], "Spider folder not found"),
    ("data/synsql/prepare.py", ["--synsql-dir", ".", "--limit", "-5"], "--limit: must be an integer >= 1"),
    ("bench.py", ["bogus"], "invalid choice: 'bogus'"),
    ("report.py", ["no/such/run"], "no/such/run/results.json does not exist: give a train.py run folder"),
]


@pytest.fixture(scope="module")
def case_results(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("cli")  # nothing can land in the repo
    cases = [(script, [str(f) for f in flags]) for script, flags, _ in CASES]
    out = subprocess.run([sys.executable, __file__, json.dumps(cases)], cwd=cwd, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.splitlines()[-1])


@pytest.mark.parametrize("i", range(len(CASES)), ids=[f"{s} {' '.join(map(str, f))}" for s, f, _ in CASES])
def test_a_user_error_is_one_line_and_exit_status_2(case_results, i):
    assert_one_line_error(case_results[i], CASES[i][2])


def test_an_unreachable_hub_fails_fast(tmp_path):
    # no network (HF_HUB_OFFLINE) and an id that is not in the (empty) cache: it once retried silently for > 45 s
    t0 = time.perf_counter()
    out = run(tmp_path, "train.py", "--model", "sqlrl-tests/no-such-model", "--out-dir", tmp_path,
              HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(tmp_path / "hf"))
    assert_one_line_error(out, "the Hub is unreachable (HF_HUB_OFFLINE is set)")
    assert time.perf_counter() - t0 < 30  # the interpreter and torch's import, not a wait on the network
    assert not (tmp_path / "hf").exists() and list(tmp_path.iterdir()) == []  # and nothing written


def test_a_hub_id_in_the_local_cache_needs_no_network(tmp_path, monkeypatch):
    import huggingface_hub
    from huggingface_hub import constants
    import model
    snapshot = tmp_path / "models--sqlrl-tests--cached" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (tmp_path / "models--sqlrl-tests--cached" / "refs").mkdir()
    (tmp_path / "models--sqlrl-tests--cached" / "refs" / "main").write_text("abc")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))

    def offline(*a, **k):
        raise ConnectionError("no network")
    monkeypatch.setattr(huggingface_hub, "model_info", offline)
    assert model.resolve("sqlrl-tests/cached") == "sqlrl-tests/cached"
    with pytest.raises(ConnectionError, match="unreachable"):
        model.resolve("sqlrl-tests/not-cached")


if __name__ == "__main__":
    run_as_scripts(json.loads(sys.argv[1]))
