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

from bench.before import BeforeTree
from bench.loop import peak_rss_mb
from bench.procmem import tree_memory_mb


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

    def memory(self) -> dict:
        return tree_memory_mb(self.process.pid)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def wait_ready(process: subprocess.Popen, url: str, timeout_s: float, name: str, log_path: Path) -> None:
    """Poll url until it answers 200; RuntimeError when the process exits or the time runs out."""
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code == 200:
                return
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{name} did not become ready; see {log_path}")
        time.sleep(0.05)


def _start(cmd: list[str], ready_path: str, log_path: Path, port: int, timeout_s: float, env=None,
           cwd: Path | None = None) -> Server:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    log = log_path.open("w")
    process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd)
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(process, base_url + ready_path, timeout_s, cmd[0], log_path)
    except RuntimeError:
        process.kill()
        raise
    return Server(process, base_url, time.perf_counter() - started, log_path)


def start_genscore(model: str, dtype: str, cache_dir: Path, log_path: Path, timeout_s: float = 300,
                   batch_invariant: bool = False, extra_args: tuple[str, ...] = (),
                   before: BeforeTree | None = None) -> Server:
    """`python -m app.cli serve`; with `before`, the older code of that worktree (bench/before.py)."""
    port = free_port()
    args = ["serve", "--model", model, "--dtype", dtype, "--cache-dir", str(Path(cache_dir).resolve()),
            "--host", "127.0.0.1", "--port", str(port), "--log-level", "info", *extra_args]
    if batch_invariant:
        args.append("--batch-invariant")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    if before is None:
        return _start([sys.executable, "-m", "app.cli", *args], "/ready", log_path, port, timeout_s, env)
    return _start(before.command("app.cli", *args), "/ready", log_path, port, timeout_s, before.env(env),
                  cwd=before.path)


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


async def prometheus_counters(client: httpx.AsyncClient, names: dict[str, str]) -> dict[str, float]:
    """{key: value summed over labels} of the /metrics samples named in `names` (key -> sample name)."""
    text = (await client.get("/metrics")).text
    out = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        sample = line.split("{", 1)[0].split(" ", 1)[0]
        for key, name in names.items():
            if sample == name:
                out[key] += float(line.rsplit(" ", 1)[1])
    return out


class GenscoreClient:
    """POST /score with token ids; returns label logprobs per scored prompt."""

    def __init__(self, base_url: str, concurrency: int):
        self._client = httpx.AsyncClient(base_url=base_url, timeout=600,
                                         limits=httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2))

    async def __call__(self, request) -> list[list[float | None]]:
        response = await self._client.post("/score", content=orjson.dumps(request.score_body()),
                                           headers={"content-type": "application/json"})
        response.raise_for_status()
        return [row["label_logprobs"] for row in orjson.loads(response.content)["data"]]

    async def counters(self) -> dict[str, float]:
        """Shared-prefix cache lookups that hit / missed (one lookup per query per batch)."""
        return await prometheus_counters(self._client, {"prefix_hits": "genscore_prefix_cache_hits_total",
                                                        "prefix_misses": "genscore_prefix_cache_misses_total"})

    async def aclose(self) -> None:
        await self._client.aclose()


class LlamaClient:
    """POST /completion once per prompt (a request's items fan out concurrently), prompt cache off.

    llama-server returns the top `n_probs` logprobs of the next token; a label outside them
    cannot be scored and comes back as None.
    """

    def __init__(self, base_url: str, concurrency: int, top_k: int):
        self._client = httpx.AsyncClient(base_url=base_url, timeout=600,
                                         limits=httpx.Limits(max_connections=concurrency * 8 + 2, max_keepalive_connections=concurrency * 8 + 2))
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
