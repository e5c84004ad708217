#!/usr/bin/env python3
"""Start-up benchmark: the default model's load time with a cold and a warm conversion cache, and a real
`genscore serve` process's time to /ready and to exit after SIGTERM. Prints a table.

    python bench/startup.py [--model smollm2-135m] [--runs 3]
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def load_seconds(model: str, cache_dir: Path) -> float:
    from models import load_model

    return load_model(model, device="cpu", dtype="float32", cache_dir=cache_dir).load_seconds


def serve_once(model: str, cache_dir: Path) -> tuple[float, float]:
    """(seconds from process start to /ready 200, seconds from SIGTERM to exit) of an idle server."""
    port = free_port()
    script = Path(sys.executable).parent / "genscore"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GENSCORE_")} | {"HF_HUB_OFFLINE": "1"}
    started = time.perf_counter()
    process = subprocess.Popen(
        [str(script), "serve", "--model", model, "--port", str(port), "--device", "cpu", "--dtype", "float32",
         "--cache-dir", str(cache_dir), "--log-level", "warning"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if process.poll() is not None or time.perf_counter() - started > 600:
                raise RuntimeError("server did not become ready")
            time.sleep(0.05)
        ready = time.perf_counter() - started
        term = time.perf_counter()
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=120)
        return ready, time.perf_counter() - term
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="genscore-bench-cache-") as tmp:
        cache = Path(tmp)
        rows.append(("load_model, cold cache (convert GGUF + write cache)", [load_seconds(args.model, cache)]))
        rows.append(("load_model, warm cache", [load_seconds(args.model, cache) for _ in range(args.runs)]))
        served = [serve_once(args.model, cache) for _ in range(args.runs)]
        rows.append(("genscore serve: process start -> /ready 200 (warm cache)", [r for r, _ in served]))
        rows.append(("genscore serve: SIGTERM -> exit (idle)", [t for _, t in served]))
    print(f"model {args.model}, CPU, float32, {os.cpu_count()} CPUs, {args.runs} runs where repeated\n")
    print(f"| {'measure':<58} | median s | min s | max s |")
    print(f"| {'-' * 58} | -------: | ----: | ----: |")
    for name, values in rows:
        print(f"| {name:<58} | {statistics.median(values):8.2f} | {min(values):5.2f} | {max(values):5.2f} |")


if __name__ == "__main__":
    main()
