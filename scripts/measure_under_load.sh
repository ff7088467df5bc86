#!/usr/bin/env bash
# Time `make run` on a fresh clone idle and with CPU-bound processes beside it, side by side
# in one call, and `make test` with them beside it (issue 19: loaded <= 1.5 x idle; test < 20 min).
#
# Usage: scripts/measure_under_load.sh [options]
#   --configfile FILE   run the pipeline on this config (absolute, or relative to the repo
#                       and committed) instead of the embedded default, e.g. a small one
#   --hogs N            CPU-bound processes beside the loaded runs (default 1: python3 -c 'while 1: pass')
#   --repeat R          idle/loaded pairs of `make run` (default 1; pairs alternate, idle first)
#   --no-test           skip `make test` under load;   --test-idle   also time `make test` idle
#   --pytest-args ARGS  what `make test` passes to pytest (e.g. "-k progress" to try the script)
#   --venv DIR          reuse this virtualenv (default: the repo's .venv, made by `make setup`);
#   --fresh-venv        or make a new one in the clone with `make setup` (timed apart: setup_s)
#   --keep              keep the clone (default: deleted)
# Prints progress on stderr and one JSON line on stdout:
#   {"run_idle_s": [...], "run_loaded_s": [...], "run_ratio": ..., "test_loaded_s": ..., ...}
# A fair figure needs an otherwise quiet machine: the script records the load average before.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CONFIGFILE="" HOGS=1 REPEAT=1 TEST=1 TEST_IDLE=0 PYTEST_ARGS="" VENV="$REPO/.venv" FRESH=0 KEEP=0
while (($#)); do
    case $1 in
        --configfile) CONFIGFILE=$2; shift ;;
        --hogs) HOGS=$2; shift ;;
        --repeat) REPEAT=$2; shift ;;
        --no-test) TEST=0 ;;
        --test-idle) TEST_IDLE=1 ;;
        --pytest-args) PYTEST_ARGS=$2; shift ;;
        --venv) VENV=$(cd "$2" && pwd); shift ;;
        --fresh-venv) FRESH=1 ;;
        --keep) KEEP=1 ;;
        -h | --help) sed -n '2,19p' "$0"; exit 0 ;;
        *) echo "measure_under_load: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done

say() { echo "[measure_under_load $(date +%T)] $*" >&2; }
WORK=$(mktemp -d)
HOG_PIDS=()
cleanup() {
    for pid in "${HOG_PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
    ((KEEP)) && say "clone kept in $WORK/clone" || rm -rf "$WORK"
}
trap cleanup EXIT

git clone --quiet "$REPO" "$WORK/clone"
cd "$WORK/clone"
LOAD_BEFORE=$(cut -d' ' -f1-3 /proc/loadavg)
SETUP_S=null
if ((FRESH)); then
    VENV="$WORK/clone/.venv"
    t0=$(date +%s.%N)
    make setup >"$WORK/setup.log" 2>&1
    SETUP_S=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { print b - a }')
else
    [[ -f $VENV/.installed ]] || { echo "measure_under_load: $VENV is not set up: run 'make setup' or pass --fresh-venv" >&2; exit 1; }
fi
# The clone's code, also where the venv's editable install points elsewhere.
export PYTHONPATH="$WORK/clone${PYTHONPATH:+:$PYTHONPATH}"
MAKE_VARS=(VENV="$VENV")
# A fresh clone's pyproject.toml is newer than a reused venv: do not let make reinstall it.
((FRESH)) || MAKE_VARS+=(-o "$VENV/.installed")
[[ -n $CONFIGFILE ]] && MAKE_VARS+=(SNAKEMAKE_ARGS="--configfile $CONFIGFILE")
[[ -n $PYTEST_ARGS ]] && MAKE_VARS+=(PYTEST_ARGS="$PYTEST_ARGS")

hogs_on() {
    for ((i = 0; i < HOGS; i++)); do
        python3 -c 'while 1: pass' &
        HOG_PIDS+=($!)
    done
}
hogs_off() {
    for pid in "${HOG_PIDS[@]}"; do kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; done
    HOG_PIDS=()
}
# timed LABEL TARGET: seconds of `make TARGET`, its output in $WORK/LABEL.log
timed() {
    local t0 t1
    t0=$(date +%s.%N)
    if ! make "$2" "${MAKE_VARS[@]}" >"$WORK/$1.log" 2>&1; then
        tail -40 "$WORK/$1.log" >&2
        echo "measure_under_load: make $2 failed ($1); log above" >&2
        exit 1
    fi
    t1=$(date +%s.%N)
    awk -v a="$t0" -v b="$t1" 'BEGIN { print b - a }'
}

IDLE=() LOADED=()
for ((r = 1; r <= REPEAT; r++)); do
    rm -rf results .snakemake
    say "make run, idle ($r/$REPEAT)"
    IDLE+=("$(timed "run-idle-$r" run)")
    say "  ${IDLE[-1]} s"
    rm -rf results .snakemake
    say "make run, $HOGS CPU-bound process(es) beside it ($r/$REPEAT)"
    hogs_on
    LOADED+=("$(timed "run-loaded-$r" run)")
    hogs_off
    say "  ${LOADED[-1]} s"
done
TEST_LOADED=null TEST_IDLE_S=null
if ((TEST)); then
    if ((TEST_IDLE)); then
        say "make test, idle"
        TEST_IDLE_S=$(timed test-idle test)
        say "  $TEST_IDLE_S s"
    fi
    say "make test, $HOGS CPU-bound process(es) beside it"
    hogs_on
    TEST_LOADED=$(timed test-loaded test)
    hogs_off
    say "  $TEST_LOADED s"
fi

python3 - "$LOAD_BEFORE" "$SETUP_S" "$TEST_LOADED" "$TEST_IDLE_S" "$HOGS" "$CONFIGFILE" "$(nproc)" \
    "${#IDLE[@]}" "${IDLE[@]}" "${LOADED[@]}" <<'EOF'
import json, sys
load, setup, test_loaded, test_idle, hogs, configfile, cpus, n, *times = sys.argv[1:]
n = int(n)
idle, loaded = [round(float(t), 1) for t in times[:n]], [round(float(t), 1) for t in times[n:]]
num = lambda s: None if s == "null" else round(float(s), 1)
print(json.dumps({
    "run_idle_s": idle, "run_loaded_s": loaded,
    "run_ratio": round(min(loaded) / min(idle), 3) if idle and loaded else None,
    "test_loaded_s": num(test_loaded), "test_idle_s": num(test_idle), "setup_s": num(setup),
    "hogs": int(hogs), "cpus": int(cpus), "loadavg_before": load, "configfile": configfile or "default",
}))
EOF
