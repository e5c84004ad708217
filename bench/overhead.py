"""Where a request's time goes outside the model at concurrency 1: the same prompts through each layer of genscore, timed.

    python -m bench.overhead [--dtype float32] [--requests 64] [--cprofile 25]

Layers, innermost first, each measured one request at a time on the short-prompt workload:
the model's packed forward alone, Scorer.run_batch (adds the sampler and result rows), both on the
engine's device thread where the model was loaded, Engine.score (with the request tokenized on the tokenizer thread: adds that thread, the batcher and its max-wait), the /score
serving function (adds request and response objects), and POST /score on a `genscore serve`
subprocess (adds HTTP, uvicorn and the client), with the server's own share of it from its access
log. Each layer's median minus the one inside it is that layer's cost. With --cprofile N, the N functions of the event-loop thread with the most own time
during Engine.score, and of run_batch, are printed.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import os
import pstats
import re
import statistics
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
_ACCESS_MS = re.compile(r'"POST /score HTTP/[\d.]+" 200 ([\d.]+) ms')


def _median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


async def _timed_async(fn: Callable[[object], Awaitable], requests: list, repeats: int) -> list[float]:
    best: list[float] | None = None
    for _ in range(repeats):
        samples = []
        for request in requests:
            started = time.perf_counter()
            await fn(request)
            samples.append(time.perf_counter() - started)
        if best is None or statistics.median(samples) < statistics.median(best):
            best = samples
    return best


def _profile_top(profile: cProfile.Profile, n: int) -> str:
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(n)
    return out.getvalue()


async def _engine_layers(front, bodies: list[dict], repeats: int, inner: bool, cprofile: int, rows: list,
                         profiles: dict) -> None:
    """Time Engine.score and serving.score on front's engine; with `inner`, also the model forward and
    Scorer.run_batch."""
    import torch

    from app.api.score import serving
    from app.api.score.protocol import ScoreRequest
    from app.engine.work import ScoreWork
    from models import forward_logits

    eng = front.engine
    loaded = eng.loaded
    if inner:
        works = {}
        for body in bodies:  # the exact units Engine.score submits
            query = serving.score_query(front, ScoreRequest(**body))
            works[id(body)] = [ScoreWork(ids, query.params, 0, query.candidates) for ids in query.prompts]

        # Everything on the engine's device thread, where the model was loaded (app/engine/device.py says why).
        def on_device(fn, *args):
            return asyncio.get_running_loop().run_in_executor(eng.device, fn, *args)

        def forward_one(body):
            with torch.inference_mode():
                return forward_logits(loaded.model, loaded.plan, [body["query"]], loaded.pad_token_id, keep_last=[1])

        async def forward(body):
            return await on_device(forward_one, body)

        async def run_batch(body):
            return await on_device(eng.scorer.run_batch, works[id(body)])

        rows.append(("model forward (forward_logits, 1 prompt)", await _timed_async(forward, bodies, repeats)))
        rows.append(("Scorer.run_batch", await _timed_async(run_batch, bodies, repeats)))
        if cprofile:
            def profiled() -> cProfile.Profile:
                profile = cProfile.Profile()  # profiles the thread it is enabled on
                profile.enable()
                for body in bodies:
                    eng.scorer.run_batch(works[id(body)])
                profile.disable()
                return profile

            profiles["Scorer.run_batch"] = await on_device(profiled)

    async def engine_score(body):
        return await eng.score(await front.on_tokenizer_thread(serving.score_query, front, ScoreRequest(**body)))

    async def serving_score(body):
        return await serving.score(front, ScoreRequest(**body))

    label = f"max_wait_ms {eng.settings.max_wait_ms:g}"
    rows.append((f"Engine.score ({label})", await _timed_async(engine_score, bodies, repeats)))
    rows.append((f"serving.score: request model + Engine.score + body ({label})",
                 await _timed_async(serving_score, bodies, repeats)))
    if cprofile and inner:
        profile = cProfile.Profile()
        profile.enable()
        for body in bodies:
            await serving.score(front, ScoreRequest(**body))
        profile.disable()
        profiles["serving.score (event-loop thread only)"] = profile


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.overhead", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2, help="passes per layer; the one with the lowest median is kept")
    p.add_argument("--cache-dir", type=Path, default=REPO / ".cache" / "bench" / "weights")
    p.add_argument("--no-http", action="store_true", help="skip the genscore serve subprocess")
    p.add_argument("--cprofile", type=int, default=0, help="print the N functions with the most own time")
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import torch

    from app.api.front import Front
    from app.engine.core import Engine
    from app.engine.device import device_thread
    from app.settings import Settings
    from bench.servers import GenscoreClient, start_genscore
    from bench.workload import short_workload
    from models import load_model

    settings = Settings(model=args.model, dtype=args.dtype, cache_dir=args.cache_dir)
    device = device_thread()  # loads the model and runs every engine below, as genscore serve does
    loaded = device.submit(load_model, settings.model, settings.device, settings.dtype, settings.cache_dir).result()
    requests = short_workload(loaded.tokenizer, args.requests)
    bodies = [r.score_body() for r in requests]
    rows: list[tuple[str, list[float]]] = []
    profiles: dict[str, cProfile.Profile] = {}

    async def in_process() -> None:
        for max_wait_ms in (settings.max_wait_ms, 0.0):
            eng = Engine(loaded, settings.model_copy(update={"max_wait_ms": max_wait_ms}), device=device)
            front = Front(eng)
            eng.start()
            await eng.warm_up()
            try:
                inner = max_wait_ms == settings.max_wait_ms
                await _engine_layers(front, bodies, args.repeats, inner, args.cprofile, rows, profiles)
            finally:
                await eng.stop()
                front.close()

    asyncio.run(in_process())

    if not args.no_http:
        for max_wait_ms in (settings.max_wait_ms, 0.0):
            server = start_genscore(args.model, args.dtype, args.cache_dir,
                                    args.cache_dir.parent / f"overhead-{args.dtype}.log",
                                    extra_args=("--max-wait-ms", str(max_wait_ms)))
            try:
                async def over_http(url=server.base_url) -> list[float]:
                    client = GenscoreClient(url, 1)
                    try:
                        for request in requests[:2]:
                            await client(request)
                        return await _timed_async(client, requests, args.repeats)
                    finally:
                        await client.aclose()

                rows.append((f"POST /score over HTTP, genscore serve (max_wait_ms {max_wait_ms:g})",
                             asyncio.run(over_http())))
            finally:
                server.stop()
            # The access log's duration runs from the outermost ASGI middleware to the response's last byte:
            # the server's share of the client's time (the rest is uvicorn's HTTP parsing, the socket, httpx).
            served = [float(ms) / 1e3 for ms in _ACCESS_MS.findall(server.log_path.read_text())][2:]
            if served:
                rows.append((f"  of which in the server's ASGI app (access log, max_wait_ms {max_wait_ms:g})", served))

    tokens = [len(r.query) for r in requests]
    print(f"{args.model} {args.dtype}, {len(requests)} prompts of {min(tokens)}-{max(tokens)} tokens, concurrency 1, "
          f"torch {torch.__version__} ({torch.get_num_threads()} threads), load average {os.getloadavg()[0]:.2f}\n")
    print(f"| {'layer':<74} | median ms | mean ms | p90 ms |")
    print(f"| {'-' * 74} | --------: | ------: | -----: |")
    for name, samples in rows:
        ordered = sorted(samples)
        print(f"| {name:<74} | {_median_ms(samples):9.2f} | {statistics.fmean(samples) * 1e3:7.2f} | "
              f"{ordered[int(0.9 * (len(ordered) - 1))] * 1e3:6.2f} |")
    for name, profile in profiles.items():
        print(f"\n## cProfile: {name}, top {args.cprofile} by own time\n")
        print(_profile_top(profile, args.cprofile))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
