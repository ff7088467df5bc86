#!/usr/bin/env bash
# One device call of issue 24 (bench/real_target.py), run on the H200 from a copy of the repo that
# holds the wheels in whl/ and rtdata/HumanEval.jsonl.gz (bench/README.md, "Real target").
#
#   A  build the target, then the workflow on it: regenerate (the target itself), tokenize, merge,
#      extract, vocab; EAGLE-3 and DFlash trained and evaluated (real τ at K 3 / 7, T 0 / 1 for
#      EAGLE-3, T 0 for DFlash; simulated τ; n-gram), plus recipe variants through the same
#      commands. Returns the target (tar in 15 MB parts), the regenerated conversations and
#      every figure.
#   B  with A's target carried back in rtdata/: the workflow again (regenerated again), our EAGLE-3,
#      speculators 0.9's EAGLE-3 on the same converted data (bench/quality_compare.py) and variants.
#   S  (sweep) build the target and the data stages as A (or, as C, use a carried target and its
#      conversations), return the target and the regenerated conversations, then train recipe
#      variants for their simulated τ only (SIM_VARIANTS; DFlash through the workflow's train rule
#      and DFLASH_VARIANTS).
#   C  (compare) build the target as S, or with a target and conversations carried in rtdata/ (not
#      regenerated) use those; the data stages, lossless and fp8 side by side; our EAGLE-3 and speculators' at each of LRS, our DFlash; then
#      every drafter evaluated by `draftflow evaluate`, one process per drafter and temperature.
#
# Everything is killed at DEADLINE seconds (default 545) and what finished is packed into $OUT.
set -u -o pipefail
mode="$1"
shift
T0=$(date +%s)
DEADLINE=${DEADLINE:-545}
W=${W:-/tmp/rt}
# a warm device machine keeps /tmp between calls: a stale drafter or eval.json there would be taken
# for this call's (2026-12-02: DFlash evaluated before its retraining), so each call starts clean
rm -rf "$W"
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
    # (results.tgz also holds the finished prompt sets of evaluations a deadline cut short: */eval-state)
    ls -la "$OUT" >&2  # a call returns at most 8 files
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
            # what runs in subshells without a process group of its own (eval_when_ready)
            pkill -f 'draftflow\.cli|scripts/bin/draftflow|bench/real_target\.py|bench/quality_compare\.py|-m snakemake|speculators\.train' 2>/dev/null
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

build_target() {  # S and C: the target and the workflow's configs; its files (3 parts) into $OUT for a later call
    python3 bench/real_target.py build --work "$W" --humaneval "$HE" --max-prompts "${MAX_PROMPTS:-10}" \
        --epochs "${EPOCHS:-3}" --learning-rate "${LR:-0.0001}" ${BUILD_ARGS:-} ${CONFIG_ARGS:-} \
        > "$W/build.json" 2> "$W/build.log" || { note "build failed"; tail -30 "$W/build.log"; collect; return 1; }
    note "target built: $(grep -o 'ppl [0-9.]*' "$W/build.log" | tail -1)"
    (cd "$W" && tar -cf - target heldout_prompts.jsonl) | split -b 15M -d - "$OUT/target.tar."  # C needs no regen prompts
}

carried_or_built_target() {  # S and C: a target and conversations carried in rtdata/ (not regenerated), else a build
    if [ -e rtdata/target.tar.00 ]; then
        cat rtdata/target.tar.* | tar -C "$W" -xf - || return 1
        gunzip -c rtdata/regenerated.jsonl.gz > "$W/regenerated.jsonl" || return 1
        python3 bench/real_target.py configs --work "$W" --humaneval "$HE" --max-prompts "${MAX_PROMPTS:-10}" \
            --epochs "${EPOCHS:-3}" --learning-rate "${LR:-0.0001}" --data-path "$W/regenerated.jsonl" ${CONFIG_ARGS:-} || return 1
        note "target and conversations carried"
    else  # built again (the same seed and data), and regenerated by the workflow
        build_target
    fi
}

regenerated_out() {  # the regenerated conversations, for a later call (C) to train on without regenerating
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
}

sim_variant() {  # NAME:KEY=VALUE[,...]: our EAGLE-3 trained with those train keys, simulated τ only
    # (seeds=N is this variant's seed instead of SIM_SEEDS: one process per seed runs them side by side)
    local spec="$1" name="${1%%:*}" sets=() seeds="${SIM_SEEDS:-0}"
    IFS=, read -ra kv <<< "${spec#*:}"
    for x in "${kv[@]}"; do
        case "$x" in
            seeds=*) seeds="${x#seeds=}" ;;
            ?*) sets+=(--set "train.$x") ;;
        esac
    done
    setsid python3 bench/quality_compare.py --results "$W/results" --config "$W/config-eagle3.yaml" --work "$W/qc" \
        --trainers ours --sim-only --device "${DEVICE:-cuda}" --threads 2 --label "$name" --set train.num_workers=1 \
        --seeds $seeds "${sets[@]}" --output "$W/qc.jsonl" \
        > "$W/qc-$name.log" 2>&1 &
    echo $!
}

eval_when_ready() {  # NAME DRAFTER READY: once the file READY exists, evaluate DRAFTER at T = 0 and 1, side by side
    local name="$1" drafter="$2" ready="$3"
    (
        while [ ! -e "$ready" ]; do
            [ "$(elapsed)" -ge "$DEADLINE" ] && exit 1
            sleep 5
        done
        note "evaluating $name"
        for t in ${EVAL_TEMPS-0 1}; do  # EVAL_TEMPS="" evaluates nothing (simulated τ from training only)
            for ps in ${EVAL_SETS:-heldout humaneval}; do
                for seed in ${EVAL_SEEDS:-0}; do  # evaluate.seed: the sampling draws at T > 0
                    tag="$ps-T$t"
                    [ "$seed" != 0 ] && tag="$tag-seed$seed"
                    python3 bench/real_target.py evaluate --results "$W/results" --config "$W/config-eagle3.yaml" \
                        --drafter "$drafter" --temperature "$t" --prompt-set "$ps" --device "${EVAL_DEVICE:-cpu}" \
                        --set "evaluate.seed=$seed" --threads "${EVAL_THREADS:-1}" --out "$W/evals/$name/$tag" \
                        > "$W/eval-$name-$tag.log" 2>&1 &
                done
            done
        done
        wait
        note "evaluated $name"
    ) > /dev/null 2>&1 &
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
    regenerated_out
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
elif [ "$mode" = S ]; then
    carried_or_built_target || exit 1
    "${SMK[@]}" "$W/results/hidden_states/data_config.json" "$W/results/vocab/draft_vocab.safetensors" \
        --configfile "$W/config-eagle3.yaml" > "$W/smk-data.log" 2>&1 || { note "data stages failed"; tail -40 "$W/smk-data.log"; collect; exit 1; }
    note "data stages done"
    [ -e "$W/regenerated.jsonl" ] || regenerated_out
    ln -sfn "$W/target" "$W/results/target"
    pids=()
    if [ -z "${NO_DFLASH:-}" ]; then  # NO_DFLASH=1: the GPU for the EAGLE-3 variants alone
        setsid "${SMK[@]}" "$W/results/drafter/dflash" --configfile "$W/config-dflash.yaml" > "$W/smk-dflash.log" 2>&1 &
        pids+=("$!")
    fi
    for spec in ${SIM_VARIANTS:-base:}; do  # NAME:KEY=VALUE[,KEY=VALUE] (train keys): our EAGLE-3, simulated τ
        pids+=("$(sim_variant "$spec")")
    done
    for spec in ${DFLASH_VARIANTS:-}; do  # NAME:KEY=VALUE[,...] (dflash.KEY nests): the train rule's command
        name="${spec%%:*}"
        sets=()
        IFS=, read -ra kv <<< "${spec#*:}"
        for x in "${kv[@]}"; do [ -n "$x" ] && sets+=(--set "$x"); done
        pids+=("$(variant "$name" "$W/smk-dflash.log" --threads 2 --set runtime.num_workers=1 "${sets[@]}")")
    done
    wait_all "${pids[@]}"
    note "done"
    collect
elif [ "$mode" = C ]; then
    carried_or_built_target || exit 1
    # the same data stages into a second results folder with fp8 storage (fp8 against lossless)
    python3 - "$W" <<'EOF'
import sys, pathlib, yaml
w = pathlib.Path(sys.argv[1])
c = yaml.safe_load((w / "config-eagle3.yaml").read_text())
c["results"] = str(w / "results-fp8")
c["extract"]["storage"] = "fp8"
(w / "config-fp8.yaml").write_text(yaml.safe_dump(c, sort_keys=False))
EOF
    DATA=(hidden_states/data_config.json vocab/draft_vocab.safetensors)
    "${SMK[@]}" "${DATA[@]/#/$W/results/}" --configfile "$W/config-eagle3.yaml" > "$W/smk-data.log" 2>&1 \
        || { note "data stages failed"; tail -40 "$W/smk-data.log"; collect; exit 1; }
    note "data stages done"
    [ -e "$W/regenerated.jsonl" ] || regenerated_out
    # fp8: the data stages before extraction are the lossless run's (linked, so Snakemake finds them
    # done); a dry run must plan extraction only, else fp8 is skipped (nothing writes through the links)
    mkdir -p "$W/results-fp8"
    for d in datasets regenerated tokenized merged; do
        [ -e "$W/results/$d" ] && ln -sfn "$W/results/$d" "$W/results-fp8/$d"
    done
    pfp8=0
    if [ -n "${NO_FP8:-}" ]; then
        note "fp8 not run (NO_FP8)"
    elif "${SMK[@]}" --nolock -n "${DATA[@]/#/$W/results-fp8/}" --configfile "$W/config-fp8.yaml" \
        > "$W/smk-fp8-plan.log" 2>&1 && ! grep -qE '^(prepare|regenerate|tokenize|merge) +[0-9]' "$W/smk-fp8-plan.log"; then
        setsid "${SMK[@]}" --nolock "${DATA[@]/#/$W/results-fp8/}" --configfile "$W/config-fp8.yaml" > "$W/smk-fp8.log" 2>&1 &
        pfp8=$!
    else
        note "fp8 skipped: its dry run plans more than extraction ($W/smk-fp8-plan.log)"
    fi
    ln -sfn "$W/target" "$W/results/target"
    pids=()
    if [ -z "${NO_DFLASH:-}" ]; then
        setsid "${SMK[@]}" --nolock "$W/results/drafter/dflash" --configfile "$W/config-dflash.yaml" > "$W/smk-dflash.log" 2>&1 &
        pids+=("$!")
        pids+=("$(eval_when_ready dflash "$W/results/drafter/dflash" "$W/results/drafter/dflash/eval.json")")
    fi
    for lr in ${LRS:-${LR:-0.0001}}; do
        for trainer in ${TRAINERS-ours speculators}; do  # TRAINERS="" trains neither (DFlash only)
            setsid python3 bench/quality_compare.py --results "$W/results" --config "$W/config-eagle3.yaml" --work "$W/qc" \
                --trainers "$trainer" --train-only --device "${DEVICE:-cuda}" --threads 2 --spec-kernels eager \
                --set "train.learning_rate=$lr" --label "lr$lr" --output "$W/qc.jsonl" > "$W/qc-$trainer-$lr.log" 2>&1 &
            pids+=("$!")
            tag="$trainer-lr$lr-s0"
            [ "$trainer" = speculators ] && tag="speculators-own-lr$lr-s0"
            pids+=("$(eval_when_ready "$trainer-lr$lr" "$W/qc/$tag/drafter" "$W/qc/$tag/train_info.json")")
        done
    done
    if [ "$pfp8" != 0 ]; then
      pids+=("$pfp8")
      (  # fp8: our EAGLE-3 at the first of LRS on the fp8 store, simulated τ
        while kill -0 "$pfp8" 2>/dev/null; do sleep 3; done
        [ -e "$W/results-fp8/hidden_states/data_config.json" ] || exit 1
        ln -sfn "$W/target" "$W/results-fp8/target"
        lr=${LRS:-${LR:-0.0001}}
        lr=${lr%% *}
        python3 bench/quality_compare.py --results "$W/results-fp8" --config "$W/config-fp8.yaml" --work "$W/qc-fp8" \
            --trainers ours --sim-only --device "${DEVICE:-cuda}" --threads 2 --set "train.learning_rate=$lr" --label "fp8-lr$lr" \
            --output "$W/qc.jsonl" > "$W/qc-fp8.log" 2>&1
      ) &
      pids+=("$!")
    fi
    wait_all "${pids[@]}"
    note "done"
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
