"""How much work the shared query prefix saves: one /score request with N items, scored from scratch vs over
the query's shared key/value states (with and without the cross-request prefix cache). Prints a markdown table.

    python bench/shared_prefix.py [--model smollm2-135m] [--items 20 50 100] [--repeats 3] [--device auto]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

from app.api.front import Front
from app.api.score import serving
from app.api.score.protocol import ScoreRequest
from app.engine.core import Engine
from app.engine.device import device_thread
from app.settings import Settings
from models import load_model

WORDS = ("the movie was great terrible boring fun long short plot actors music scenes story ending slow fast "
         "brilliant dull funny sad loved hated").split()


def workload(n_items: int, seed: int = 0) -> tuple[str, list[str]]:
    """A ranking-style request: a long instruction + review query, and n short candidate answers."""
    rng = random.Random(seed)
    review = " ".join(rng.choice(WORDS) for _ in range(80))
    query = ("You are a careful film critic. Read the review and judge whether the answer that follows describes "
             f"it. Review: {review}. Proposed answer:")
    items = [" " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 12))) for _ in range(n_items)]
    return query, items


async def run(front: Front, request: ScoreRequest, repeats: int) -> tuple[float, dict, list]:
    """Median wall time of `repeats` requests; the usage and the numbers of the last one."""
    times, out = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        out = await serving.score(front, request)
        times.append(time.perf_counter() - started)
    return statistics.median(times), out["usage"], [d["label_logprobs"] for d in out["data"]]


async def main(args: argparse.Namespace) -> None:
    device = device_thread()  # loads the model and runs every engine below (app/engine/device.py says why)
    loaded = device.submit(load_model, args.model, args.device, args.dtype, Settings().cache_dir).result()
    variants = {
        "from scratch": dict(share_prefixes=False),
        "shared prefix, no cache": dict(prefix_cache_mb=0),
        "shared prefix + cache (repeat)": dict(),
    }
    print(f"model {args.model} on {loaded.device} ({str(loaded.dtype).removeprefix('torch.')}), "
          f"max_batch_size {args.max_batch_size}, median of {args.repeats}\n")
    print("| items | query tokens | prompt tokens | mode | tokens computed | cache hits/misses | wall s | speed-up "
          "| max abs diff |")
    print("|---:|---:|---:|---|---:|---:|---:|---:|---:|")
    for n in args.items:
        query, items = workload(n)
        request = ScoreRequest(query=query, items=items, label_token_ids=[1, 2, 3, 4])
        query_tokens = len(loaded.tokenizer(query)["input_ids"])
        baseline_time, baseline_values = None, None
        for name, overrides in variants.items():
            settings = Settings(model=args.model, max_batch_size=args.max_batch_size, **overrides)
            engine = Engine(loaded, settings, device=device)
            front = Front(engine)
            engine.start()
            await engine.warm_up()
            try:
                if name.endswith("(repeat)"):
                    await serving.score(front, request)  # fills the cache; the timed requests reuse it
                wall, usage, values = await run(front, request, args.repeats)
                stats = engine.prefix_cache.stats
            finally:
                await engine.stop()
                front.close()
            computed = usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"]
            if baseline_time is None:
                baseline_time, baseline_values = wall, values
            diff = max(abs(a - b) for row, ref in zip(values, baseline_values) for a, b in zip(row, ref))
            print(f"| {n} | {query_tokens} | {usage['prompt_tokens']} | {name} | {computed} | "
                  f"{stats.hits}/{stats.misses} | {wall:.3f} | "
                  f"{baseline_time / wall:.1f}x | {diff:.1e} |", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--items", type=int, nargs="+", default=[20, 50, 100])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-batch-size", type=int, default=32)
    asyncio.run(main(parser.parse_args()))
