"""One engine replica per core against one team of threads: the same work split over R processes of T torch threads
each (each pinned to its own cores), or over callers (threads) sharing one process's weights, through models/; or R
servers over HTTP behind one round-robin client. Through models/, two kinds of work, all replicas started together
and measured over the slowest one's wall time: packed scoring batches of `short` prompts, and decode steps of a
batch of rows. Prints a markdown table.

    python -m bench.replicas [--layouts 1x2,2x1,1x1+2] [--batch 32] [--rows 16] [--seconds 20]
    python -m bench.replicas --http 1,2,1,2 [--concurrency 8,32] [--requests 64]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import multiprocessing as mp
import os
import statistics
import threading
import time
from pathlib import Path

import torch


def _worker(rank: int, cores: list[int], threads: int, args: argparse.Namespace, ready, results) -> None:
    """One replica process: load the model pinned to `cores`, then run the work as `shared` callers of its own."""
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(threads)
    torch.set_grad_enabled(False)
    from models import load_model

    loaded = load_model(args.model, "cpu", args.dtype)
    if args.shared == 1:
        _run_work(loaded, rank, args, ready, results)
        return
    # Several callers in this process on one copy of the weights: torch kernels release the GIL.
    callers = [threading.Thread(target=_run_work, args=(loaded, rank * args.shared + i, args, ready, results))
               for i in range(args.shared)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join()


def _run_work(loaded, caller: int, args: argparse.Namespace, ready, results) -> None:
    """Warm up, wait for every other caller, then run each kind of work for `args.seconds`."""
    torch.set_grad_enabled(False)
    from bench.workload import short_workload
    from models.decoding import decode_step, prefill
    from models.forward import forward_logits

    model, plan, pad = loaded.model, loaded.plan, loaded.pad_token_id
    prompts = [r.prompts[0] for r in short_workload(loaded.tokenizer, args.batch, seed=2 + caller)]
    batch = prompts[:max(1, args.batch // args.callers)]  # the same total work per round whatever the layout
    rows = max(1, args.rows // args.callers)
    decode_prompts = [p[:24] for p in prompts[:rows]]
    tokens = torch.zeros(rows, dtype=torch.long)

    def score_once() -> int:
        forward_logits(model, plan, batch, pad)
        return len(batch)

    def decode_round() -> int:
        _, state = prefill(model, plan, decode_prompts, pad)
        for _ in range(args.steps):
            decode_step(model, plan, state, tokens)
        return rows * args.steps

    for work in (score_once, decode_round):
        work()  # warm-up: first-call allocations and kernel selection
        ready.wait()
        done, times, deadline = 0, [], time.perf_counter() + args.seconds
        started = time.perf_counter()
        while time.perf_counter() < deadline:
            t0 = time.perf_counter()
            done += work()
            times.append(time.perf_counter() - t0)
        results.put((work.__name__, caller, done, time.perf_counter() - started, statistics.median(times)))


def run_layout(replicas: int, threads: int, shared: int, args: argparse.Namespace) -> dict[str, tuple[float, float]]:
    """(units per second over all callers, median seconds per call of one caller) for each kind of work."""
    cores = sorted(os.sched_getaffinity(0))
    per_process = threads * shared  # each caller runs `threads` torch threads on cores of its own
    if replicas * per_process > len(cores):
        raise SystemExit(f"{replicas} x {per_process} cores needed, this process has {len(cores)}")
    ctx = mp.get_context("spawn")
    callers = replicas * shared
    ready, results = ctx.Barrier(callers), ctx.Queue()
    run_args = argparse.Namespace(**{**vars(args), "callers": callers, "shared": shared})
    procs = [ctx.Process(target=_worker, args=(r, cores[r * per_process:(r + 1) * per_process], threads, run_args, ready,
                                               results)) for r in range(replicas)]
    for p in procs:
        p.start()
    rows = [results.get() for _ in range(2 * callers)]
    for p in procs:
        p.join()
    out = {}
    for kind in ("score_once", "decode_round"):
        mine = [r for r in rows if r[0] == kind]
        out[kind] = (sum(r[2] for r in mine) / max(r[3] for r in mine), statistics.median(r[4] for r in mine))
    return out


class RoundRobin:
    """Send each request to the next of several genscore servers, as a Service spreads them over pods."""

    def __init__(self, base_urls: list[str], concurrency: int):
        from bench.servers import GenscoreClient

        self._clients = [GenscoreClient(url, concurrency) for url in base_urls]
        self._next = itertools.count()

    async def __call__(self, request) -> list[list[float | None]]:
        return await self._clients[next(self._next) % len(self._clients)](request)

    async def aclose(self) -> None:
        for client in self._clients:
            await client.aclose()


def run_http(replicas: int, args: argparse.Namespace, levels: list[int]) -> dict[int, float]:
    """Prompts/s of the `short` workload over HTTP at each concurrency: `replicas` servers, each pinned to its share of
    the cores with one torch thread per core, one client spreading the requests over them round robin."""
    from transformers import AutoTokenizer

    from bench.loop import closed_loop
    from bench.servers import start_genscore
    from bench.workload import short_workload
    from models.loading import resolve_source

    cores = sorted(os.sched_getaffinity(0))
    share = len(cores) // replicas
    servers = []
    try:
        for r in range(replicas):
            mine = cores[r * share:(r + 1) * share]
            os.sched_setaffinity(0, mine)  # the server process inherits it
            try:
                servers.append(start_genscore(args.model, args.dtype, args.cache_dir,
                                              args.cache_dir.parent / f"replica-{replicas}-{r}.log",
                                              extra_args=("--torch-threads", str(len(mine)))))
            finally:
                os.sched_setaffinity(0, cores)  # the client runs on every core, as in `make bench`
        source = resolve_source(args.model)
        tokenizer = AutoTokenizer.from_pretrained(source.location, gguf_file=source.gguf_file)
        requests = short_workload(tokenizer, args.requests)

        async def one_level(level: int) -> float:
            client = RoundRobin([server.base_url for server in servers], level)
            try:
                result = await closed_loop(client, requests, level, warmup=2 * replicas, repeats=2)
            finally:
                await client.aclose()
            return len(requests) / result.wall_s

        return {level: asyncio.run(one_level(level)) for level in levels}
    finally:
        for server in servers:
            server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--layouts", default="1x2,2x1,1x1+2,1x2,2x1,1x1+2",
                        help="REPLICASxTHREADS[+CALLERS] (CALLERS threads of each process on its one copy of the "
                             "weights), comma-separated, run in turn")
    parser.add_argument("--batch", type=int, default=32, help="short prompts per scoring round, split over replicas")
    parser.add_argument("--rows", type=int, default=16, help="decoding rows per round, split over replicas")
    parser.add_argument("--steps", type=int, default=32, help="decode steps after each prefill")
    parser.add_argument("--seconds", type=float, default=20.0, help="time each kind of work runs, per layout")
    parser.add_argument("--http", default="", help="also over HTTP: REPLICAS,REPLICAS,... servers (e.g. 1,2,1,2)")
    parser.add_argument("--concurrency", default="8,32", help="HTTP callers, comma-separated")
    parser.add_argument("--requests", type=int, default=64, help="`short` requests per HTTP pass")
    parser.add_argument("--cache-dir", type=Path, default=Path(".cache/bench/weights"))
    args = parser.parse_args()
    from models.cpu_features import cpu_model_name

    if args.http:
        levels = [int(c) for c in args.concurrency.split(",")]
        print(f"CPU: {cpu_model_name()}; torch {torch.__version__}; {args.dtype}; `short` over HTTP, {args.requests} "
              f"requests, fastest of 2 passes; R servers pinned to 1/R of the cores each, one round-robin client\n")
        print("| servers | " + " | ".join(f"prompts/s c={c}" for c in levels) + " |")
        print("| --- |" + " ---: |" * len(levels))
        for replicas in (int(r) for r in args.http.split(",")):
            out = run_http(replicas, args, levels)
            print(f"| {replicas} | " + " | ".join(f"{out[c]:.1f}" for c in levels) + " |", flush=True)
        return
    print(f"CPU: {cpu_model_name()}; torch {torch.__version__}; {args.dtype}; scoring rounds of {args.batch} `short` "
          f"prompts, decoding {args.rows} rows ({args.steps} steps after a prefill), both split over the replicas\n")
    print("| processes × threads (+ callers each) | scoring prompts/s | s per scoring call | decode tokens/s (with prefill) |"
          " s per decode round |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for layout in args.layouts.split(","):
        processes, _, shared = layout.partition("+")
        replicas, threads = (int(x) for x in processes.split("x"))
        out = run_layout(replicas, threads, int(shared or 1), args)
        (score, score_s), (decode, decode_s) = out["score_once"], out["decode_round"]
        print(f"| {layout} | {score:.1f} | {score_s:.3f} | {decode:.1f} | {decode_s:.2f} |", flush=True)


if __name__ == "__main__":
    main()
