#!/usr/bin/env bash
# One vLLM CPU server for benchmarks/vllm/truth.sh, as a command `fuzz --launch` can start and restart:
#
#   SCHEDULER_CLS=LifoAdmission bash benchmarks/vllm/serve.sh PORT
#
# The real vLLM V1 engine on 127.0.0.1:PORT with the tiny random-weight Llama of
# tests/vllm_cpu/make_model.py (MODEL); SCHEDULER_CLS names a planted scheduler of
# tests/vllm_cpu/planted.py (empty: stock). Once the server answers, its engine core and worker
# are pinned to SERVER_CPUS (taskset's list; "all": no pinning), the API server left free
# (tests/vllm_cpu/conftest.py says why). The planted class comes from the environment, so
# stock and planted servers are one launch command: a calibration stored for it is theirs.
#
# Environment: VPY (the vLLM venv's python), MODEL (the model folder), SERVER_CPUS.
set -euo pipefail
PORT="${1:?usage: serve.sh PORT}"
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
extra=()
[ -n "${SCHEDULER_CLS:-}" ] && extra=(--scheduler-cls "planted.$SCHEDULER_CLS")
PYTHONPATH="$ROOT/tests/vllm_cpu" HF_HUB_OFFLINE=1 "${VPY:?}" -m vllm.entrypoints.openai.api_server \
    --model "${MODEL:?}" --served-model-name tiny-llama --host 127.0.0.1 --port "$PORT" \
    --dtype bfloat16 --enforce-eager --kv-cache-memory-bytes 64M --max-model-len 8192 "${extra[@]}" &
api=$!
until curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; do
    kill -0 "$api" 2>/dev/null || { wait "$api"; exit $?; }
    sleep 1
done
if [ "${SERVER_CPUS:-all}" != all ]; then  # every process of this group but the API server and this script
    for pid in $(pgrep -g "$(ps -o pgid= $$ | tr -d ' ')"); do
        [ "$pid" = "$api" ] || [ "$pid" = "$$" ] || taskset -a -p -c "$SERVER_CPUS" "$pid" >/dev/null 2>&1 || true
    done
fi
echo "serve.sh: ready"  # truth.sh's start_server waits for this line
wait "$api"
