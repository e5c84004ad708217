"""Cascade against masked attention for packed suffixes (models/cascade.py), in-process through models/: the
long-items workload's queries with their items, alternating the two plans call by call; medians of attention time
(the time inside the packed attention function) and of whole-call time, as this thread's CPU time (steady on a
machine other processes load, with --threads 1) and as wall time. Prints a markdown table.

    python -m bench.cascade_attention [--model smollm2-135m] [--requests 2] [--repeats 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import torch
from transformers import AttentionInterface

import models.packed as packed
from bench.workload import long_items_workload
from models import load_model
from models.prefix import SuffixRow, forward_suffixes, prefill_prefixes, prefill_with_suffixes


class AttentionClock:
    """This thread's CPU time and the wall time spent inside the packed attention function (CPU: every op there is
    synchronous)."""

    def __init__(self):
        self.cpu = self.wall = 0.0

    def __call__(self, *args, **kwargs):
        cpu, wall = time.thread_time(), time.perf_counter()
        try:
            return packed.packed_sdpa_attention(*args, **kwargs)
        finally:
            self.cpu += time.thread_time() - cpu
            self.wall += time.perf_counter() - wall


def main(args: argparse.Namespace) -> None:
    torch.set_grad_enabled(False)
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model, "cpu", args.dtype)
    assert loaded.plan.prefix_attention == "cascade", loaded.plan.as_dict()
    clock = AttentionClock()
    AttentionInterface.register(packed.PACKED_ATTENTION, clock)
    requests = long_items_workload(loaded.tokenizer, args.requests)
    queries = [list(r.query) for r in requests]
    rows = [(p, list(item), 1) for p, r in enumerate(requests) for item in r.items]
    model, pad = loaded.model, loaded.pad_token_id
    plans = {"masked": replace(loaded.plan, prefix_attention="masked"), "cascade": loaded.plan}
    states = prefill_prefixes(model, loaded.plan, queries, pad)

    def with_prefixes(plan):  # the queries in the same calls as their items (prefix cache miss)
        return prefill_with_suffixes(model, plan, queries, rows, pad)[1]

    def over_states(plan):  # the items over the queries' states (prefix cache hit)
        return forward_suffixes(model, plan, [SuffixRow(states[p], tuple(s), k) for p, s, k in rows], pad)

    tokens = sum(map(len, queries)) + sum(len(s) for _, s, _ in rows)
    print(f"{args.model} {args.dtype} on CPU ({args.threads} thread), {len(queries)} queries "
          f"({sum(map(len, queries))} tokens), {len(rows)} items ({tokens} tokens in all), {args.repeats} alternating "
          f"repeats, medians, ms masked -> cascade (ratio)\n")
    print("| call | clock | attention | whole call | max abs diff of hidden states |")
    print("|---|---|---:|---:|---:|")
    for name, run in (("query + items", with_prefixes), ("items over states", over_states)):
        times: dict[str, list[tuple[float, ...]]] = {v: [] for v in plans}
        outputs = {}
        for repeat in range(args.repeats + 1):  # the first round warms up
            order = list(plans) if repeat % 2 else list(reversed(plans))
            for variant in order:
                clock.cpu = clock.wall = 0.0
                cpu, wall = time.thread_time(), time.perf_counter()
                outputs[variant] = run(plans[variant])
                if repeat:
                    times[variant].append((clock.cpu, time.thread_time() - cpu, clock.wall, time.perf_counter() - wall))
        med = {v: [statistics.median(t[i] for t in ts) * 1e3 for i in range(4)] for v, ts in times.items()}
        diff = (outputs["masked"].float() - outputs["cascade"].float()).abs().max().item()
        m, c = med["masked"], med["cascade"]
        for label, i in (("thread CPU", 0), ("wall", 2)):
            print(f"| {name} | {label} | {m[i]:.0f} -> {c[i]:.0f} ({m[i] / c[i]:.2f}x) "
                  f"| {m[i + 1]:.0f} -> {c[i + 1]:.0f} ({m[i + 1] / c[i + 1]:.2f}x) | {diff:.2g} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--requests", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    main(parser.parse_args())
