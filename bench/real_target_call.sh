#!/usr/bin/env bash
# One device call of issue 24 (bench/real_target.py), run on the H200 from a copy of the repo that
# holds the wheels in whl/ and rtdata/HumanEval.jsonl.gz (bench/README.md, "Real target").
#
#   A  build the target, then the workflow on it: regenerate (the target itself), tokenize, merge,
#      extract, vocab; EAGLE-3 and DFlash trained and evaluated (real τ at K 3 / 7, T 0 / 1 for
#      EAGLE-3, T 0 for DFlash; simulated τ; n-gram), plus recipe variants through the same
#      commands. Returns the target (tar in 15 MB parts), the regenerated conversations and
#      every figure.
#   B  with A's target and conversations carried back in rtdata/: the workflow again from those
#      conversations (not regenerated), our EAGLE-3, speculators 0.9's EAGLE-3 on the same converted
#      data (bench/quality_compare.py), fp8 storage and further variants.
#
# Everything is killed at DEADLINE seconds (default 545) and what finished is packed into $OUT.
set -u -o pipefail
mode="$1"
shift
T0=$(date +%s)
DEADLINE=${DEADLINE:-545}
W=${W:-/tmp/rt}
mkdir -p "$W"
elapsed() { echo $(($(date +%s) - T0)); }
note() { echo "[call $mode $(elapsed)s] $*" | tee -a "$OUT/calllog.txt" >&2; }

# SKIP_INSTALL=1 W=... BUILD_ARGS='--tiny --corpus ...': the same call on a CPU machine, as a smoke test
[ -n "${SKIP_INSTALL:-}" ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=0 TQDM_DISABLE=1 OMP_WAIT_POLICY=PASSIVE
HE=$PWD/rtdata/HumanEval.jsonl.gz
SMK=(python3 -m snakemake --cores ${CORES:-8} --resources gpu=8 --scheduler greedy --rerun-incomplete)
note "wheels installed; $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader)"

collect() {
    note "collecting"
    python3 - "$W" "$OUT" <<'EOF'
import json, sys, pathlib
w, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
figs = {}
for acc in sorted(w.rglob("acceptance.json")):
    if "state" in acc.parts:
        continue
    r = json.loads(acc.read_text())
    figs[str(acc.relative_to(w))] = {"per_set": [{k: v for k, v in row.items() if k not in ("accepted", "reached")}
                                                 for row in r["per_set"]], "settings": r.get("settings")}
for ev in sorted(x for x in w.rglob("eval.json") if "drafter" in x.parts):
    r = json.loads(ev.read_text())
    figs[str(ev.relative_to(w))] = {k: r.get(k) for k in ("simulated_acceptance_length", "step_alpha", "train_tokens",
                                                          "steps", "tokens_per_s", "train_seconds", "loss", "peak_gpu_memory_gib")}
(out / "figures.json").write_text(json.dumps(figs, indent=1, default=str))
EOF
    tar -C "$W" -czf "$OUT/results.tgz" --exclude='hidden_states/*/rows_*' --exclude='*/store' --exclude='*/state' \
        --exclude='*.safetensors' --exclude='*/speculators_data' --exclude='*/run' --exclude='target*' \
        --exclude='*/datasets' --exclude='*/tokenized' --exclude='*/merged/train.jsonl' --exclude='regenerated.jsonl' . 2>/dev/null
    # finished prompt sets of evaluations that the deadline cut short (their per-set counts)
    (cd "$W" && find . -path '*state/evaluate*' -name '*.json' -o -path '*eval-state*' -name '*.json') \
        | tar -C "$W" -czf "$OUT/eval-state.tgz" -T - 2>/dev/null
    ls -la "$OUT" >&2
}

wait_all() {  # wait for the given pids, killing everything at the deadline
    while :; do
        alive=0
        for p in "$@"; do kill -0 "$p" 2>/dev/null && alive=1; done
        [ $alive = 0 ] && return 0
        if [ "$(elapsed)" -ge "$DEADLINE" ]; then
            note "deadline: killing what still runs"
            for p in "$@"; do kill -- -"$p" 2>/dev/null || kill "$p" 2>/dev/null; done
            pkill -P $$ 2>/dev/null
            sleep 2
            return 1
        fi
        sleep 3
    done
}

variant() {  # NAME LOG [args...]: in the background, its own process group
    local name="$1" logf="$2"
    shift 2
    setsid python3 bench/real_target.py variant --work "$W" --name "$name" --log "$logf" --wait-s 400 "$@" \
        > "$W/variant-$name.log" 2>&1 &
    echo $!
}

if [ "$mode" = A ]; then
    python3 bench/real_target.py build --work "$W" --humaneval "$HE" --max-prompts 16 --epochs 3 ${BUILD_ARGS:-} \
        > "$W/build.json" 2> "$W/build.log" || { note "build failed"; tail -30 "$W/build.log"; collect; exit 1; }
    cp "$W/build.log" "$OUT/build.log"
    note "target built: $(head -c 600 "$W/target/build_log.json" | tr -d '\n' | cut -c1-300)"
    (cd "$W" && tar -cf - target regen_prompts.jsonl heldout_prompts.jsonl) | split -b 15M -d - "$OUT/target.tar."
    "${SMK[@]}" "$W/results/hidden_states/data_config.json" "$W/results/vocab/draft_vocab.safetensors" \
        --configfile "$W/config-eagle3.yaml" > "$W/smk-data.log" 2>&1 || { note "data stages failed"; tail -40 "$W/smk-data.log"; collect; exit 1; }
    note "data stages done"
    python3 - "$W" <<'EOF'
import sys, pathlib, json, gzip
from draftflow.jsonl import read_jsonl
w = pathlib.Path(sys.argv[1])
with gzip.open(w / "regenerated.jsonl.gz", "wt") as f:
    for shard in sorted((w / "results/regenerated/code").glob("shard-*.jsonl.zst")):
        for r in read_jsonl(shard):
            f.write(json.dumps({"id": r["id"], "messages": r["messages"]}) + "\n")
EOF
    cp "$W/regenerated.jsonl.gz" "$OUT/"
    setsid "${SMK[@]}" "$W/results/eval/eagle3/acceptance.json" --configfile "$W/config-eagle3.yaml" > "$W/smk-eagle3.log" 2>&1 &
    p1=$!
    sleep 20
    setsid "${SMK[@]}" --nolock "$W/results/eval/dflash/acceptance.json" --configfile "$W/config-dflash.yaml" > "$W/smk-dflash.log" 2>&1 &
    p2=$!
    EV=(--evaluate --threads 3 --set runtime.num_workers=2 --eval-set 'draft_tokens=[3,7]')
    v1=$(variant lr4e-3 "$W/smk-eagle3.log" "${EV[@]}" --set learning_rate=0.004)
    v2=$(variant lr1e-3 "$W/smk-eagle3.log" "${EV[@]}" --set learning_rate=0.001)
    v3=$(variant dflash-lr4e-3 "$W/smk-dflash.log" "${EV[@]}" --set learning_rate=0.004)
    wait_all "$p1" "$p2" "$v1" "$v2" "$v3"
    note "main runs and first variants done"
    collect
elif [ "$mode" = B ]; then
    # the target of call A (rtdata/target.tar.*), regenerated again through the workflow
    cat rtdata/target.tar.* | tar -C "$W" -xf - || exit 1
    LR=${LR:-0.0001}
    python3 bench/real_target.py configs --work "$W" --humaneval "$HE" --max-prompts 16 --epochs 3 \
        --learning-rate "$LR" ${CONFIG_ARGS:-} || exit 1
    timeout $((DEADLINE - 30 - $(elapsed))) "${SMK[@]}" "$W/results/hidden_states/data_config.json" \
        "$W/results/vocab/draft_vocab.safetensors" --configfile "$W/config-eagle3.yaml" > "$W/smk-data.log" 2>&1 \
        || { note "data stages failed"; tail -40 "$W/smk-data.log"; collect; exit 1; }
    note "data stages done"
    ln -sfn "$W/target" "$W/results/target"
    setsid "${SMK[@]}" "$W/results/eval/eagle3/acceptance.json" --configfile "$W/config-eagle3.yaml" > "$W/smk-eagle3.log" 2>&1 &
    p1=$!
    sleep 15
    setsid "${SMK[@]}" --nolock "$W/results/eval/dflash/acceptance.json" --configfile "$W/config-dflash.yaml" > "$W/smk-dflash.log" 2>&1 &
    p2=$!
    pids=("$p1" "$p2")
    for lr in ${SPEC_LRS:-$LR}; do
        setsid python3 bench/quality_compare.py --results "$W/results" --config "$W/config-eagle3.yaml" --work "$W/qc-$lr" \
            --trainers speculators --device cuda --threads 3 --spec-kernels eager --set "train.learning_rate=$lr" \
            --label "lr$lr" --output "$W/qc.jsonl" > "$W/qc-$lr.log" 2>&1 &
        pids+=("$!")
    done
    for spec in ${VARIANTS:-}; do  # NAME:KEY=VALUE[,KEY=VALUE]
        name="${spec%%:*}"
        sets=()
        IFS=, read -ra kv <<< "${spec#*:}"
        for x in "${kv[@]}"; do sets+=(--set "$x"); done
        logf="$W/smk-eagle3.log"
        case "$name" in dflash*) logf="$W/smk-dflash.log" ;; esac
        pids+=("$(variant "$name" "$logf" --evaluate --threads 2 --set runtime.num_workers=2 "${sets[@]}")")
    done
    wait_all "${pids[@]}"
    note "done"
    collect
fi
