#!/usr/bin/env bash
# Build llama.cpp's llama-server (CPU, native flags) from the llama-cpp-python source distribution's
# vendored llama.cpp, for `make bench-peers`. Everything lands under .cache/bench (git-ignored);
# no llama.cpp code enters the repository. Re-running with the binary present does nothing.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
CACHE="${BENCH_CACHE:-$ROOT/.cache/bench}"
PIP="${PIP:-$ROOT/.venv/bin/pip}"
VERSION="${LLAMA_CPP_PYTHON_VERSION:-}"  # empty: the newest release on PyPI
JOBS="${JOBS:-$(nproc)}"
BIN="$CACHE/bin/llama-server"

if [[ -x "$BIN" ]]; then
    echo "llama-server already built: $BIN"
    exit 0
fi
mkdir -p "$CACHE/sdist" "$CACHE/bin"
spec="llama-cpp-python${VERSION:+==$VERSION}"
"$PIP" download --quiet --no-deps --no-binary :all: --dest "$CACHE/sdist" "$spec"
archive="$(ls -t "$CACHE"/sdist/llama_cpp_python-*.tar.gz | head -1)"
src="$CACHE/src/$(basename "$archive" .tar.gz)"
if [[ ! -d "$src" ]]; then
    mkdir -p "$CACHE/src"
    tar -xzf "$archive" -C "$CACHE/src"
fi
llama="$src/vendor/llama.cpp"
[[ -f "$llama/CMakeLists.txt" ]] || { echo "no vendored llama.cpp in $archive" >&2; exit 1; }

generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
# GGML_NATIVE: -march=native, so the build uses this CPU's AVX-512 / AVX512-BF16 like torch does.
cmake -S "$llama" -B "$CACHE/build" "${generator[@]}" \
    -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DGGML_CUDA=OFF >"$CACHE/cmake.log"
cmake --build "$CACHE/build" --target llama-server -j "$JOBS"
cp "$CACHE/build/bin/llama-server" "$BIN"
echo "built $BIN from $(basename "$archive")"
