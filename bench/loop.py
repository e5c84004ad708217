"""Closed-loop load: `concurrency` callers each take the next request until none is left; per-request latency."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

# A call sends one request and returns, per scored prompt, the label logprobs (None where the
# system could not score that label).
Call = Callable[[object], Awaitable[list[list[float | None]]]]


@dataclass
class RunResult:
    """What one (system, workload, concurrency) cell measured."""

    wall_s: float
    latencies_s: list[float]  # per request, in request order
    values: list[list[list[float | None]]]  # per request, per prompt, per label

    def percentile(self, q: float) -> float:
        ordered = sorted(self.latencies_s)
        return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


async def closed_loop(
    call: Call, requests: Sequence[object], concurrency: int, warmup: int = 2, repeats: int = 1
) -> RunResult:
    """Run `requests` through `call` with `concurrency` callers; the first `warmup` requests run untimed first.

    With repeats > 1 the timed pass runs that many times and the fastest is kept (as timeit does): on a shared
    machine a slower pass measures the neighbours, not the system. A call with a `reset` coroutine (a server
    whose prefix cache would otherwise serve a later pass what an earlier one computed) has it awaited before
    the warm-up and before each timed pass.
    """
    reset = getattr(call, "reset", None)
    if reset is not None:
        await reset()
    for request in requests[:warmup]:
        await call(request)
    runs = []
    for _ in range(max(1, repeats)):
        if reset is not None:
            await reset()
        runs.append(await _timed_pass(call, requests, concurrency))
    return min(runs, key=lambda run: run.wall_s)


async def _timed_pass(call: Call, requests: Sequence[object], concurrency: int) -> RunResult:
    latencies = [0.0] * len(requests)
    values: list = [None] * len(requests)
    next_index = 0

    async def caller() -> None:
        nonlocal next_index
        while next_index < len(requests):
            i = next_index
            next_index += 1
            started = time.perf_counter()
            values[i] = await call(requests[i])
            latencies[i] = time.perf_counter() - started

    started = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(concurrency)))
    return RunResult(time.perf_counter() - started, latencies, values)


def peak_rss_mb(pid: int | str = "self") -> float:
    """The process's resident-set high-water mark (VmHWM), in MiB."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")
