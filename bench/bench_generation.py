"""Generation throughput: genscore's continuous-batching loop (in-process, no HTTP) against transformers'
generate() one prompt at a time, greedy, on the same float32 model; or, with --baseline, against another checkout's
decode loop in the same process (A/B, interleaved). Prints a markdown table.

    python bench/bench_generation.py [--model smollm2-135m] [--n 4] [--new-tokens 128] [--concurrency 1 4 16]
        [--long 16x256] [--baseline /work/main --repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import statistics
import sys
import time
from pathlib import Path

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


def baseline_generator(checkout: Path) -> type:
    """The Generator of another checkout's decode loop (its models/decoding.py and app/engine/generation.py; every
    other module is this checkout's), so both loops run in one process on one loaded model."""

    def load(name: str, path: Path):
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while the class is built
        spec.loader.exec_module(module)
        return module

    decoding = load("baseline_decoding", checkout / "models" / "decoding.py")
    ours = sys.modules["models.decoding"]
    sys.modules["models.decoding"] = decoding  # what the baseline's `from models.decoding import ...` binds
    try:
        return load("baseline_generation", checkout / "app" / "engine" / "generation.py").Generator
    finally:
        sys.modules["models.decoding"] = ours


async def genscore_run(generator_class: type, loaded, device, texts: list[str], params: GenerationParams,
                       concurrency: int) -> tuple[float, int, list[str]]:
    """`concurrency` clients sending `texts` one after another; (seconds, tokens generated, every choice's text)."""
    generator = generator_class(loaded, Settings(model="unused", device=str(loaded.device)), device=device)
    # The generator is passive (the engine core's scheduler runs its steps when serving): here a loop of its own
    # runs a step whenever it has work, as the scheduler does with no scoring beside it.
    wake, done = asyncio.Event(), False
    generator.on_work = wake.set

    async def drive() -> None:
        while not done:
            wake.clear()
            if generator.has_work:
                await generator.run_step()
            else:
                await wake.wait()

    driver = asyncio.create_task(drive())
    await generator.warm_up()
    queue = list(enumerate(texts))
    generated = 0
    outputs: dict[tuple[int, int], str] = {}

    async def client() -> None:
        nonlocal generated
        while queue:
            number, text = queue.pop()
            ids = loaded.tokenizer(text)["input_ids"]
            async for update in generator.generate(ids, params):
                generated += len(update.token_ids)
                key = (number, update.choice)
                outputs[key] = outputs.get(key, "") + update.text

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    elapsed = time.perf_counter() - started
    done = True
    wake.set()
    await driver
    return elapsed, generated, [outputs[k] for k in sorted(outputs)]


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
    parser.add_argument("--n", type=int, default=4, help="choices per request")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--requests-per-client", type=int, default=1)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--long", default="16x256", help="one more cell: one request of n x new tokens ('' for none)")
    parser.add_argument("--baseline", type=Path, default=None,
                        help="a checkout whose decode loop runs beside this one, interleaved (instead of generate())")
    parser.add_argument("--repeats", type=int, default=1, help="passes per cell and loop (medians reported)")
    args = parser.parse_args()
    # One thread loads the model and runs every system (app/engine/device.py says why).
    device = device_thread()
    loaded = device.submit(load_model, args.model, args.device, args.dtype, Settings().cache_dir).result()
    greedy = SamplingParams(temperature=0.0)
    cells = [(f"n={args.n}, {args.new_tokens} tokens", c, c * args.requests_per_client,
              GenerationParams(max_tokens=args.new_tokens, sampling=greedy, n=args.n)) for c in args.concurrency]
    if args.long:
        n, tokens = (int(x) for x in args.long.split("x"))
        cells.append((f"n={n}, {tokens} tokens", 1, 1, GenerationParams(max_tokens=tokens, sampling=greedy, n=n)))
    loops = {"this checkout": Generator}
    if args.baseline is not None:
        loops = {f"baseline ({args.baseline})": baseline_generator(args.baseline), "this checkout": Generator}
    rows = []
    if args.baseline is None:
        texts = prompts(2)
        elapsed, generated = device.submit(transformers_run, loaded, texts, args.new_tokens).result()
        rows.append(("transformers generate, one at a time", "n=1", 1, [generated / elapsed], None))
    same_text = True
    for label, concurrency, requests, params in cells:
        texts = prompts(requests)
        rates: dict[str, list[float]] = {name: [] for name in loops}
        seen: dict[str, list[str]] = {}
        for repeat in range(args.repeats):
            order = list(loops.items()) if repeat % 2 == 0 else list(reversed(loops.items()))  # alternate who's first
            for name, generator_class in order:
                elapsed, generated, outputs = asyncio.run(
                    genscore_run(generator_class, loaded, device, texts, params, concurrency))
                rates[name].append(generated / elapsed)
                print(f"{label}, concurrency {concurrency}, {name}: {generated / elapsed:.1f} tokens/s", flush=True)
                same_text &= seen.setdefault(name, outputs) == outputs and outputs == next(iter(seen.values()))
        for name in loops:
            rows.append((f"genscore generation loop, {name}", label, concurrency, rates[name],
                         statistics.median(rates[name]) / statistics.median(rates[next(iter(loops))])))
    print(f"\n{args.model} on {loaded.device} ({str(loaded.dtype).removeprefix('torch.')}), "
          f"{torch.get_num_threads()} threads, greedy; every loop gave the same text: {same_text}\n")
    print("| system | request | concurrency | tokens/s (median) | passes | vs first row of its cell |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for system, label, concurrency, rates, ratio in rows:
        ratio_text = f"{ratio:.2f}x" if ratio is not None else ""
        print(f"| {system} | {label} | {concurrency} | {statistics.median(rates):.1f} | {len(rates)} | {ratio_text} |")
    device.shutdown()


if __name__ == "__main__":
    main()
