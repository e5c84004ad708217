"""What batch invariance costs: the bench's workloads through models/ with and without --batch-invariant, the two
loaded side by side and timed in alternation, so that other load on a shared machine falls on both alike.

    python -m bench.invariance_cost --dtypes float32,bfloat16 --rounds 5

Prints, per dtype and workload, the median seconds of one pass each way and their ratio, how far a batch moves a
request's label logits (batched against alone), and the label logprobs' error against plain transformers float32
one prompt at a time (max and p95). Not part of the test suite.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from bench.peak import gemm_gflops
from bench.workload import items_workload, scoring_workload
from models import forward_logits, load_model
from models.head import head_logits
from models.prefix import SuffixRow, forward_suffixes, prefill_prefixes


def _scoring_pass(loaded, requests, batch: int) -> list[torch.Tensor]:
    """Prompts in batches of `batch`, as the engine batches concurrent callers: label logprobs per request."""
    out = []
    for start in range(0, len(requests), batch):
        group = requests[start : start + batch]
        logits = forward_logits(loaded.model, loaded.plan, [r.prompts[0] for r in group], loaded.pad_token_id)  # [b, V]
        out += [row.log_softmax(-1)[r.labels] for row, r in zip(logits, group)]
    return out


@torch.inference_mode()
def _reference(plain, requests) -> list[torch.Tensor]:
    """Label logprobs of the plain float32 model, one unpadded prompt at a time, in the passes' order."""
    return [plain.model(torch.tensor([prompt])).logits[0, -1].float().log_softmax(-1)[r.labels]
            for r in requests for prompt in r.prompts]


def _items_pass(loaded, requests, batch: int) -> list[torch.Tensor]:
    """Each batch of requests: their queries prefilled once, their items over the query's states."""
    out = []
    for start in range(0, len(requests), batch):
        group = requests[start : start + batch]
        states = prefill_prefixes(loaded.model, loaded.plan, [r.query for r in group], loaded.pad_token_id)
        rows = [SuffixRow(state, tuple(item)) for state, r in zip(states, group) for item in r.items]
        logits = head_logits(loaded.plan, forward_suffixes(loaded.model, loaded.plan, rows, loaded.pad_token_id))  # [n, V]
        labels = [r.labels for r in group for _ in r.items]
        out += [row.log_softmax(-1)[lab] for row, lab in zip(logits, labels)]
    return out


def _moved(loaded, requests, run, batch: int) -> float:
    """Largest |label logprob difference| of a request batched with others against the same request alone."""
    alone = [v for r in requests for v in run(loaded, [r], 1)]
    return max((a - b).abs().max().item() for a, b in zip(alone, run(loaded, requests, batch)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--scoring-requests", type=int, default=32)
    p.add_argument("--items-requests", type=int, default=8)
    p.add_argument("--batch", type=int, default=8, help="requests per forward pass (as concurrency 8 batches)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "genscore")
    args = p.parse_args(argv)
    print(f"load average {os.getloadavg()}; GEMM GFLOP/s f32 {gemm_gflops('float32'):.0f}, "
          f"bf16 {gemm_gflops('bfloat16'):.0f}; torch threads {torch.get_num_threads()}", flush=True)
    plain = load_model(args.model, "cpu", "float32", args.cache_dir, optimize=False)
    for dtype in args.dtypes.split(","):
        both = {flag: load_model(args.model, "cpu", dtype, args.cache_dir, batch_invariant=flag) for flag in (False, True)}
        tokenizer = both[False].tokenizer
        workloads = {"scoring": (scoring_workload(tokenizer, args.scoring_requests), _scoring_pass),
                     "items": (items_workload(tokenizer, args.items_requests), _items_pass)}
        for name, (requests, run) in workloads.items():
            times: dict[bool, list[float]] = {False: [], True: []}
            for flag in (False, True):
                run(both[flag], requests, args.batch)  # warm-up
            for _ in range(args.rounds):
                for flag in (False, True):
                    started = time.perf_counter()
                    run(both[flag], requests, args.batch)
                    times[flag].append(time.perf_counter() - started)
            base, inv = statistics.median(times[False]), statistics.median(times[True])
            moved = {flag: _moved(both[flag], requests[:8], run, args.batch) for flag in (False, True)}
            reference = torch.cat(_reference(plain, requests))
            errors = {flag: (torch.cat(run(both[flag], requests, args.batch)) - reference).abs() for flag in (False, True)}
            error = {flag: f"max {e.max().item():.3g} p95 {e.quantile(0.95).item():.3g}" for flag, e in errors.items()}
            print(f"{dtype} {name}: default {base:.3f} s, invariant {inv:.3f} s, invariant/default {inv / base:.3f} "
                  f"(rounds {args.rounds}); a batch moves a label by {moved[False]:.3g} (default), "
                  f"{moved[True]:.3g} (invariant); error vs plain f32: default {error[False]}, invariant "
                  f"{error[True]}; load {os.getloadavg()[0]:.1f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
