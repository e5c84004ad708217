"""Mixed load over HTTP: /score throughput alone and while long streamed generations run, and the server's peak RSS.

    python -m bench.mixed_load [--dtype float32] [--seconds 20] [--score-concurrency 4] [--generations 2]

Starts `genscore serve` on the default model, measures small /score requests (prompts/s and p50/p95 latency)
first alone, then while `--generations` streaming completions of `--max-tokens` tokens each run, and reads
VmHWM/VmRSS of the server from /proc. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from bench.memory import proc_status_kb
from bench.servers import wait_ready

QUERY = "Is the following review positive? The food was good and the staff friendly, though the wait was long."


async def score_for(client: httpx.AsyncClient, seconds: float, concurrency: int) -> list[float]:
    """Latencies of /score requests sent back to back by `concurrency` callers for `seconds`."""
    stop_at = time.perf_counter() + seconds
    latencies: list[float] = []

    async def caller(i: int) -> None:
        n = 0
        while time.perf_counter() < stop_at:
            body = {"query": f"{QUERY} ({i}.{n})", "label_token_ids": [5, 6, 7]}
            started = time.perf_counter()
            response = await client.post("/score", json=body)
            response.raise_for_status()
            latencies.append(time.perf_counter() - started)
            n += 1

    await asyncio.gather(*(caller(i) for i in range(concurrency)))
    return latencies


async def generate(client: httpx.AsyncClient, max_tokens: int, n: int) -> int:
    body = {"prompt": "Once upon a time, in a small village by the sea,", "max_tokens": max_tokens, "n": n,
            "temperature": 0.0, "stream": True}
    chunks = 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            chunks += line.startswith("data: ")
    return chunks


def row(name: str, latencies: list[float], seconds: float) -> str:
    ordered = sorted(latencies)
    p95 = ordered[int(0.95 * (len(ordered) - 1))]
    return (f"| {name} | {len(latencies) / seconds:.1f} | {statistics.median(ordered) * 1000:.0f} | "
            f"{p95 * 1000:.0f} |")


async def measure(url: str, pid: int, args) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await score_for(client, 2, args.score_concurrency)  # warm the path
        alone = await score_for(client, args.seconds, args.score_concurrency)
        gens = [asyncio.create_task(generate(client, args.max_tokens, args.n)) for _ in range(args.generations)]
        await asyncio.sleep(1.0)  # let the generations reach the decode loop
        mixed = await score_for(client, args.seconds, args.score_concurrency)
        still_generating = sum(not g.done() for g in gens)
        await asyncio.gather(*gens)
    memory = proc_status_kb(pid)
    print(f"load average {os.getloadavg()[0]:.2f}; {args.generations} generation(s) of n={args.n} x "
          f"{args.max_tokens} tokens, {still_generating} still running when the mixed window closed")
    print(f"| /score, concurrency {args.score_concurrency} | prompts/s | p50 ms | p95 ms |")
    print("| --- | ---: | ---: | ---: |")
    print(row("alone", alone, args.seconds))
    print(row("while generating", mixed, args.seconds))
    print(f"server peak RSS (VmHWM) {memory['VmHWM'] / 2**20:.2f} GiB, RSS after {memory['VmRSS'] / 2**20:.2f} GiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--port", type=int, default=8391)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--score-concurrency", type=int, default=4)
    parser.add_argument("--generations", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=400)
    parser.add_argument("--n", type=int, default=4)
    args = parser.parse_args()
    command = [sys.executable, "-m", "app.cli", "serve", "--port", str(args.port), "--dtype", args.dtype,
               "--no-access-log", "--request-timeout-s", "0"]
    log_path = Path(".cache/bench/mixed_load_server.log")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    server = subprocess.Popen(command, stdout=log_path.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{args.port}"
    try:
        wait_ready(server, f"{url}/ready", 300, "genscore serve", log_path)
        asyncio.run(measure(url, server.pid, args))
    finally:
        server.terminate()
        server.wait(60)


if __name__ == "__main__":
    main()
