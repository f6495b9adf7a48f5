#!/usr/bin/env bash
# Truth figures on vLLM's CPU build (benchmarks/README.md, "Real server: vLLM (CPU build)").
#
#   bash benchmarks/vllm/truth.sh OUT_DIR [STEP...]
#
# Steps (default: all, in this order): calibrate, planted-replays, planted-campaigns,
# stock-campaign, stock-corpus; a step may be named again (a second calibrate before the
# stock campaign keeps every command within the hour a calibration is reused). Every server is the real vLLM V1 engine on 127.0.0.1 with the
# tiny random-weight Llama of tests/vllm_cpu/make_model.py; planted ones load a scheduler of
# tests/vllm_cpu/planted.py. One calibration (stock server, --repeats 1) is measured first and
# reused by every later command: replays share its database, each campaign starts from a copy
# of it (a second one, of the campaigns' launch command, benchmarks/vllm/serve.sh: campaigns
# launch their server, so one that dies is started again). So every server is judged by a calibration of the clean engine (the planted classes change only which request a step
# serves, not what a step costs). Logs, the database and JSON outputs go to OUT_DIR.
#
# Environment: VPY (the vLLM venv's python; default: .ci/vllm-server.sh's), FUZZ (default
# .venv/bin/fuzz), PORT (default 8101), CAMPAIGN_PLANTED (default 10m), CAMPAIGN_STOCK
# (default 20m), CORPUS_RUNS (default 10), SEED (the campaigns' --seed, default 1), PLANTED (the
# planted classes the planted steps run, default "HolLongestFirst LifoAdmission DecodeStarvation"),
# SERVER_CPUS (the CPUs the server's engine core and worker are pinned to once it is ready,
# taskset's list; default every CPU but the last, left to the fuzzer and the API server:
# tests/vllm_cpu/conftest.py says why; "all": no pinning).
set -euo pipefail
OUT="${1:?usage: truth.sh OUT_DIR [STEP...]}"
shift
STEPS=("${@:-calibrate planted-replays planted-campaigns stock-campaign stock-corpus}")
STEPS=(${STEPS[*]})
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
VPY="${VPY:-$(bash "$ROOT/.ci/vllm-server.sh" | tail -n1)}"
FUZZ="${FUZZ:-$ROOT/.venv/bin/fuzz}"
PORT="${PORT:-8101}"
URL="http://127.0.0.1:$PORT"
DB="$OUT/truth.db"
mkdir -p "$OUT"
MODEL="$OUT/tiny-llama"
[ -f "$MODEL/config.json" ] || "$VPY" "$ROOT/tests/vllm_cpu/make_model.py" "$MODEL" >/dev/null

NCPU="$(nproc)"
SERVER_CPUS="${SERVER_CPUS:-$([ "$NCPU" -gt 1 ] && echo "0-$((NCPU - 2))" || echo all)}"
# Every server is benchmarks/vllm/serve.sh's (the engine pinned to SERVER_CPUS once it answers). The campaigns
# launch theirs, so the fuzzer restarts it when it dies (vLLM 0.32's CPU engine dies on a seeded request whose
# prefill is chunked) and learns what crashed it.
export VPY MODEL SERVER_CPUS
LAUNCH="bash $ROOT/benchmarks/vllm/serve.sh {port}"
READY="serve.sh: ready"

SERVER_PGID=""
stop_server() {
    if [ -n "$SERVER_PGID" ]; then
        kill -TERM -- "-$SERVER_PGID" 2>/dev/null || true
        for _ in $(seq 1 30); do kill -0 -- "-$SERVER_PGID" 2>/dev/null || break; sleep 1; done
        kill -KILL -- "-$SERVER_PGID" 2>/dev/null || true
        SERVER_PGID=""
    fi
}
trap stop_server EXIT INT TERM

start_server() {  # start_server NAME [SCHEDULER_CLASS]
    local name="$1"
    SCHEDULER_CLS="${2:-}" setsid bash "$ROOT/benchmarks/vllm/serve.sh" "$PORT" >"$OUT/server-$name.log" 2>&1 &
    SERVER_PGID=$!
    for _ in $(seq 1 240); do  # serve.sh says it once the server answers and its engine is pinned
        if grep -q "^$READY" "$OUT/server-$name.log"; then echo "$(date -u +%T) server $name ready"; return 0; fi
        kill -0 "$SERVER_PGID" 2>/dev/null || { echo "server $name exited; see $OUT/server-$name.log"; exit 2; }
        sleep 1
    done
    echo "server $name not ready in 240 s"; exit 2
}

fuzz() { echo "$(date -u +%T) fuzz $*  (load $(cut -d' ' -f1-3 /proc/loadavg))" >&2; "$FUZZ" "$@"; }

for step in "${STEPS[@]}"; do
    case "$step" in
    calibrate)
        start_server stock
        fuzz calibrate --target "$URL" --server vllm --db "$DB" --repeats 1 --json >"$OUT/calibration-$(date -u +%H%M).json"
        stop_server
        # The campaigns' launch command (stock and planted alike: the class comes from SCHEDULER_CLS).
        SCHEDULER_CLS="" fuzz calibrate --launch "$LAUNCH" --server vllm --db "$DB" --repeats 1 --json \
            >"$OUT/calibration-launch-$(date -u +%H%M).json"
        sqlite3 "$DB" "PRAGMA wal_checkpoint(TRUNCATE);" >/dev/null 2>&1 || true
        cp "$DB" "$OUT/calibrated.db" ;;
    planted-replays)
        # The traces timed for this machine's speed (benchmarks/vllm/timed_traces.py), measured on the stock server.
        start_server stock
        "$(dirname "$FUZZ")/python" "$ROOT/benchmarks/vllm/timed_traces.py" "$URL" "$OUT"
        stop_server
        for pair in HolLongestFirst:hol LifoAdmission:lifo DecodeStarvation:starvation; do
            cls="${pair%%:*}" trace="${pair##*:}"
            for server in stock "$cls"; do
                start_server "$server" "$([ "$server" = stock ] || echo "$cls")"
                fuzz replay "$OUT/planted-$trace.json" --target "$URL" --server vllm --db "$DB" \
                    --runs 3 --json >"$OUT/replay-$trace-$server.json" || true
                stop_server
            done
        done ;;
    planted-campaigns)
        for cls in ${PLANTED:-HolLongestFirst LifoAdmission DecodeStarvation}; do
            cp "$OUT/calibrated.db" "$OUT/campaign-$cls.db"
            SCHEDULER_CLS="$cls" fuzz campaign --launch "$LAUNCH" --server vllm --db "$OUT/campaign-$cls.db" \
                --seed "${SEED:-1}" --duration "${CAMPAIGN_PLANTED:-10m}" >"$OUT/campaign-$cls.log" 2>&1 || true
        done ;;
    stock-campaign)
        cp "$OUT/calibrated.db" "$OUT/campaign-stock.db"
        SCHEDULER_CLS="" fuzz campaign --launch "$LAUNCH" --server vllm --db "$OUT/campaign-stock.db" \
            --seed "${SEED:-1}" --duration "${CAMPAIGN_STOCK:-20m}" >"$OUT/campaign-stock.log" 2>&1 || true ;;
    stock-corpus)
        start_server stock
        for trace in "$ROOT"/corpus/*.json; do
            fuzz replay "$trace" --target "$URL" --server vllm --db "$DB" --runs "${CORPUS_RUNS:-10}" --json \
                >"$OUT/corpus-$(basename "$trace" .json).json" || true
        done
        stop_server ;;
    *) echo "unknown step $step"; exit 2 ;;
    esac
done
echo "$(date -u +%T) done"
