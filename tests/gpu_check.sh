#!/usr/bin/env bash
# The GPU check: one command on a lent GPU machine (no network, no SmolLM2 weights), about 6 minutes on an H100, in
# nine parts: 1 the CUDA tests; 2-8 tests/gpu_parts.py (the collectives forced at world 1, sampled rollouts at
# several row counts, memory sizing after a cached 10 GB block, a 16k-token rollout beside a ballast, a failed graph
# capture, FSDP2 at world 1, a 7B GRPO step with LoRA); 9 the GPU rollout benchmark and its two speedups. Each part runs on its own: its output
# and a line "part N name: ok|FAILED|skipped" go to $OUT/gpu_check.txt (.gpu/ without $OUT) as they come, a failed
# part does not stop the next, and the exit status is 1 if any failed. SmolLM2's tokenizer and the pinned transformers
# sqlglot and peft wheels (the machine has another transformers and no sqlglot) travel in .gpu/, which git ignores.
#   here, once:          bash tests/gpu_check.sh --prepare     # .gpu/wheels, .gpu/sqlrl (under 20 MiB)
#   here, the wiring:    bash tests/gpu_check.sh --dry-run     # every part the CPU can run, tiny sizes, ~2 minutes
#   on the GPU machine:  bash tests/gpu_check.sh               # device tool: carry [".gpu/wheels", ".gpu/sqlrl"],
#                                                              # timeout_s 420
set -uo pipefail  # no -e: a part that fails is recorded and the next one runs
cd "$(dirname "$0")/.."
. tests/gpu_lib.sh

mode=gpu
case "${1:-}" in
    "") ;;
    --prepare) mode=prepare ;;
    --dry-run) mode=dry ;;
    -h | --help) help_text "$0"; exit 0 ;;
    *) echo "error: unknown argument $1: --prepare, --dry-run, or none on the GPU machine; see --help" >&2; exit 2 ;;
esac

if [ "$mode" = prepare ]; then
    set -e
    folder=$($PY -c "from model import smollm2_folder; print(smollm2_folder())")
    rm -rf .gpu/wheels .gpu/sqlrl
    mkdir -p .gpu/sqlrl/SmolLM2-135M-Instruct .gpu/wheels
    cp "$folder"/tokenizer.json "$folder"/tokenizer_config.json "$folder"/chat_template.jinja \
        .gpu/sqlrl/SmolLM2-135M-Instruct/
    for pin in transformers sqlglot peft; do  # the versions requirements.txt pins
        $PY -m pip download -q --no-deps --only-binary=:all: -d .gpu/wheels "$(grep -o "^$pin==[^ ]*" requirements.txt)"
    done
    echo "prepared .gpu/wheels and .gpu/sqlrl: $(du -shc .gpu/wheels .gpu/sqlrl | tail -1 | cut -f1) to carry"
    ls .gpu/wheels
    echo "next, the wiring here: bash tests/gpu_check.sh --dry-run"
    echo "then the device tool: run(command=\"bash tests/gpu_check.sh\", carry=[\".gpu/wheels\", \".gpu/sqlrl\"]," \
        "timeout_s=420)"
    exit 0
fi

out="${OUT:-.gpu}"
start_log "$out/gpu_check.txt" "GPU check ($mode)"
if [ "$mode" = gpu ]; then
    device=cuda
    site=/tmp/sqlrl-site
    deadline=${GPU_CHECK_DEADLINE_S:-400}  # the device call's timeout_s is 420: the summary still gets written
    nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader 2>&1 | tee -a "$log"
else
    device=cpu
    site=/tmp/sqlrl-site-dry  # the same install, kept apart from a GPU run's folder
fi
if compgen -G ".gpu/wheels/*.whl" > /dev/null && [ -f .gpu/sqlrl/SmolLM2-135M-Instruct/tokenizer.json ]; then
    if install_wheels "$site" .gpu/wheels/*.whl; then
        record "part 0 wheels: ok, $(cd .gpu/wheels && echo *.whl)"
    else
        parts_failed=$((parts_failed + 1))
        record "part 0 wheels: FAILED; going on with this machine's own packages"
    fi
    export SQLRL_CACHE="$PWD/.gpu/sqlrl"  # the tokenizer alone: the parts use random weights
else
    parts_failed=$((parts_failed + 1))
    record "part 0 wheels: FAILED, no .gpu/wheels or .gpu/sqlrl (bash tests/gpu_check.sh --prepare makes them," \
        "carry both); going on with this machine's own packages"
fi
if [ "$mode" = gpu ] && ! $PY -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
    say "error: PyTorch sees no CUDA device here; on a CPU machine run bash tests/gpu_check.sh --dry-run"
    exit 1
fi

run_part 1 cuda-tests 180 $PY -u -m pytest -q -p no:cacheprovider tests/test_cuda.py
n=2
for part in collectives row-counts memory-sizing long-context capture-fallback fsdp lora; do
    run_part $n "$part" 120 $PY -u tests/gpu_parts.py "$part" --device $device
    n=$((n + 1))
done
if [ "$mode" = gpu ]; then
    run_part 9 bench-rollout 300 $PY -u bench.py rollout --device cuda
    mapfile -t speedups < <(this_run "^rollout speedup")
    for line in "${speedups[@]}"; do
        keep "  bench: $line"
    done
else
    skip_part 9 bench-rollout "random Qwen3 shapes in bf16 under CUDA graphs; on the CPU it decodes SmolLM2 for minutes"
fi
summary
