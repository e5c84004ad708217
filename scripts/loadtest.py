"""Bounded overload test: drive a genscore server on 127.0.0.1 at several times its measured capacity, with some
clients that disconnect midway, and account for every request.

    python scripts/loadtest.py                      # starts `genscore serve` on the default model itself
    python scripts/loadtest.py --model DIR --factor 4 --duration 20
    python scripts/loadtest.py --url http://127.0.0.1:8000   # a server you started

Phases: (1) every distinct request of the pool is sent alone, one at a time: its answer is the reference;
(2) a closed loop measures capacity (requests/s); (3) open-loop arrivals at `factor` x capacity (at most
`max-rate` a second) for `duration` seconds, a `disconnect` fraction of them abandoned by their client after a
random short wait. Every request ends in exactly one bucket: 200 (its numbers are compared with its reference),
503/429 (refused: queue full), 504 (deadline passed in the queue), abandoned (the client left first), error (any
other status or a transport error), or lost (no answer within --client-timeout). Exit status 1 when any request is lost, wrong or an error.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shlex
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx

WORDS = ("the quick brown fox jumps over a lazy dog while Paris is the capital of France and "
         "Berlin is the capital of Germany question answer yes no positive negative review").split()
MODES = ["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"]


def request_pool(size: int, seed: int) -> list[dict]:
    """Distinct /score bodies of varied length, labels, modes, processors and item counts."""
    rng = random.Random(seed)
    pool = []
    for i in range(size):
        body: dict = {
            "query": " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 24))),
            "label_token_ids": rng.sample(range(300), rng.randint(1, 5)),
            "logprobs_mode": MODES[i % 4],
            "top_logprobs": rng.choice([0, 2, 5]),
        }
        if i % 3 == 0:
            body["items"] = [" " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 8)))
                             for _ in range(rng.randint(2, 4))]
        if i % 2 == 0:
            body.update(temperature=rng.choice([0.7, 1.5]), top_k=rng.choice([5, 50]))
        pool.append(body)
    return pool


def numbers(body: dict) -> list:
    return [(d["label_logprobs"], [t["token_id"] for t in d["top_logprobs"] or []]) for d in body["data"]]


def same(a: list, b: list, tol: float) -> bool:
    return len(a) == len(b) and all(
        ta == tb and len(la) == len(lb) and all(abs(x - y) <= tol for x, y in zip(la, lb))
        for (la, ta), (lb, tb) in zip(a, b))


@dataclass
class Tally:
    sent: int = 0
    ok: int = 0
    refused: int = 0  # 503 or 429
    refused_without_retry_after: int = 0
    deadline: int = 0  # 504
    abandoned: int = 0
    errors: int = 0
    lost: int = 0
    wrong: int = 0
    latencies: list[float] = field(default_factory=list)  # of 200s
    refusal_latencies: list[float] = field(default_factory=list)  # of 503/429s: how "at once" the refusal was
    error_samples: list[str] = field(default_factory=list)

    def row(self, name: str, seconds: float) -> str:
        return (f"| {name} | {self.sent} | {self.ok} | {self.refused} | {self.deadline} | {self.abandoned} | "
                f"{self.errors} | {self.lost} | {self.wrong} | {self.ok / seconds:.1f} | "
                f"{percentile(self.latencies, 0.5)} | {percentile(self.latencies, 0.99)} | "
                f"{percentile(self.refusal_latencies, 0.5)} |")


def percentile(values: list[float], q: float) -> str:
    """The q-quantile in milliseconds, or a dash when there is nothing to measure."""
    if not values:
        return "-"
    ordered = sorted(values)
    return f"{ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000:.0f}"


HEADER = ("| phase | sent | 200 | 503/429 | 504 | abandoned | errors | lost | wrong | 200/s | 200 p50 ms | "
          "200 p99 ms | 503 p50 ms |\n"
          "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")


@dataclass(frozen=True)
class Target:
    host: str
    port: int


@dataclass(frozen=True)
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes


def encode_request(target: Target, body: dict) -> bytes:
    """The whole HTTP/1.1 request, built once per pool entry: the client must cost far less CPU than the server."""
    payload = json.dumps(body).encode()
    head = (f"POST /score HTTP/1.1\r\nHost: {target.host}:{target.port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n")
    return head.encode() + payload


async def exchange(target: Target, raw: bytes) -> Reply:
    """One request on its own connection; cancelling this closes the socket (the client leaves midway)."""
    reader, writer = await asyncio.open_connection(target.host, target.port)
    try:
        writer.write(raw)
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
        body = await reader.readexactly(int(headers.get("content-length", "0")))
        return Reply(status, headers, body)
    finally:
        writer.close()


async def one_request(target: Target, index: int, raw: bytes, reference: list | None, tally: Tally,
                      leave_after: float | None, client_timeout: float, tol: float) -> None:
    tally.sent += 1
    started = time.perf_counter()
    try:
        reply = await asyncio.wait_for(exchange(target, raw), leave_after or client_timeout)
    except TimeoutError:
        if leave_after is not None:
            tally.abandoned += 1  # the client closed its connection before the answer came
        else:
            tally.lost += 1  # sent, and no answer within the client timeout
        return
    except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
        tally.errors += 1
        tally.error_samples.append(f"request {index}: {type(exc).__name__}: {exc}")
        return
    if reply.status == 200:
        tally.ok += 1
        tally.latencies.append(time.perf_counter() - started)
        if reference is not None and not same(numbers(json.loads(reply.body)), reference, tol):
            tally.wrong += 1
    elif reply.status in (503, 429):
        tally.refused += 1
        tally.refusal_latencies.append(time.perf_counter() - started)
        tally.refused_without_retry_after += "retry-after" not in reply.headers
    elif reply.status == 504:
        tally.deadline += 1
    else:
        tally.errors += 1
        tally.error_samples.append(f"request {index}: HTTP {reply.status}: {reply.body[:200]!r}")


async def references(client: httpx.AsyncClient, pool: list[dict]) -> list[list]:
    answers = []
    for body in pool:
        response = await client.post("/score", json=body, timeout=120)
        if response.status_code != 200:
            raise SystemExit(f"reference request failed: HTTP {response.status_code} {response.text[:300]}")
        answers.append(numbers(response.json()))
    return answers


async def closed_loop(target, raws, refs, concurrency: int, total: int, args) -> tuple[Tally, float]:
    tally = Tally()
    counter = iter(range(total))

    async def worker():
        for i in counter:
            await one_request(target, i, raws[i % len(raws)], refs[i % len(raws)], tally, None,
                              args.client_timeout, args.tolerance)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return tally, time.perf_counter() - started


async def open_loop(target, raws, refs, rate: float, args) -> tuple[Tally, float]:
    """Poisson arrivals at `rate` per second for `duration` seconds; nobody waits for the previous answer."""
    tally = Tally()
    rng = random.Random(args.seed + 1)
    tasks = []
    started = time.perf_counter()
    next_at = started
    i = 0
    while next_at - started < args.duration:
        await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
        leave = rng.uniform(0.02, 1.0) if rng.random() < args.disconnect else None
        j = i % len(raws)
        tasks.append(asyncio.create_task(
            one_request(target, i, raws[j], refs[j], tally, leave, args.client_timeout, args.tolerance)))
        i += 1
        next_at += rng.expovariate(rate)
    await asyncio.gather(*tasks)
    return tally, time.perf_counter() - started


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def spawned_server(args):
    port = free_port()
    genscore = Path(sys.executable).with_name("genscore")
    command = [str(genscore), "serve", "--model", args.model, "--host", "127.0.0.1", "--port", str(port),
               "--max-queued-requests", str(args.max_queued_requests), "--request-timeout-s",
               str(args.request_timeout_s), "--max-batch-size", str(args.max_batch_size), "--log-level", "warning",
               *shlex.split(args.server_args)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    server = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + args.start_timeout
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                    break
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"server did not become ready: {' '.join(command)}")
            time.sleep(0.2)
        yield url
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()


async def run(url: str, args) -> int:
    pool = request_pool(args.pool, args.seed)
    parsed = urlsplit(url)
    target = Target(parsed.hostname or "127.0.0.1", parsed.port or 80)
    raws = [encode_request(target, body) for body in pool]
    async with httpx.AsyncClient(base_url=url) as client:
        refs = await references(client, pool)
    capacity_tally, capacity_s = await closed_loop(target, raws, refs, args.concurrency, args.capacity_requests, args)
    capacity = capacity_tally.ok / capacity_s
    rate = min(args.factor * capacity, args.max_rate)
    overload_tally, overload_s = await open_loop(target, raws, refs, rate, args)
    async with httpx.AsyncClient(base_url=url) as client:
        after = await client.post("/score", json=pool[0], timeout=60)
        healthy = (await client.get("/health")).status_code == 200 and after.status_code == 200
    print(f"\nserver: {url}   pool: {args.pool} distinct requests ({sum(len(b.get('items') or [0]) for b in pool)} "
          f"prompts), each checked against its answer alone (tolerance {args.tolerance:g})")
    print(f"capacity (closed loop, {args.concurrency} clients): {capacity:.1f} requests/s; overload: Poisson arrivals "
          f"at {args.factor:g} x capacity = {rate:.1f}/s (at most {args.max_rate:g}) for {args.duration:g} s, "
          f"{args.disconnect:.0%} of clients leave after 0.02-1 s\n")
    print(HEADER)
    print(capacity_tally.row("capacity", capacity_s))
    print(overload_tally.row(f"{args.factor:g}x overload", overload_s))
    print(f"\n503s without Retry-After: {overload_tally.refused_without_retry_after}; server healthy and serving "
          f"after the run: {healthy}")
    for tally in (capacity_tally, overload_tally):
        for sample in tally.error_samples[:5]:
            print("error:", sample)
    bad = sum(t.lost + t.wrong + t.errors + t.refused_without_retry_after for t in (capacity_tally, overload_tally))
    return 0 if bad == 0 and healthy else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="an already running server (default: start `genscore serve` here)")
    parser.add_argument("--model", default="smollm2-135m", help="model for the server this script starts")
    parser.add_argument("--max-queued-requests", type=int, default=64)
    parser.add_argument("--request-timeout-s", type=float, default=10.0)
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--server-args", default="", help='more `genscore serve` flags, e.g. "--torch-threads 1"')
    parser.add_argument("--factor", type=float, default=4.0, help="offered load as a multiple of measured capacity")
    # Each request opens its own connection: past a few thousand a second the kernel's accept queue overflows and
    # its SYN cookies fail as connection resets, before the server sees the request; that is the host's limit.
    parser.add_argument("--max-rate", type=float, default=1500.0, help="cap on the offered requests per second")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of overload")
    parser.add_argument("--disconnect", type=float, default=0.2, help="fraction of clients that leave midway")
    parser.add_argument("--concurrency", type=int, default=32, help="clients of the capacity phase")
    parser.add_argument("--capacity-requests", type=int, default=300)
    parser.add_argument("--pool", type=int, default=48, help="distinct requests (each checked against its answer)")
    parser.add_argument("--tolerance", type=float, default=1e-4)
    parser.add_argument("--client-timeout", type=float, default=120.0, help="no answer by then counts as lost")
    parser.add_argument("--start-timeout", type=float, default=300.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.url:
        return asyncio.run(run(args.url, args))
    with spawned_server(args) as url:
        return asyncio.run(run(url, args))


if __name__ == "__main__":
    sys.exit(main())
