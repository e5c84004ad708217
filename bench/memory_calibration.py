"""Measured peak RSS growth of each kind of engine work (scoring forward, shared-prefix pass, prefill, decode steps,
merge and select) in a fresh process per shape, next to models/memory.py's estimate of it."""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

# (operation, rows, tokens per row, kept per row); decode shapes read tokens as the prompt width and kept as steps
SHAPES = {
    "forward": [(1, 1024, 1), (64, 64, 1), (256, 64, 1), (1024, 16, 1), (1, 2048, 2047), (1, 8000, 512)],
    "suffixes": [(64, 64, 1), (512, 16, 1)],
    "decode": [(8, 256, 8), (64, 256, 8), (128, 300, 16)],
    "select": [(64, 256, 1), (128, 300, 1)],
}


def _status_kb(name: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(name + ":"):
            return int(line.split()[1])
    raise KeyError(name)


def _start_measuring() -> int:
    from models.memory import release_free_memory

    release_free_memory()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    return _status_kb("VmRSS") * 1024


def _peak_since(before: int) -> int:
    return _status_kb("VmHWM") * 1024 - before


def run_one(model_spec: str, dtype: str, operation: str, rows: int, tokens: int, kept: int) -> dict:
    """In this process: load the model, warm every kernel once, then measure one operation's peak RSS growth."""
    import torch

    import sampler
    from models import load_model
    from models.decoding import decode_step, merge, prefill, select_rows
    from models.forward import forward_logits
    from models.head import head_logits
    from models.memory import MemoryModel
    from models.prefix import SuffixRow, forward_suffixes
    from models.prefix import prefill_prefixes as prefix_prefill

    loaded = load_model(model_spec, device="cpu", dtype=dtype, cache_dir=Path.home() / ".cache" / "genscore")
    memory = MemoryModel.of(loaded)
    model, pad, plan = loaded.model, loaded.pad_token_id, loaded.plan
    vocab = loaded.vocab_size
    ids = lambda n, seed: [(seed * 7919 + 31 * i) % (vocab - 10) + 5 for i in range(n)]  # noqa: E731
    labels = sampler.SamplingParams(label_token_ids=tuple(range(min(1024, vocab))), top_logprobs=20)
    forward_logits(model, plan, [ids(8, 0)], pad)  # first call pays oneDNN's and SDPA's one-off allocations
    decode_batch = None
    if operation in ("decode", "select"):
        _, decode_batch = prefill(model, plan, [ids(tokens, 0)], pad)
        decode_batch = select_rows(decode_batch, [0] * rows)
        decode_step(model, plan, select_rows(decode_batch, [0]), torch.tensor([5]))
    before = _start_measuring()
    if operation == "forward":
        logits = forward_logits(model, plan, [ids(tokens, r) for r in range(rows)], pad, [kept] * rows)  # [rows*kept, V]
        sampler.to_rows(sampler.score(logits, [labels] * logits.shape[0]), [labels] * logits.shape[0])
        estimate = memory.forward_bytes(rows, rows * tokens, rows * kept)
    elif operation == "suffixes":
        prefix_len = 64
        (state,) = prefix_prefill(model, plan, [ids(prefix_len, 0)], pad)
        hidden = forward_suffixes(model, plan, [SuffixRow(state, tuple(ids(tokens, r)), 1) for r in range(rows)], pad)
        logits = head_logits(plan, hidden)
        sampler.to_rows(sampler.score(logits, [labels] * rows), [labels] * rows)
        estimate = memory.forward_bytes(rows, rows * (prefix_len + tokens), rows)
    elif operation == "decode":
        steps = kept
        batch = decode_batch
        draw = sampler.SamplingParams(temperature=1.0, top_p=0.9, top_logprobs=20)
        for _ in range(steps):
            logits = decode_step(model, plan, batch, torch.full((rows,), 5))
            sampler.sample(logits, [draw] * rows, [None] * rows)
            sampler.score(logits, [draw] * rows)
        # a newcomer joins: the running cache is merged with its one row
        batch = merge(batch, select_rows(decode_batch, [0]))
        width = tokens + 1 + steps
        estimate = memory.cache_bytes(rows + 1, width) + memory.decode_step_bytes(rows + 1, width)
        estimate -= rows * tokens * memory.kv_bytes_per_token  # the cache that existed before measuring
    else:  # select: half the rows finish
        batch = select_rows(decode_batch, list(range(0, rows, 2)))
        estimate = memory.cache_bytes(rows, tokens + 1) - rows * (tokens + 1) * memory.kv_bytes_per_token
    measured = _peak_since(before)
    return {"model": model_spec, "dtype": dtype, "operation": operation, "rows": rows, "tokens": tokens,
            "kept": kept, "measured_mb": round(measured / 2**20, 1), "estimate_mb": round(estimate / 2**20, 1),
            "ok": estimate >= measured, "memory_model": dataclasses.asdict(memory)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", action="append", default=None)
    parser.add_argument("--operation", action="append", default=None, choices=list(SHAPES))
    parser.add_argument("--one", nargs=6, metavar=("MODEL", "DTYPE", "OP", "ROWS", "TOKENS", "KEPT"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        model, dtype, op, rows, tokens, kept = args.one
        print(json.dumps(run_one(model, dtype, op, int(rows), int(tokens), int(kept))), flush=True)
        return
    for dtype in args.dtype or ["float32", "bfloat16"]:
        for op in args.operation or list(SHAPES):
            for rows, tokens, kept in SHAPES[op]:
                result = subprocess.run([sys.executable, "-m", "bench.memory_calibration", "--one", args.model, dtype,
                                         op, str(rows), str(tokens), str(kept)], capture_output=True, text=True)
                line = result.stdout.strip().splitlines()[-1:] or [json.dumps({"error": result.stderr[-500:]})]
                print(line[0], flush=True)


if __name__ == "__main__":
    main()
