"""rows/s of `genscore run-batch` against `genscore serve` over HTTP on the same OpenAI Batch file (SmolLM2-135M).

    python -m bench.run_batch [--rows 256] [--concurrency 64]

Both sides get the same rows: /score requests with 20-120-token prompts and 2-10 labels, and some with items.
run-batch is timed from its first row to its last (its log's rows/s, model load excluded); the HTTP side
from the first request to the last answer, `concurrency` requests in flight, after /ready.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.servers import start_genscore


def make_rows(count: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        prompt = [rng.randrange(100, 49000) for _ in range(rng.randint(20, 120))]
        body = {"query": prompt, "label_token_ids": rng.sample(range(100, 49000), rng.randint(2, 10))}
        if i % 4 == 0:
            body["items"] = [[rng.randrange(100, 49000) for _ in range(rng.randint(3, 12))] for _ in range(4)]
        rows.append({"custom_id": f"row-{i}", "method": "POST", "url": "/score", "body": body})
    return rows


def time_run_batch(input_path: Path, output: Path, dtype: str, cache_dir: Path, concurrency: int) -> float:
    """rows/s as run-batch reports it over its whole run (the last progress line)."""
    done = subprocess.run(
        [sys.executable, "-m", "app.cli", "run-batch", "-i", str(input_path), "-o", str(output),
         "--concurrency", str(concurrency), "--dtype", dtype, "--device", "cpu", "--cache-dir", str(cache_dir)],
        capture_output=True, text=True, check=True)
    rates = re.findall(r"rows, ([0-9.]+) rows/s", done.stderr)
    return float(rates[-1])


async def time_http(base_url: str, rows: list[dict], concurrency: int) -> float:
    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        async def send(row):
            async with limit:
                response = await client.post(row["url"], json=row["body"])
                response.raise_for_status()

        started = time.perf_counter()
        await asyncio.gather(*(send(row) for row in rows))
        return len(rows) / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "genscore")
    args = parser.parse_args()
    rows = make_rows(args.rows)
    with tempfile.TemporaryDirectory() as tmp:
        input_path = Path(tmp) / "in.jsonl"
        input_path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        batch = time_run_batch(input_path, Path(tmp) / "out.jsonl", args.dtype, args.cache_dir, args.concurrency)
        server = start_genscore("smollm2-135m", args.dtype, args.cache_dir, Path(tmp) / "serve.log")
        try:
            http = asyncio.run(time_http(server.base_url, rows, args.concurrency))
        finally:
            server.stop()
    print(f"| {args.rows} | {args.dtype} | {args.concurrency} | {batch:.1f} | {http:.1f} | {batch / http:.2f}x |")


if __name__ == "__main__":
    main()
