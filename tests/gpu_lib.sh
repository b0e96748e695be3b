# A device run's steps, shared by tests/gpu_check.sh and tests/gpu_train.sh: each step is its own command under a time
# limit, whose output (progress bars left out) and status line ("part 3 row-counts: ok, 21 s", "...: FAILED (rc 1),
# 9 s", "...: skipped (why)") are appended to the log as they come, so a step that fails or hangs costs only itself;
# and the wheels that reach a machine without network.
# A deadline (seconds since the script started) shortens the last limits, so that a run ends with its summary before
# the device tool's timeout_s would cut it off.
#   . tests/gpu_lib.sh; start_log "$OUT/gpu_check.txt" "GPU check"; run_part 3 row-counts 90 python3 -u ...; summary

PY=${PYTHON:-python3}  # the GPU machine's python3 is the one that holds PyTorch
SKIPPED=77             # a step's exit status for "does not apply here" (tests/gpu_parts.py)
export PYTHONUNBUFFERED=1
deadline=0             # 0: none; else no step runs past this many seconds of $SECONDS
parts_failed=0
part_lines=()

help_text() {  # help_text SCRIPT: its opening comment
    awk 'NR > 1 && /^#/ { print; next } NR > 1 { exit }' "$1"
}

start_log() {  # start_log FILE TITLE: later lines append to FILE (what an earlier run wrote there stays)
    log=$1
    mkdir -p "$(dirname "$log")"
    log_from=$(cat "$log" 2>/dev/null | wc -l)  # this run's lines come after these
    local commit
    commit=$(git rev-parse --short HEAD 2>/dev/null || echo "not a git checkout")
    say "=== $2, $(date -u '+%Y-%m-%d %H:%M:%S') UTC, $(hostname), commit $commit"
}

say() {
    echo "$*" | tee -a "$log"
}

this_run() {  # this_run PATTERN: the lines of this run's log that match the extended regular expression
    tail -n +$((log_from + 1)) "$log" | grep -E "$1"
}

unbar() {  # tqdm redraws a bar with carriage returns: one line each, then the bars' lines left out
    sed -u 's/\r/\n/g' | grep --line-buffered -v -E '\[[0-9:]+<[0-9:?]*, [^]]*\]$|^[[:space:]]*$'
}

record() {  # a line in the log now and in the summary
    part_lines+=("$1")
    say "$1"
}

keep() {  # a line the log already has, again in the summary
    part_lines+=("$1")
}

run_part() {  # run_part N NAME LIMIT_S COMMAND...: one step, killed past LIMIT_S seconds, its status recorded;
    # status 1 if it failed
    local n=$1 name=$2 limit=$3
    shift 3
    local t0=$SECONDS status
    if [ "$deadline" -gt 0 ] && [ $((deadline - SECONDS)) -lt "$limit" ]; then
        limit=$((deadline - SECONDS))
        if [ "$limit" -lt 10 ]; then
            parts_failed=$((parts_failed + 1))
            record "part $n $name: FAILED (not run: $SECONDS s of the run's $deadline s are gone)"
            return 1
        fi
    fi
    say "--- part $n $name: $*"
    local from
    from=$(wc -l < "$log")  # the part's own lines start after this one
    if declare -F "$1" > /dev/null; then  # a function of the calling script: run as it is (no timeout for those)
        "$@" 2>&1 | unbar | tee -a "$log"
    else
        timeout -k 10 "$limit" "$@" 2>&1 | unbar | tee -a "$log"
    fi
    local rc=${PIPESTATUS[0]}
    case $rc in
        0) status="ok" ;;
        "$SKIPPED") status="skipped ($(tail -n +$((from + 1)) "$log" | grep '^skipped: ' | tail -1 | cut -c10-))" ;;
        124 | 137) status="FAILED (stopped at its $limit s limit)" ;;
        *) status="FAILED (rc $rc)" ;;
    esac
    record "part $n $name: $status, $((SECONDS - t0)) s"
    if [[ $status == FAILED* ]]; then
        parts_failed=$((parts_failed + 1))
        return 1
    fi
}

skip_part() {  # skip_part N NAME WHY
    record "part $1 $2: skipped ($3)"
}

summary() {  # the status lines again, together, and the exit status: 1 if any part failed
    say "=== summary, $SECONDS s in all"
    local line
    for line in "${part_lines[@]}"; do
        say "$line"
    done
    [ "$parts_failed" -eq 0 ]
}

install_wheels() {  # install_wheels SITE WHEEL...: offline, without their dependencies (the image has them); the
    # site then comes first on PYTHONPATH, before the image's own versions. Logged; status 1 if pip failed
    local site=$1
    shift
    $PY -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" "$@" 2>&1 | tee -a "$log"
    if [ "${PIPESTATUS[0]}" -ne 0 ]; then
        say "pip could not install $* into $site"
        return 1
    fi
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    $PY -c "import sys, torch, transformers; print('python', sys.version.split()[0], 'torch', torch.__version__,
 'transformers', transformers.__version__, 'from', transformers.__file__)" 2>&1 | tee -a "$log"
}
