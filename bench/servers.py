"""HTTP systems under test: genscore and llama.cpp's llama-server as subprocesses on 127.0.0.1, and their request calls."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import orjson

from bench.loop import peak_rss_mb


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Server:
    """A started server process: where it listens, how long it took to become ready, its log."""

    process: subprocess.Popen
    base_url: str
    ready_s: float
    log_path: Path

    def peak_rss_mb(self) -> float:
        return peak_rss_mb(self.process.pid)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def _start(cmd: list[str], ready_path: str, log_path: Path, port: int, timeout_s: float, env=None) -> Server:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    log = log_path.open("w")
    process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(base_url + ready_path, timeout=2).status_code == 200:
                return Server(process, base_url, time.perf_counter() - started, log_path)
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"{cmd[0]} did not become ready; see {log_path}")
        time.sleep(0.05)


def start_genscore(model: str, dtype: str, cache_dir: Path, log_path: Path, timeout_s: float = 300,
                   batch_invariant: bool = False) -> Server:
    port = free_port()
    cmd = [sys.executable, "-m", "app.cli", "serve", "--model", model, "--dtype", dtype, "--cache-dir", str(cache_dir),
           "--host", "127.0.0.1", "--port", str(port), "--log-level", "info"]
    if batch_invariant:
        cmd.append("--batch-invariant")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return _start(cmd, "/ready", log_path, port, timeout_s, env)


def genscore_load_seconds(log_path: Path) -> float | None:
    """The model load time genscore logged ("loaded ... in X s")."""
    found = re.search(r"loaded .* in ([\d.]+) s", log_path.read_text())
    return float(found.group(1)) if found else None


def find_llama_server(explicit: str | None, repo_root: Path) -> str | None:
    """An explicit path, else the one `make bench-peers` built, else llama-server on PATH."""
    if explicit:
        return explicit
    built = repo_root / ".cache" / "bench" / "bin" / "llama-server"
    if built.is_file():
        return str(built)
    return shutil.which("llama-server")


def start_llama(binary: str, gguf: Path, slots: int, ctx_per_slot: int, threads: int, log_path: Path,
                timeout_s: float = 120) -> Server:
    port = free_port()
    cmd = [binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
           "-tb", str(threads), "-np", str(slots), "-c", str(slots * ctx_per_slot)]
    return _start(cmd, "/health", log_path, port, timeout_s)


class GenscoreClient:
    """POST /score with token ids; returns label logprobs per scored prompt."""

    def __init__(self, base_url: str, concurrency: int):
        self._client = httpx.AsyncClient(base_url=base_url, timeout=600,
                                         limits=httpx.Limits(max_connections=concurrency + 2))

    async def __call__(self, request) -> list[list[float | None]]:
        response = await self._client.post("/score", content=orjson.dumps(request.score_body()),
                                           headers={"content-type": "application/json"})
        response.raise_for_status()
        return [row["label_logprobs"] for row in orjson.loads(response.content)["data"]]

    async def aclose(self) -> None:
        await self._client.aclose()


class LlamaClient:
    """POST /completion once per prompt (a request's items fan out concurrently), prompt cache off.

    llama-server returns the top `n_probs` logprobs of the next token; a label outside them
    cannot be scored and comes back as None.
    """

    def __init__(self, base_url: str, concurrency: int, top_k: int):
        self._client = httpx.AsyncClient(base_url=base_url, timeout=600,
                                         limits=httpx.Limits(max_connections=concurrency * 8 + 2))
        self._top_k = top_k

    async def _one(self, prompt: list[int], labels: list[int]) -> list[float | None]:
        body = {"prompt": prompt, "n_predict": 1, "n_probs": self._top_k, "cache_prompt": False,
                "temperature": 0.0, "post_sampling_probs": False}
        response = await self._client.post("/completion", content=orjson.dumps(body),
                                           headers={"content-type": "application/json"})
        response.raise_for_status()
        first = orjson.loads(response.content)["completion_probabilities"][0]
        top = {entry["id"]: entry["logprob"] for entry in first["top_logprobs"]}
        return [top.get(label) for label in labels]

    async def __call__(self, request) -> list[list[float | None]]:
        return list(await asyncio.gather(*(self._one(p, request.labels) for p in request.prompts)))

    async def aclose(self) -> None:
        await self._client.aclose()
