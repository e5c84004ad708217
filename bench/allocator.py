"""RSS before, at the peak and after a generation-shaped workload (a growing KV cache, rows leaving) under glibc
malloc settings, and after malloc_trim(0): which setting gives memory back once the work is done."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

SETTINGS = {
    "default": {},
    "arena_max_2": {"MALLOC_ARENA_MAX": "2"},
    "mmap_threshold_1m": {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)},
    "trim_threshold_64m": {"MALLOC_TRIM_THRESHOLD_": str(64 << 20)},
    "mmap_1m_arena_2": {"MALLOC_MMAP_THRESHOLD_": str(1 << 20), "MALLOC_ARENA_MAX": "2"},
}


def _kb(name: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(name + ":"):
            return int(line.split()[1])
    raise KeyError(name)


def workload(model_spec: str, rows: int, prompt: int, steps: int) -> dict:
    """Prefill one prompt, fan it out to `rows` rows, decode `steps` steps with a row leaving every few steps."""
    import torch

    import sampler
    from models import load_model
    from models.decoding import decode_step, prefill, select_rows
    from models.memory import release_free_memory

    loaded = load_model(model_spec, device="cpu", dtype="float32", cache_dir=Path.home() / ".cache" / "genscore")
    model, pad, plan = loaded.model, loaded.pad_token_id, loaded.plan
    draw = sampler.SamplingParams(temperature=1.0, top_logprobs=5)
    before = _kb("VmRSS")
    started = time.perf_counter()
    _, batch = prefill(model, plan, [[(31 * i) % 1000 + 5 for i in range(prompt)]], pad)
    batch = select_rows(batch, [0] * rows)
    leave_every = max(steps // max(rows // 2, 1), 1)
    for step in range(steps):
        logits = decode_step(model, plan, batch, torch.full((batch.size,), 7))
        sampler.sample(logits, [draw] * batch.size, [None] * batch.size)
        sampler.score(logits, [draw] * batch.size)
        if step % leave_every == leave_every - 1 and batch.size > 1:
            batch = select_rows(batch, range(batch.size - 1))  # a row finished: the cache is re-laid out
    seconds = time.perf_counter() - started
    peak = _kb("VmHWM")
    del batch, logits
    after = _kb("VmRSS")
    trim_started = time.perf_counter()
    release_free_memory()
    trim_ms = (time.perf_counter() - trim_started) * 1000
    return {"rss_before_mb": before // 1024, "peak_mb": peak // 1024, "rss_after_mb": after // 1024,
            "rss_after_trim_mb": _kb("VmRSS") // 1024, "trim_ms": round(trim_ms, 1), "seconds": round(seconds, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--setting", action="append", choices=list(SETTINGS))
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(workload(args.model, args.rows, args.prompt, args.steps)), flush=True)
        return
    for name in args.setting or list(SETTINGS):
        env = {**os.environ, **SETTINGS[name]}
        result = subprocess.run([sys.executable, "-m", "bench.allocator", "--one", "--model", args.model,
                                 "--rows", str(args.rows), "--prompt", str(args.prompt), "--steps", str(args.steps)],
                                capture_output=True, text=True, env=env)
        lines = result.stdout.strip().splitlines()
        print(json.dumps({"setting": name, **(json.loads(lines[-1]) if lines else {"error": result.stderr[-400:]})}),
              flush=True)


if __name__ == "__main__":
    main()
