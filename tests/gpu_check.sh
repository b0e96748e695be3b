#!/usr/bin/env bash
# The GPU check, one command for a lent GPU machine (no network, no SmolLM2 weights): the CUDA tests, then the GPU
# rollout benchmark (random Qwen3 shapes). SmolLM2's tokenizer and the pinned transformers wheel (the machine's own
# transformers may be another version) travel in .gpu/, which git ignores.
#   here, once:          bash tests/gpu_check.sh --prepare
#   on the GPU machine:  bash tests/gpu_check.sh        (device tool: carry [".gpu"], about 5 minutes)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--prepare" ]; then
    folder=$(python -c "from model import smollm2_folder; print(smollm2_folder())")
    mkdir -p .gpu/sqlrl/SmolLM2-135M-Instruct .gpu/wheels
    cp "$folder"/tokenizer.json "$folder"/tokenizer_config.json "$folder"/chat_template.jinja \
        .gpu/sqlrl/SmolLM2-135M-Instruct/
    python -m pip download -q --no-deps --only-binary=:all: -d .gpu/wheels \
        "$(grep -o '^transformers==[^ ]*' requirements.txt)"
    echo "prepared .gpu/ ($(du -sh .gpu | cut -f1))"
    exit 0
fi
if compgen -G ".gpu/wheels/*.whl" > /dev/null; then
    python -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/sqlrl-site .gpu/wheels/*.whl
    export PYTHONPATH=/tmp/sqlrl-site
fi
export SQLRL_CACHE="$PWD/.gpu/sqlrl"
out="${OUT:-.gpu}"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu_check.txt"
python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
    | tee -a "$out/gpu_check.txt"
python -m pytest -q tests/test_cuda.py 2>&1 | tail -15 | tee -a "$out/gpu_check.txt"
python bench.py rollout --device cuda 2>&1 | grep -v "it/s]" | tee -a "$out/gpu_check.txt"
