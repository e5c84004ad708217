"""Peak and resident memory of `genscore serve` after each of the largest requests the limits allow, one at a time,
and the latency of a small /score while a large generation runs."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from bench.servers import free_port, wait_ready
from models.cpu_features import cpu_model_name

# SmolLM2's special tokens (<|endoftext|>, <|im_start|>, <|im_end|>): biased away so every choice runs to max_tokens,
# the worst case the limits allow.
_END_TOKENS = (0, 1, 2)


def proc_status_kb(pid: int) -> dict[str, int]:
    """VmHWM / VmRSS / ... of a process, in kB, from /proc/<pid>/status."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name.startswith("Vm") and value.strip().endswith("kB"):
            fields[name] = int(value.split()[0])
    return fields


def reset_peak(pid: int) -> bool:
    """Reset VmHWM to the current RSS (`5` > clear_refs, Linux >= 4.0), so the next peak is one request's own."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def score_request(items: int, labels: int, top: int, item_tokens: int = 16, query_tokens: int = 64) -> dict:
    # token ids keep the body under the 2 MiB limit and the tokenizer out of the measurement
    query = [(7 * i) % 40000 + 100 for i in range(query_tokens)]
    return {"query": query,
            "items": [[(13 * i + j) % 40000 + 100 for j in range(item_tokens)] for i in range(items)],
            "label_token_ids": list(range(100, 100 + labels)), "top_logprobs": top}


def echo_request(prompt_tokens: int, logprobs: int) -> dict:
    return {"prompt": [(7 * i) % 40000 + 100 for i in range(prompt_tokens)], "echo": True, "logprobs": logprobs,
            "max_tokens": 0}


def fan_out_request(n: int, max_tokens: int, prompt_tokens: int = 16) -> dict:
    return {"prompt": [(11 * i) % 40000 + 100 for i in range(prompt_tokens)], "n": n, "max_tokens": max_tokens,
            "temperature": 1.0, "seed": 1, "logit_bias": {str(t): -100 for t in _END_TOKENS}}


SMALL_SCORE = {"query": "The capital of France is", "label_token_ids": [7042, 4528], "top_logprobs": 3}


def start_server(args, port: int, log_path: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "app.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--request-timeout-s", "0", "--dtype", args.dtype, *args.server_args]
    env = dict(os.environ)
    for assignment in args.env:
        name, _, value = assignment.partition("=")
        env[name] = value
    process = subprocess.Popen(cmd, stdout=log_path.open("w"), stderr=subprocess.STDOUT, env=env)
    try:
        wait_ready(process, f"http://127.0.0.1:{port}/ready", 600, "genscore serve", log_path)
    except RuntimeError as exc:
        process.kill()
        raise SystemExit(str(exc)) from None
    return process


def measure(client: httpx.Client, pid: int, name: str, path: str, body: dict) -> dict:
    reset_peak(pid)
    before = proc_status_kb(pid)["VmRSS"]
    started = time.perf_counter()
    try:
        response = client.post(path, json=body)
        status, size = response.status_code, len(response.content)
    except httpx.HTTPError as exc:
        status, size = f"{type(exc).__name__}", 0
    seconds = time.perf_counter() - started
    alive = Path(f"/proc/{pid}").exists()
    after = proc_status_kb(pid) if alive else {"VmHWM": 0, "VmRSS": 0}
    row = {"request": name, "status": status, "body_bytes": size, "seconds": round(seconds, 1),
           "rss_before_mb": before // 1024, "peak_mb": after["VmHWM"] // 1024, "rss_after_mb": after["VmRSS"] // 1024}
    print(json.dumps(row), flush=True)
    return row


def small_score_latency(client: httpx.Client, stop: threading.Event, out: list[float]) -> None:
    while not stop.is_set():
        started = time.perf_counter()
        response = client.post("/score", json=SMALL_SCORE)
        if response.status_code == 200:
            out.append(time.perf_counter() - started)


def latency_summary(samples: list[float]) -> dict:
    if not samples:
        return {"count": 0}
    ordered = sorted(samples)
    return {"count": len(ordered), "p50_ms": round(statistics.median(ordered) * 1000),
            "max_ms": round(ordered[-1] * 1000)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--items", type=int, default=1024)
    parser.add_argument("--labels", type=int, default=1024)
    parser.add_argument("--echo-tokens", type=int, default=8000)
    parser.add_argument("--n", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--skip", action="append", default=[], choices=["score", "echo", "fan-out", "latency"])
    parser.add_argument("--env", action="append", default=[], help="NAME=VALUE for the server's environment")
    parser.add_argument("--out", type=Path, default=Path(".cache/bench/memory.json"))
    parser.add_argument("server_args", nargs="*", help="extra `genscore serve` flags (after --)")
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    port = free_port()
    process = start_server(args, port, args.out.with_suffix(".log"))
    pid = process.pid
    report = {"cpu": cpu_model_name(), "cores": os.cpu_count(), "load_average_start": os.getloadavg(),
              "env": args.env, "server_args": args.server_args, "dtype": args.dtype, "rows": []}
    idle = proc_status_kb(pid)
    report["idle"] = {"peak_mb": idle["VmHWM"] // 1024, "rss_mb": idle["VmRSS"] // 1024}
    print(json.dumps(report["idle"]), flush=True)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=None) as client:
            if "latency" not in args.skip:
                alone = []
                for _ in range(20):
                    started = time.perf_counter()
                    client.post("/score", json=SMALL_SCORE).raise_for_status()
                    alone.append(time.perf_counter() - started)
                report["small_score_alone"] = latency_summary(alone)
                print(json.dumps({"small_score_alone": report["small_score_alone"]}), flush=True)
            if "score" not in args.skip:
                report["rows"].append(measure(client, pid, f"/score {args.items} items x {args.labels} labels, top 20",
                                              "/score", score_request(args.items, args.labels, 20)))
            if "echo" not in args.skip:
                report["rows"].append(measure(client, pid, f"completions {args.echo_tokens}-token echo, logprobs 20",
                                              "/v1/completions", echo_request(args.echo_tokens, 20)))
            if "fan-out" not in args.skip:
                stop, samples = threading.Event(), []
                prober = None
                if "latency" not in args.skip:
                    probe_client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=None)
                    prober = threading.Thread(target=small_score_latency, args=(probe_client, stop, samples))
                    prober.start()
                report["rows"].append(measure(client, pid, f"completions n {args.n}, max_tokens {args.max_tokens}",
                                              "/v1/completions", fan_out_request(args.n, args.max_tokens)))
                stop.set()
                if prober is not None:
                    prober.join()
                    report["small_score_during_fan_out"] = latency_summary(samples)
                    print(json.dumps({"small_score_during_fan_out": report["small_score_during_fan_out"]}), flush=True)
            time.sleep(5)  # what the allocator gives back once the server is idle again
            if Path(f"/proc/{pid}").exists():
                settled = proc_status_kb(pid)
                report["settled_rss_mb"] = settled["VmRSS"] // 1024
    finally:
        report["load_average_end"] = os.getloadavg()
        report["alive_at_end"] = process.poll() is None
        process.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=30)
        if process.poll() is None:
            process.kill()
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k != "rows"}), flush=True)


if __name__ == "__main__":
    main()
