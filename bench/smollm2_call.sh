#!/usr/bin/env bash
# The workflow on SmolLM2-135M-Instruct and real chat data (issue 32), as device calls on the H200
# that follow each other on one warm machine (bench/README.md, "SmolLM2"). Run from the repo root,
# with .dev-smol/ holding the wheels (whl/), the GGUF in three pieces (p00/ p01/ p02/) and the
# data files (data/); each call carries some of them.
#
#   stash  install the carried wheels into /tmp/site, keep carried GGUF pieces and data in /tmp/smol
#   data   stash, join the GGUF (sha256 checked), convert it (draftflow real-model --gguf), then the
#          workflow's data stages: regenerate (the target answers ShareGPT prompts), tokenize, merge,
#          extract, vocab; the target's held-out perplexity. Returns the regenerated conversations.
#          REGENERATED=FILE: train on conversations an earlier call regenerated (no regenerate stage).
#   train  on the warm machine's data: our EAGLE-3 and speculators 0.9's at seeds SEEDS (one process
#          each, side by side), and the workflow's DFlash. TRAINERS picks among them (default
#          "ours speculators dflash"; NO_SPECULATORS=1 drops speculators; TRAINERS=none trains only the
#          variants below); DFLASH_VARIANTS="l5-dpace …"
#          also trains those DFlash recipes (bench/smollm2.py DFLASH_VARIANTS) at the first seed, all at
#          once (on an 80 GB card at most one 5-layer DFlash, ~31 GiB, beside two 1-layer ones, ~8 GiB;
#          DFLASH_EPOCHS=N: those variants at N epochs, not the config's), and
#          EAGLE3_VARIANTS="norms arch …" those EAGLE-3 recipes (bench/smollm2.py EAGLE3_VARIANTS: ours
#          with speculators' norms, speculators without them, …), evaluated as <trainer>-<variant>-s<seed>;
#          SPEC_SEEDS (default SEEDS): speculators' seeds, where a session trains others than ours';
#          VARIANT_SEEDS (default: the first of SEEDS): the seeds of ours' EAGLE3_VARIANTS; a variant
#          written name@seed trains at that seed only (EAGLE3_VARIANTS="norms@1 norms@2 head25@0")
#   eval   every drafter `draftflow evaluate`d on the GPU: real τ at K 3/5/7, T 0 and 1, on MT-bench
#          (both turns), GSM8K and HumanEval; simulated τ; prompt lookup. At most JOBS at a time.
#   all    data (skipped when RESUME=1 finds it done), train, and evaluate each drafter as soon as it
#          is trained (JOBS_TRAINING at a time while training runs, then JOBS). Call it again with
#          RESUME=1 after a call ran out of time: trained drafters and finished evaluations are kept,
#          a killed training resumes from its last checkpoint (ours every train.save_every_steps,
#          speculators every tenth of an epoch), a killed evaluation starts again.
#
# STORAGE=fp8 (or fp8_aux): the hidden states stored as fp8 (extract.storage), not lossless; a word without spaces, so
# that one run of bench/smollm2_pair.sh can take it in PAIR_A / PAIR_B where OVERRIDES (shared) cannot.
# EVAL_ONLY="<label> …": evaluate only those drafters. A RESUME=1 call otherwise evaluates every drafter
# trained in the work folder on its SETS and TEMPS, also those an earlier call trained for another item
# (session 20: two ours' GSM8K jobs took the GPU from a DFlash training beside them, 1.6 steps/s, not ~3).
# Everything is killed at DEADLINE seconds (default 540); what finished is in $OUT/figures.json.
# MPS=1: the call's processes share the GPU through an MPS daemon of its own (see below; not yet run).
# RETURN_DRAFTER=<label> (e.g. ours-s0): that drafter also comes back, as drafter-<label>.tar.part.NN
# (~47 MB: one a call); mode `return` only collects. A later session carries the pieces in
# (.dev-smol/drafters/, by `stash`) and evaluates them without retraining (imported before evalqueue).
# SPEC_KERNELS=own: speculators trains with its own kernels (compiled forward, flex attention, fused
# Triton loss; compiled on the first step, through bench/speculators_gpu_train.py) instead of eager
# ones; `compiled` keeps all but the fused loss (its eager one).
# On the CPU (a smoke test): SKIP_INSTALL=1 DEVICE=cpu TINY=1 W=/tmp/smolcpu OUT=/tmp/smolcpu-out.
set -u -o pipefail
mode="$1"
T0=$(date +%s)
DEADLINE=${DEADLINE:-540}
W=${W:-/tmp/smolrun}
S=${S:-/tmp/smol}
DEVICE=${DEVICE:-cuda}
SEEDS=${SEEDS:-0 1 2}
SPEC_SEEDS=${SPEC_SEEDS:-$SEEDS}  # speculators' own seeds, where a session trains other seeds of it than of ours
LABEL=${LABEL:-ep4}
TRAINERS=${TRAINERS:-ours speculators dflash}
[ -n "${NO_SPECULATORS:-}" ] && TRAINERS=${TRAINERS//speculators/}
trains() { [[ " $TRAINERS " == *" $1 "* ]]; }
GGUF_SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
mkdir -p "$S" "$OUT"
elapsed() { echo $(($(date +%s) - T0)); }
note() { echo "[smollm2 $mode $(elapsed)s] $*" | tee -a "$OUT/calllog.txt" >&2; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TQDM_DISABLE=1 OMP_WAIT_POLICY=PASSIVE
# every process this run starts inherits SMOLLM2_RUN; kill_run ends those and no other run's (a pair's)
export SMOLLM2_RUN="$W"
kill_run() {  # PATTERN: kill this run's processes whose command line matches it
    local pid
    for pid in $(pgrep -f "$1"); do
        tr '\0' '\n' < "/proc/$pid/environ" 2>/dev/null | grep -qxF "SMOLLM2_RUN=$W" && kill "$pid" 2>/dev/null
    done
    return 0
}
[ "$DEVICE" = cuda ] && export CUDA_VISIBLE_DEVICES=0
# MPS=1 (not yet run on the H200): one MPS control daemon of this call's own, so that the side-by-side
# processes' small kernels share the GPU instead of time-slicing it (the batch-1 evaluations, 2026-12-05);
# a user-level service in /tmp, quit when the call ends; the card's settings (compute mode) are untouched
if [ -n "${MPS:-}" ] && [ "$DEVICE" = cuda ]; then
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/draftflow-mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/draftflow-mps/log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    nvidia-cuda-mps-control -d && trap 'echo quit | nvidia-cuda-mps-control' EXIT
fi
SMK=(python3 -m snakemake --cores ${CORES:-16} --resources gpu=1 --scheduler greedy --rerun-incomplete)

stash() {
    if [ -d .dev-smol/whl ] && [ -z "${SKIP_INSTALL:-}" ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .dev-smol/whl/*.whl || exit 1
        note "wheels installed"
    fi
    for piece in .dev-smol/p*/gguf.part.*; do [ -e "$piece" ] && cp "$piece" "$S/"; done
    # .dev-smol/data and any .dev-smol/data-* (e.g. data-sharegpt: the whole shipped ShareGPT, 27 MB
    # gzipped, carried in a call of its own) land together in $S/data
    for d in .dev-smol/data .dev-smol/data-*; do [ -d "$d" ] && mkdir -p "$S/data" && cp -r "$d"/. "$S/data/"; done
    if [ -d .dev-smol/drafters ]; then  # one folder per drafter (carry .dev-smol/drafters/<label>: ~47 MB each)
        mkdir -p "$S/drafters" && find .dev-smol/drafters -name 'drafter-*.tar.part.*' -exec cp {} "$S/drafters/" \;
    fi
    note "in $S: $(ls "$S" | tr '\n' ' ')"
}

collect() {
    python3 bench/smollm2.py collect --work "$W" --out "$OUT" || note "collect failed"
    # the logs' tails in one file: a call returns at most 8 files
    # inside a folder of its own, `logs/`: an archive of `.` would carry mktemp's mode 700 onto whatever
    # folder it is unpacked in (unpacked into /tmp as root, it locked apt's sandbox user out of /tmp)
    local tails; tails=$(mktemp -d)/logs && mkdir -p "$tails"
    for f in "$W"/logs-*.txt "$W"/qc-*.log "$W"/eval-*.log; do [ -e "$f" ] && tail -c 20000 "$f" > "$tails/$(basename "$f")"; done
    # each trainer's own log (speculators: its steps and epochs so far, for a call killed mid-training)
    for f in "$W"/qc/*/train.log; do [ -e "$f" ] && tail -c 8000 "$f" > "$tails/train-$(basename "$(dirname "$f")").log"; done
    # each extract job's own log (its tokens/s and where its minutes went: ~24k tokens/s on the H100)
    for f in "$W"/results/logs/extract/*/*.log; do
        [ -e "$f" ] && tail -c 4000 "$f" > "$tails/extract-$(basename "$(dirname "$f")")-$(basename "$f")"
    done
    tar -czf "$OUT/logs.tar.gz" -C "$(dirname "$tails")" logs && rm -rf "$(dirname "$tails")"
    # RETURN_DRAFTER=<label>: that trained drafter comes back too, in 15 MiB pieces (a returned file's
    # limit is 16 MiB; join with cat): for CPU work on a GPU-trained drafter
    for label in ${RETURN_DRAFTER:-}; do
        python3 bench/smollm2.py pack-drafter --work "$W" --label "$label" --out "$OUT" || note "no drafter $label to return"
    done
    ls -la "$OUT" >&2
}

wait_all() {  # wait for the given pids, killing them at the deadline
    while :; do
        alive=0
        for p in "$@"; do kill -0 "$p" 2>/dev/null && alive=1; done
        [ $alive = 0 ] && return 0
        if [ "$(elapsed)" -ge "$DEADLINE" ]; then
            note "deadline: killing what still runs"
            for p in "$@"; do kill -- -"$p" 2>/dev/null || kill "$p" 2>/dev/null; done
            kill_run 'draftflow\.cli|-m snakemake|speculators\.train|bench/quality_compare|bench/real_target'
            sleep 2
            return 1
        fi
        sleep 3
    done
}

evalqueue() {  # every trained drafter evaluated (bench/smollm2.py evalqueue) until all are done or the deadline
    [ -d "$S/drafters" ] && python3 bench/smollm2.py import-drafters --work "$W" --source "$S/drafters"
    # few jobs at a time: processes side by side time-slice the GPU (2026-12-05, H100: 12 evaluations at
    # once, ~156 ms a batched reference step each), so more at once finish no sooner and lose more at the deadline
    python3 bench/smollm2.py evalqueue --work "$W" --seconds $((DEADLINE - $(elapsed) - 5)) --jobs ${JOBS:-4} \
        --jobs-training ${JOBS_TRAINING:-2} --training-flag "$W/training.flag" --device "$DEVICE" \
        ${SETS:+--sets $SETS} ${TEMPS:+--temps $TEMPS} ${PROMPT_LOOKUP_WITH:+--prompt-lookup-with "$PROMPT_LOOKUP_WITH"} \
        ${EVAL_ONLY:+--only $EVAL_ONLY} > "$W/logs-evalqueue.txt" 2>&1
}

qc() {  # TRAINER SEED [LABEL [ARGS…]]: one trainer at one seed, its own process group
    local trainer=$1 seed=$2 label=${3:-$LABEL}
    shift 2; shift $(($# > 0 ? 1 : 0))
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True setsid python3 bench/quality_compare.py --results "$W/results" --config "$W/config.yaml" --work "$W/qc" \
        --trainers "$trainer" --seeds "$seed" --train-only --device "$DEVICE" --threads 2 --spec-kernels ${SPEC_KERNELS:-eager} \
        --label "$label" --set train.num_workers=2 --set train.save_every_steps=40 --resume ${QC_SETS:-} "$@" \
        --output "$W/qc.jsonl" > "$W/qc-$trainer-$label-$seed.log" 2>&1 &
    echo $!
}

if [ "$mode" = stash ]; then
    stash
fi
if [ "$mode" = return ]; then
    collect
fi
data_done() { [ -e "$W/results/hidden_states/data_config.json" ] && [ -e "$W/results/vocab/draft_vocab.safetensors" ]; }
if [ "$mode" = all ] && [ -n "${RESUME:-}" ] && data_done; then
    note "data stages done in an earlier call"
elif [ "$mode" = data ] || [ "$mode" = datatrain ] || [ "$mode" = all ]; then
    stash
    [ -n "${RESUME:-}" ] || rm -rf "$W"  # RESUME=1: keep the last call's work (regenerate resumes its groups)
    mkdir -p "$W"
    cat "$S"/gguf.part.* > "$S/model.gguf"
    sha=$(sha256sum "$S/model.gguf" | cut -d' ' -f1)
    [ "$sha" = "$GGUF_SHA" ] || { note "GGUF sha256 $sha, expected $GGUF_SHA"; exit 1; }
    python3 -m draftflow.cli --threads "$(( ${CORES:-16} < 8 ? ${CORES:-16} : 8 ))" real-model --gguf "$S/model.gguf" --model-only --output "$W/real" \
        > "$W/logs-convert.txt" 2>&1 || { note "conversion failed"; tail -20 "$W/logs-convert.txt"; exit 1; }
    note "converted: $(tail -c 300 "$W/logs-convert.txt" | tr '\n' ' ')"
    python3 bench/smollm2.py configs --work "$W" --model "$W/real/smollm2-135m-instruct" --data "$S/data" \
        ${TINY:+--tiny} ${REGENERATED:+--regenerated "$REGENERATED"} ${OVERRIDES:-} \
        ${STORAGE:+--override "extract.storage=\"$STORAGE\""} || exit 1
    # Snakemake answers SIGTERM by waiting for its running jobs (2026-12-03: regenerate ran on past the
    # call's end), so its jobs get their own kill at the deadline
    timeout -k 10 $((${DATA_DEADLINE:-$DEADLINE} - $(elapsed) - 20)) "${SMK[@]}" --configfile="$W/config.yaml" \
        "$W/results/hidden_states/data_config.json" "$W/results/vocab/draft_vocab.safetensors" \
        > "$W/logs-data.txt" 2>&1 || { kill_run 'draftflow\.cli|bin/draftflow'; note "data stages failed or ran out of time";
                                      tail -40 "$W/logs-data.txt"; collect; exit 1; }
    note "data stages done"
    ln -sfn "$W/real/smollm2-135m-instruct" "$W/results/target"
    python3 bench/smollm2.py ppl --results "$W/results" > "$W/ppl.json" 2> "$W/logs-ppl.txt" && note "ppl $(cat "$W/ppl.json")"
    python3 - "$W" "$OUT" <<'EOF'
import gzip, json, pathlib, sys
from draftflow.jsonl import read_jsonl
w, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
with gzip.open(out / "regenerated.jsonl.gz", "wt") as f:
    for shard in sorted((w / "results/regenerated").rglob("shard-*.jsonl.zst")):
        for r in read_jsonl(shard):
            f.write(json.dumps({"id": r["id"], "messages": r["messages"]}) + "\n")
EOF
    collect
fi
if [ "$mode" = train ] || [ "$mode" = datatrain ] || [ "$mode" = all ]; then
    spec_variants=()  # EAGLE3_VARIANTS of speculators': checked before anything starts
    for variant in ${EAGLE3_VARIANTS:-}; do
        variant=${variant%@*}
        spec=$(python3 bench/smollm2.py eagle3-variant "$variant") || exit 1
        [ "${spec%% *}" = speculators ] && spec_variants+=("$variant")
    done
    if [ ${#spec_variants[@]} -gt 0 ] && ! trains speculators; then
        note "EAGLE3_VARIANTS=${spec_variants[*]} trains speculators: put speculators in TRAINERS (its first seed converts the store)"
        exit 1
    fi
    touch "$W/training.flag"
    if [ "$mode" = all ]; then
        evalqueue &
        queue=$!
    fi
    pids=()
    if trains dflash; then
        setsid "${SMK[@]}" --nolock --configfile="$W/config.yaml" "$W/results/drafter/dflash" \
            > "$W/logs-dflash.txt" 2>&1 &
        pids+=("$!")
    fi
    trains ours && for seed in $SEEDS; do pids+=("$(qc ours "$seed")"); done
    first=${SEEDS%% *}
    for variant in ${DFLASH_VARIANTS:-}; do
        pids+=("$(qc ours "$first" "$variant" --dflash "$(python3 bench/smollm2.py dflash-variant "$variant")" \
            ${DFLASH_EPOCHS:+--set train.epochs=$DFLASH_EPOCHS})")
    done
    # EAGLE3_VARIANTS (bench/smollm2.py EAGLE3_VARIANTS): the session's recipe plus a variant's arguments,
    # ours' at each of VARIANT_SEEDS (default: the first seed), started now; speculators' at the first of
    # SPEC_SEEDS, with its other seeds below
    # (`name@seed` trains that variant at that seed alone: EAGLE3_VARIANTS="norms@1 norms@2 head25@0")
    for variant in ${EAGLE3_VARIANTS:-}; do
        seeds=${VARIANT_SEEDS:-$first}
        [[ "$variant" == *@* ]] && seeds=${variant#*@} && variant=${variant%@*}
        read -r trainer args <<< "$(python3 bench/smollm2.py eagle3-variant "$variant")"
        [ "$trainer" = ours ] || continue
        for seed in $seeds; do pids+=("$(qc ours "$seed" "v-$variant" $args)"); done
    done
    spec_first=${SPEC_SEEDS%% *}
    trains speculators && pids+=("$(qc speculators "$spec_first")")
    # the other speculators seeds and variants once the first has converted the store (one copy on disk)
    # and ours have finished: seven trainers side by side ran speculators out of the card's memory (2026-12-05)
    ours_done() { trains ours || return 0; for seed in $SEEDS; do [ -e "$W/qc/ours-$LABEL-s$seed/train_info.json" ] || return 1; done; }
    ! trains speculators || (
        while [ ! -e "$W/qc/speculators_data/draftflow_export.json" ] || ! ours_done; do  # interop.SIDECAR: written last
            [ "$(elapsed)" -ge "$DEADLINE" ] && exit 1
            sleep 3
        done
        for seed in ${SPEC_SEEDS#"$spec_first"}; do qc speculators "$seed" > /dev/null; done
        for variant in "${spec_variants[@]}"; do
            read -r trainer args <<< "$(python3 bench/smollm2.py eagle3-variant "$variant")"
            qc speculators "$spec_first" "v-$variant" $args > /dev/null
        done
        wait
    ) &
    pids+=("$!")
    wait_all "${pids[@]}"
    rm -f "$W/training.flag"
    note "trained: $(ls -d "$W"/qc/*/drafter "$W/results/drafter/dflash" 2>/dev/null | tr '\n' ' ')"
    if [ "$mode" = all ]; then
        wait "$queue"
        note "evaluated: $(ls "$W"/evals/*/*/acceptance.json 2>/dev/null | wc -l)"
    fi
    collect
fi
if [ "$mode" = eval ]; then
    rm -f "$W/training.flag"  # a call cut while training may have left it
    evalqueue
    note "evaluated: $(ls "$W"/evals/*/*/acceptance.json 2>/dev/null | wc -l)"
    collect
fi
