#!/usr/bin/env bash
# Launch a vLLM server with the flags a draftflow stage needs; refuse if the GPUs are taken.
#
#   scripts/launch_vllm.sh regenerate MODEL_DIR [options] [-- extra `vllm serve` args]
#       plain OpenAI-compatible serving for `regenerate` with engine openai
#       (config: regenerate.openai.endpoints: [http://HOST:PORT/v1], model: NAME)
#   scripts/launch_vllm.sh extract MODEL_DIR --version V [--aux 2,30,58] [options] [-- extra args]
#       a hidden-states server: `extract_hidden_states` with ExampleHiddenStatesConnector
#       writing <capture-dir>/<request>.safetensors, prefix caching and chunked prefill off.
#       draftflow's own `extract` with engine vllm runs vLLM in-process with the same
#       settings and does not need this server; use it to inspect captures by hand or to
#       feed other tools (ids: output of layer i = vLLM id i + 1; id N = last layer, pre-norm)
#
# Options:
#   --port P            (8000)         --host H   (127.0.0.1)
#   --tp N              tensor parallel size (1)
#   --name NAME         served model name (the folder name); regenerate.openai.model must match
#   --aux IDS           extract: comma-separated aux layer ids, our convention (default [1, N//2-1, N-4])
#   --version V         extract: the vLLM release serving (layer-id rules differ per version)
#   --capture-dir D     extract: the connector's folder (/dev/shm/draftflow-vllm-capture)
#   --max-len N         extract: max_model_len = max_num_batched_tokens (16384; >= merge.max_seq_len),
#                       as vLLM needs both equal or the batch larger without chunked prefill
#   --dry-run           print the command instead of running it
# Environment: PYTHON (python3), CUDA_VISIBLE_DEVICES (the GPUs checked and used).
#
# Before starting, `python -m draftflow.engines.servers check-gpus` must pass.
set -euo pipefail

usage() { sed -n '2,26p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-2}"; }
[[ $# -ge 2 ]] || usage
MODE=$1 MODEL=$2
shift 2
[[ $MODE == regenerate || $MODE == extract ]] || { echo "launch_vllm.sh: mode must be regenerate or extract, not '$MODE'" >&2; exit 2; }
[[ -f $MODEL/config.json ]] || { echo "launch_vllm.sh: $MODEL is not a model folder (no config.json)" >&2; exit 2; }

PYTHON=${PYTHON:-python3}
PORT=8000 HOST=127.0.0.1 TP=1 NAME=$(basename "$MODEL") AUX="" VERSION="" CAPTURE_DIR=/dev/shm/draftflow-vllm-capture MAX_LEN=16384 DRY=0
EXTRA=()
while [[ $# -gt 0 ]]; do
    case $1 in
        --port) PORT=$2; shift 2 ;;
        --host) HOST=$2; shift 2 ;;
        --tp) TP=$2; shift 2 ;;
        --name) NAME=$2; shift 2 ;;
        --aux) AUX=$2; shift 2 ;;
        --version) VERSION=$2; shift 2 ;;
        --capture-dir) CAPTURE_DIR=$2; shift 2 ;;
        --max-len) MAX_LEN=$2; shift 2 ;;
        --dry-run) DRY=1; shift ;;
        --) shift; EXTRA=("$@"); break ;;
        -h|--help) usage 0 ;;
        *) echo "launch_vllm.sh: unknown option $1" >&2; usage ;;
    esac
done

"$PYTHON" -m draftflow.engines.servers check-gpus >&2 || { echo "launch_vllm.sh: refusing to start: GPUs are held by other processes" >&2; exit 1; }

CMD=("$PYTHON" -m vllm.entrypoints.cli.main serve "$MODEL" --served-model-name "$NAME"
     --host "$HOST" --port "$PORT" --tensor-parallel-size "$TP")
if [[ $MODE == extract ]]; then
    [[ -n $VERSION ]] || { echo "launch_vllm.sh: extract needs --version (the vLLM release serving)" >&2; exit 2; }
    AUX_ARGS=()
    [[ -n $AUX ]] && AUX_ARGS=(--aux "$AUX")
    mapfile -t CONFIGS < <("$PYTHON" -m draftflow.engines.vllm_capture server-configs --target "$MODEL" \
        "${AUX_ARGS[@]}" --version "$VERSION" --capture-dir "$CAPTURE_DIR")
    [[ ${#CONFIGS[@]} -eq 2 ]] || exit 1
    [[ $DRY == 1 ]] || mkdir -p "$CAPTURE_DIR"
    CMD+=(--no-enable-prefix-caching --no-enable-chunked-prefill
          --max-model-len "$MAX_LEN" --max-num-batched-tokens "$MAX_LEN"
          --speculative-config "${CONFIGS[0]}" --kv-transfer-config "${CONFIGS[1]}")
fi
CMD+=("${EXTRA[@]}")

if [[ $DRY == 1 ]]; then
    printf '%q ' "${CMD[@]}"; echo
    exit 0
fi
echo "launch_vllm.sh: $MODE server for $MODEL on $HOST:$PORT (tp $TP)" >&2
exec "${CMD[@]}"
