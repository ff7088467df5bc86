#!/usr/bin/env bash
# Issue 34's figures as device calls (bench/README.md §8), after the wheels of §1 (carry .whl):
#   train    DFlash and EAGLE-3 training with --profile from the checkout, then each once from the
#            older code in .bench-base/ (if there: `git archive <commit> draftflow bench | tar -x -C .bench-base`)
#   all      the done-when's figures in one call: DFlash and EAGLE-3 with --profile, extraction
#            (EAGLE-3 with ATTENTION, default auto: the workflow's CUDA choice, chunked-gqa; see `attention`; then
#            once more with the chunked one, heads expanded, for the ratio); then the CUDA tests (with .dev-test/)
#   attention  EAGLE-3's three TTT attentions side by side (--ttt-attention chunked-gqa, flex, chunked),
#            then the CUDA tests (with .dev-test/, below)
#   extract  extraction, lossless and fp8, from the checkout and from .bench-base/; then, with pytest's
#            wheels carried in .dev-test/, the extraction tests that need CUDA
# Every result lands in $OUT as it finishes (a call cut short returns what finished); each bench
# gets at most LIMIT seconds (default 300).
set -u -o pipefail
mode="$1"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$OUT/calllog.txt"
bench() {  # NAME CODE_DIR SCRIPT ARGS…: one bench run, its stdout (JSON lines) and stderr (profile) in $OUT/NAME.log
    local name=$1 code=$2 start=$SECONDS
    shift 2
    PYTHONPATH=/tmp/site:$code timeout "${LIMIT:-300}" python3 "$code/bench/$1" "${@:2}" > "$OUT/$name.log" 2>&1
    echo "$name rc=$? $((SECONDS - start))s" | tee -a "$OUT/calllog.txt"
}
if [ "$mode" = all ]; then
    bench dflash "$PWD" train_throughput.py --method dflash --samples 96 --workers 8 --profile
    bench eagle3 "$PWD" train_throughput.py --samples 96 --profile --ttt-attention "${ATTENTION:-auto}"
    bench extract "$PWD" extract_throughput.py --samples 400 --writer-threads 12 --storage lossless fp8
    # another attention's figure is compared with the chunked one's from the same machine
    [ "${ATTENTION:-auto}" != chunked ] && bench eagle3-chunked "$PWD" train_throughput.py --samples 96 --ttt-attention chunked
elif [ "$mode" = train ]; then
    bench dflash "$PWD" train_throughput.py --method dflash --samples 96 --workers 8 --profile
    bench eagle3 "$PWD" train_throughput.py --samples 96 --profile
    if [ -d .bench-base ]; then
        bench eagle3-base "$PWD/.bench-base" train_throughput.py --samples 96
        bench dflash-base "$PWD/.bench-base" train_throughput.py --method dflash --samples 96 --workers 8
    fi
elif [ "$mode" = attention ]; then
    bench eagle3-chunked-gqa "$PWD" train_throughput.py --samples 96 --ttt-attention chunked-gqa --profile
    bench eagle3-flex "$PWD" train_throughput.py --samples 96 --ttt-attention flex --profile
    bench eagle3-chunked "$PWD" train_throughput.py --samples 96 --ttt-attention chunked
fi
if [ "$mode" = extract ]; then
    bench extract "$PWD" extract_throughput.py --samples 400 --writer-threads 12 --storage lossless fp8
    [ -d .bench-base ] && bench extract-base "$PWD/.bench-base" extract_throughput.py --samples 400 --writer-threads 12 --storage lossless fp8
fi
if [ "$mode" != train ]; then
    if [ -d .dev-test ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .dev-test/*.whl
        timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_extract.py tests/test_packing.py -k cuda -rs \
            > "$OUT/pytest-cuda.log" 2>&1
        echo "pytest-cuda rc=$?" | tee -a "$OUT/calllog.txt"
    fi
fi
