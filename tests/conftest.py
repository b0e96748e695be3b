"""Shared test fixtures. Tests that need the real Spider dev set skip when ../shared is absent (a user's clone)."""
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
