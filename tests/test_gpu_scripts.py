"""The GPU check's and the GPU training run's wiring, cheaply on the CPU: the scripts parse, the side script lists its
parts in the check's order, a part's status is recorded whatever it does, and flags are checked before any work.
Their dry runs (bash tests/gpu_check.sh --dry-run, bash tests/gpu_train.sh --dry-run) take minutes: not here.
python -m pytest -q tests/test_gpu_scripts.py"""
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ["tests/gpu_check.sh", "tests/gpu_train.sh", "tests/gpu_lib.sh"]


def bash(*args):
    return subprocess.run(["bash", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_scripts_parse(script):
    done = bash("-n", script)
    assert done.returncode == 0, done.stderr


def test_the_side_script_lists_its_parts_in_the_order_the_check_runs_them():
    done = subprocess.run([sys.executable, "tests/gpu_parts.py", "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    parts = done.stdout.split("positional arguments:")[1]
    listed = re.findall(r"^    ([a-z-]+)\s", parts, flags=re.M)
    loop = re.search(r"^for part in ([a-z -]+); do$", (ROOT / "tests/gpu_check.sh").read_text(), flags=re.M)
    assert loop, "gpu_check.sh runs tests/gpu_parts.py's parts in one loop"
    assert listed == loop.group(1).split() == ["collectives", "row-counts", "memory-sizing", "long-context",
                                               "capture-fallback", "fsdp", "lora"]
    numbers = re.findall(r"^    [a-z-]+\s+(\d)\. ", parts, flags=re.M)
    assert numbers == ["2", "3", "4", "5", "6", "7", "8"]  # parts 2-8, each help line names its number


BARS = r"x:  50%%|#  | 1/2 [00:01<00:01,  1.00it/s]\rx: 100%%|##| 2/2 [00:02<00:00,  1.00it/s]\n"  # tqdm, printf'd


def test_a_part_that_fails_hangs_or_skips_is_recorded_and_the_next_runs(tmp_path):
    steps = f"""
        . tests/gpu_lib.sh
        start_log {tmp_path}/log.txt "wiring"
        run_part 1 passes 5 true
        run_part 2 fails 5 sh -c 'echo broken; exit 3'
        run_part 3 hangs 1 sleep 30
        run_part 4 skips 5 sh -c 'echo "skipped: needs CUDA"; exit 77'
        run_part 5 bars 5 sh -c 'printf "{BARS}kept\\n"'
        summary
    """
    done = bash("-c", steps)
    log = (tmp_path / "log.txt").read_text()
    assert done.returncode == 1  # a part failed
    for line in ["part 1 passes: ok", "broken", "part 2 fails: FAILED (rc 3)",
                 "part 3 hangs: FAILED (stopped at its 1 s limit)", "part 4 skips: skipped (needs CUDA)",
                 "part 5 bars: ok", "kept"]:
        assert line in log
    assert not [line for line in log.splitlines() if line.endswith("it/s]")]  # progress bars stay out of the log
    assert log.index("=== summary") < log.rindex("part 2 fails: FAILED")  # the summary repeats every status


def test_flags_are_checked_before_any_work():
    check = bash("tests/gpu_check.sh", "--bogus")
    assert check.returncode == 2 and check.stderr.startswith("error: unknown argument --bogus")
    train = bash("tests/gpu_train.sh", "--rl-steps", "0")
    assert train.returncode == 2 and "--rl-steps needs a number of steps >= 1" in train.stderr
    assert "timeout_s" in bash("tests/gpu_train.sh", "--help").stdout  # the help names the device calls
