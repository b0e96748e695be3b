"""
Benchmarks. Each prints figures measured in this run; targets are printed beside them, never asserted in tests.

    python bench.py env        # sandbox throughput and runaway-query return times
    python bench.py grpo       # tokens/s of one GRPO step
    python bench.py rollout    # KV-cached multi-turn rollout vs the naive re-prefill loop
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

# -----------------------------------------------------------------------------

BENCHES = {
}

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name", choices=sorted(BENCHES), help="which benchmark to run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    BENCHES[args.name](args)
