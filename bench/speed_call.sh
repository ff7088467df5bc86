#!/usr/bin/env bash
# Issue 34's figures as device calls (bench/README.md §8), after the wheels of §1 (carry .whl):
#   train    DFlash and EAGLE-3 training with --profile from the checkout, then each once from the
#            older code in .bench-base/ (if there: `git archive <commit> draftflow bench | tar -x -C .bench-base`)
#   extract  DFlash with --fused-ce, then extraction, lossless and fp8
# Every result lands in $OUT as it finishes (a call cut short returns what finished); each bench
# gets at most LIMIT seconds (default 300).
set -u -o pipefail
mode="$1"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$OUT/calllog.txt"
bench() {  # NAME CODE_DIR ARGS…: one bench run, its stdout (JSON lines) and stderr (profile) in $OUT/NAME.log
    local name=$1 code=$2 start=$SECONDS
    shift 2
    PYTHONPATH=/tmp/site:$code timeout "${LIMIT:-300}" python3 "$code/bench/$1" "${@:2}" > "$OUT/$name.log" 2>&1
    echo "$name rc=$? $((SECONDS - start))s" | tee -a "$OUT/calllog.txt"
}
if [ "$mode" = train ]; then
    bench dflash "$PWD" train_throughput.py --method dflash --samples 96 --workers 8 --profile
    bench eagle3 "$PWD" train_throughput.py --samples 96 --profile
    if [ -d .bench-base ]; then
        bench eagle3-base "$PWD/.bench-base" train_throughput.py --samples 96
        bench dflash-base "$PWD/.bench-base" train_throughput.py --method dflash --samples 96 --workers 8
    fi
elif [ "$mode" = extract ]; then
    bench dflash-fused-ce "$PWD" train_throughput.py --method dflash --samples 96 --workers 8 --fused-ce
    bench extract "$PWD" extract_throughput.py --samples 400 --writer-threads 12 --storage lossless fp8
fi
