"""vLLM's CPU build as a peer: its venv (from `make bench-peers`), its OpenAI server as a subprocess, its /v1/completions scoring call."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import orjson

from bench.procmem import tree_memory_mb
from bench.servers import free_port, prometheus_counters, wait_ready

SERVED_NAME = "smollm2-peer"


def preload_libraries(python: str) -> str:
    """LD_PRELOAD as vLLM's CPU guide sets it: tcmalloc (Debian's libtcmalloc-minimal4) and the venv's Intel OpenMP."""
    found = [str(p) for p in sorted(Path("/usr/lib").glob("*/libtcmalloc_minimal.so.4"))[:1]]
    iomp = Path(python).parent.parent / "lib" / "libiomp5.so"
    if iomp.is_file():
        found.append(str(iomp))
    return ":".join(found)


def find_vllm_python(explicit: str | None, repo_root: Path) -> str | None:
    """An explicit interpreter, else the one of the venv `make bench-peers` made (None when absent)."""
    if explicit:
        return explicit
    built = repo_root / ".cache" / "bench" / "vllm-venv" / "bin" / "python"
    return str(built) if built.is_file() else None


@dataclass
class VllmServer:
    """A started vLLM OpenAI server (own process group: its engine core goes down with it)."""

    process: subprocess.Popen
    base_url: str
    ready_s: float
    log_path: Path
    compiled: bool = False  # whether this start compiled its graphs (else they came from VLLM_CACHE_ROOT)
    cache_load_failure: str | None = None  # why the graphs cached by an earlier start could not be loaded

    def memory(self) -> dict:
        return tree_memory_mb(self.process.pid)

    def stop(self) -> None:
        if self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def start_vllm(python: str, model_dir: Path, dtype: str, prefix_caching: bool, block_size: int | None,
               log_path: Path, cores: int, kv_cache_gib: int = 2, max_model_len: int = 2048,
               timeout_s: float = 900) -> VllmServer:
    """`python -m vllm.entrypoints.openai.api_server` on the HF directory (the wheel's `vllm` script is broken)."""
    port = free_port()
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype,
           "--max-model-len", str(max_model_len),
           "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching"]
    if block_size:
        cmd += ["--block-size", str(block_size)]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
               VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib), VLLM_CPU_OMP_THREADS_BIND=f"0-{cores - 1}",
               # /reset_prefix_cache is a dev-mode route; the bench empties the cache before each pass.
               VLLM_SERVER_DEV_MODE="1", TOKENIZERS_PARALLELISM="false")
    env.pop("PYTHONPATH", None)  # its venv only: nothing of genscore's on its path
    preload = preload_libraries(python)
    if preload:
        env["LD_PRELOAD"] = preload
    # Its compiled graphs are cached next to the bench's other caches: a first start compiles, later ones load.
    env.setdefault("VLLM_CACHE_ROOT", str(log_path.parent / "vllm-cache"))
    log_path.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with log_path.open("w") as log:
        # cwd away from the repository: `python -m` puts the working directory first on sys.path, and genscore's
        # top-level packages (app, models, ...) must not shadow anything vLLM imports.
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                   cwd=log_path.parent)
    server = VllmServer(process, f"http://127.0.0.1:{port}", 0.0, log_path)
    try:
        wait_ready(process, server.base_url + "/health", timeout_s, cmd[0], log_path)
    except BaseException:
        server.stop()
        raise
    server.ready_s = time.perf_counter() - started
    text = log_path.read_text(errors="replace")
    server.compiled = "saved AOT compiled function" in text
    failed = re.search(r"Compiling model again due to a load failure .*reason: (.*)", text)
    server.cache_load_failure = failed.group(1).strip() if failed else None
    return server


def vllm_version(python: str) -> str:
    out = subprocess.run([python, "-c", "import vllm, torch; print(vllm.__version__, torch.__version__)"],
                         capture_output=True, text=True, timeout=300)
    return out.stdout.strip() or out.stderr.strip()[-200:]


_TOKEN_ID = re.compile(r"token_id:(\d+)")


class VllmClient:
    """POST /v1/completions, one per request (a request's items as a list of token-id prompts), max_tokens 1.

    `logprob_token_ids` makes vLLM gather those ids' raw logprobs (its default logprobs mode), returned in
    `top_logprobs[0]` next to the sampled token; `return_tokens_as_token_ids` keys them "token_id:N", so two
    labels that decode alike cannot collide.
    """

    def __init__(self, base_url: str, concurrency: int, reset_cache: bool = False):
        self._client = httpx.AsyncClient(base_url=base_url, timeout=600,
                                         limits=httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2))
        self._reset_cache = reset_cache

    async def reset(self) -> None:
        """Empty the prefix cache, so that a pass sees its queries for the first time (as every other system does)."""
        if self._reset_cache:
            (await self._client.post("/reset_prefix_cache")).raise_for_status()

    async def counters(self) -> dict[str, float]:
        """Prompt tokens looked up in / found in the prefix cache."""
        return await prometheus_counters(self._client, {"prefix_query_tokens": "vllm:prefix_cache_queries_total",
                                                        "prefix_hit_tokens": "vllm:prefix_cache_hits_total"})

    async def __call__(self, request) -> list[list[float | None]]:
        prompts = request.prompts
        body = {"model": SERVED_NAME, "prompt": prompts[0] if len(prompts) == 1 else prompts, "max_tokens": 1,
                "temperature": 0.0, "logprobs": 0, "logprob_token_ids": request.labels,
                "return_tokens_as_token_ids": True}
        response = await self._client.post("/v1/completions", content=orjson.dumps(body),
                                           headers={"content-type": "application/json"})
        response.raise_for_status()
        choices = sorted(orjson.loads(response.content)["choices"], key=lambda c: c["index"])
        out = []
        for choice in choices:
            top = {int(_TOKEN_ID.fullmatch(key).group(1)): value
                   for key, value in choice["logprobs"]["top_logprobs"][0].items()}
            out.append([top.get(label) for label in request.labels])
        return out

    async def aclose(self) -> None:
        await self._client.aclose()
