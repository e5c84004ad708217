"""Generation throughput: genscore's continuous-batching loop (in-process, no HTTP) against transformers'
generate() one prompt at a time, greedy, on the same float32 model. Prints a markdown table.

    python bench/bench_generation.py [--model smollm2-135m] [--new-tokens 32] [--concurrency 1 4 16]
"""

from __future__ import annotations

import argparse
import asyncio
import time

import torch

from app.engine.device import device_thread
from app.engine.generation import Generator
from app.engine.work import GenerationParams
from app.settings import Settings
from models import load_model
from sampler import SamplingParams

WORDS = "the quick brown fox jumps over the lazy dog while a curious cat watches from the old stone wall".split()


def prompts(count: int) -> list[str]:
    """Deterministic prompts of 8 to 40 words."""
    return [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(8 + (i * 11) % 33)) for i in range(count)]


async def genscore_run(loaded, device, texts: list[str], new_tokens: int, concurrency: int) -> tuple[float, int]:
    generator = Generator(loaded, Settings(model="unused", device=str(loaded.device)), device=device)
    generator.start()
    await generator.warm_up()
    params = GenerationParams(max_tokens=new_tokens, sampling=SamplingParams(temperature=0.0))
    queue = list(texts)
    generated = 0

    async def client() -> None:
        nonlocal generated
        while queue:
            ids = loaded.tokenizer(queue.pop())["input_ids"]
            async for update in generator.generate(ids, params):
                generated += len(update.token_ids)

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    elapsed = time.perf_counter() - started
    await generator.stop()
    return elapsed, generated


def transformers_run(loaded, texts: list[str], new_tokens: int) -> tuple[float, int]:
    generated = 0
    started = time.perf_counter()
    for text in texts:
        ids = torch.tensor([loaded.tokenizer(text)["input_ids"]], device=loaded.device)
        out = loaded.model.generate(ids, do_sample=False, max_new_tokens=new_tokens, pad_token_id=loaded.pad_token_id)
        generated += out.shape[1] - ids.shape[1]
    return time.perf_counter() - started, generated


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    args = parser.parse_args()
    # One thread loads the model and runs both systems (app/engine/device.py says why).
    device = device_thread()
    loaded = device.submit(load_model, args.model, args.device, args.dtype, Settings().cache_dir).result()
    texts = prompts(args.requests)
    rows = []
    elapsed, generated = device.submit(transformers_run, loaded, texts[: max(2, args.requests // 4)],
                                       args.new_tokens).result()
    rows.append(("transformers generate, one at a time", 1, generated, elapsed))
    for concurrency in args.concurrency:
        elapsed, generated = asyncio.run(genscore_run(loaded, device, texts, args.new_tokens, concurrency))
        rows.append(("genscore generation loop", concurrency, generated, elapsed))
    print(f"\n{args.model} on {loaded.device} ({str(loaded.dtype).removeprefix('torch.')}), "
          f"{torch.get_num_threads()} threads, greedy, {args.new_tokens} new tokens per request\n")
    print("| system | concurrency | tokens | seconds | tokens/s |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for system, concurrency, tokens, seconds in rows:
        print(f"| {system} | {concurrency} | {tokens} | {seconds:.1f} | {tokens / seconds:.1f} |")
    device.shutdown()


if __name__ == "__main__":
    main()
