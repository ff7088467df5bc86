#!/usr/bin/env bash
# Seconds from launching a finished run's EAGLE-3 export (its own launch.sh, vLLM's CPU build)
# to a server that answers /health, then one greedy completion; the server is stopped after.
# Usage: bench/vllm_launch_time.sh WORKDIR [label] [server arguments...]
#   WORKDIR: a finished workflow run (results/target, results/export/eagle3/vllm).
# Compare, side by side in one sitting (BENCHMARKS.md, "The test suite's minutes"):
#   bench/vllm_launch_time.sh /path/to/wf mp
#   VLLM_ENABLE_V1_MULTIPROCESSING=0 bench/vllm_launch_time.sh /path/to/wf uni --distributed-executor-backend uni
set -euo pipefail
workdir=$(cd "$1" && pwd); label=${2:-default}; shift $(( $# >= 2 ? 2 : 1 ))
repo=$(cd "$(dirname "$0")/.." && pwd)
port=$("$repo/.venv/bin/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
log=$(mktemp "/tmp/vllm-launch-$label.XXXX.log")
start=$(date +%s.%N)
VLLM_CPU_KVCACHE_SPACE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 PYTHON="$repo/.venv-vllm/bin/python" \
  bash "$workdir/results/export/eagle3/vllm/launch.sh" "$workdir/results/target" --host 127.0.0.1 --port "$port" \
  --dtype float32 --enforce-eager --max-model-len 2048 --kv-cache-memory-bytes 1073741824 "$@" > "$log" 2>&1 &
server=$!
trap 'kill "$server" 2>/dev/null; wait "$server" 2>/dev/null || true' EXIT
until curl -sf "http://127.0.0.1:$port/health" > /dev/null; do
  kill -0 "$server" 2>/dev/null || { echo "$label: the server exited; its log: $log" >&2; tail -5 "$log" >&2; exit 1; }
  sleep 0.5
done
ready=$(date +%s.%N)
curl -sf "http://127.0.0.1:$port/v1/completions" -H 'Content-Type: application/json' \
  -d "{\"model\": \"$workdir/results/target\", \"prompt\": \"hello\", \"max_tokens\": 16, \"temperature\": 0}" > /dev/null
echo "$label: ready after $(echo "$ready - $start" | bc) s (log: $log)"
