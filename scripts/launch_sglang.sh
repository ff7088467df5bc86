#!/usr/bin/env bash
# Launch an SGLang server with the flags a draftflow stage needs; refuse if the GPUs are taken.
#
#   scripts/launch_sglang.sh regenerate MODEL_DIR [options] [-- extra sglang.launch_server args]
#       plain OpenAI-compatible serving for `regenerate` with engine openai
#       (config: regenerate.openai.endpoints: [http://HOST:PORT/v1], model: NAME)
#   scripts/launch_sglang.sh extract MODEL_DIR --aux 2,30,58 [options] [-- extra args]
#       a capture server for `extract` with engine sglang (config: extract.sglang.endpoint:
#       http://HOST:PORT): draftflow's forward hooks on the aux layers and the final norm,
#       radix (prefix) cache off and chunked prefill off, so every token of every sample runs
#       through every layer; CUDA graphs off (hooks only fire on eagerly run modules:
#       --cuda-graph-backend-{decode,prefill} disabled, or --disable-cuda-graph before SGLang 0.5.14)
#
# Options:
#   --port P            (30000)        --host H   (127.0.0.1)
#   --tp N              tensor parallel size (1)
#   --name NAME         served model name (the folder name); regenerate.openai.model must match
#   --aux IDS           extract: comma-separated aux layer ids, our convention (default [1, N//2-1, N-4])
#   --capture-dir D     extract: where the hooks write (/dev/shm/draftflow-sglang-capture)
#   --dry-run           print the command instead of running it
# Environment: PYTHON (python3), CUDA_VISIBLE_DEVICES (the GPUs checked and used).
#
# Before starting, `python -m draftflow.engines.servers check-gpus` must pass: a stray server
# holding the GPUs is refused here, not discovered after the model failed to load.
set -euo pipefail

usage() { sed -n '2,24p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-2}"; }
[[ $# -ge 2 ]] || usage
MODE=$1 MODEL=$2
shift 2
[[ $MODE == regenerate || $MODE == extract ]] || { echo "launch_sglang.sh: mode must be regenerate or extract, not '$MODE'" >&2; exit 2; }
[[ -f $MODEL/config.json ]] || { echo "launch_sglang.sh: $MODEL is not a model folder (no config.json)" >&2; exit 2; }

PYTHON=${PYTHON:-python3}
PORT=30000 HOST=127.0.0.1 TP=1 NAME=$(basename "$MODEL") AUX="" CAPTURE_DIR=/dev/shm/draftflow-sglang-capture DRY=0
EXTRA=()
while [[ $# -gt 0 ]]; do
    case $1 in
        --port) PORT=$2; shift 2 ;;
        --host) HOST=$2; shift 2 ;;
        --tp) TP=$2; shift 2 ;;
        --name) NAME=$2; shift 2 ;;
        --aux) AUX=$2; shift 2 ;;
        --capture-dir) CAPTURE_DIR=$2; shift 2 ;;
        --dry-run) DRY=1; shift ;;
        --) shift; EXTRA=("$@"); break ;;
        -h|--help) usage 0 ;;
        *) echo "launch_sglang.sh: unknown option $1" >&2; usage ;;
    esac
done

"$PYTHON" -m draftflow.engines.servers check-gpus >&2 || { echo "launch_sglang.sh: refusing to start: GPUs are held by other processes" >&2; exit 1; }

CMD=("$PYTHON" -m sglang.launch_server --model-path "$MODEL" --served-model-name "$NAME"
     --host "$HOST" --port "$PORT" --tp-size "$TP")
if [[ $MODE == extract ]]; then
    AUX_ARGS=()
    [[ -n $AUX ]] && AUX_ARGS=(--aux "$AUX")
    HOOKS=$("$PYTHON" -m draftflow.engines.sglang_capture hooks --target "$MODEL" "${AUX_ARGS[@]}" --capture-dir "$CAPTURE_DIR")
    [[ $DRY == 1 ]] || mkdir -p "$CAPTURE_DIR"
    # CUDA graphs off, spelled as the installed SGLang wants it (0.5.14 deprecated --disable-cuda-graph)
    GRAPH_OFF_LINES=$("$PYTHON" -m draftflow.engines.sglang_capture graph-flags)
    mapfile -t GRAPH_OFF <<< "$GRAPH_OFF_LINES"
    CMD+=(--disable-radix-cache --chunked-prefill-size -1 "${GRAPH_OFF[@]}" --forward-hooks "$HOOKS")
fi
CMD+=("${EXTRA[@]}")

if [[ $DRY == 1 ]]; then
    printf '%q ' "${CMD[@]}"; echo
    exit 0
fi
echo "launch_sglang.sh: $MODE server for $MODEL on $HOST:$PORT (tp $TP)" >&2
exec "${CMD[@]}"
