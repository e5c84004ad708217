"""Where one packed scoring batch spends its time: torch's profiler over repeated forwards of a batch of `short`
prompts through models/, each op's self time summed into linears, attention, element-wise ops and the rest, and the
time no op accounts for (Python and dispatch between kernels). Prints markdown tables.

    python -m bench.profile_batch [--dtype bfloat16] [--batch 32] [--repeats 5] [--top 15] [--compile]
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

# Ops by what they compute; an op in none of these is "other". Self times only, so a composite op (aten::linear,
# aten::matmul) counts just its own dispatch and the kernel under it counts once.
CATEGORIES = {
    "linear": ("mkldnn::_linear_pointwise", "aten::addmm", "aten::mm", "aten::bmm", "aten::linear", "aten::matmul",
               "genscore::prepacked_linear", "genscore_cpu::packed_linear"),
    "attention": ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::scaled_dot_product_attention",
                  "aten::_scaled_dot_product_attention_math", "genscore::packed_attention",
                  "genscore::segment_attention", "genscore_cpu::varlen_attention",
                  "genscore_cpu::decode_attention"),
    "element-wise": ("aten::mul", "aten::add", "aten::add_", "aten::sub", "aten::neg", "aten::rsqrt", "aten::pow",
                     "aten::mean", "aten::silu", "aten::cat", "aten::copy_", "aten::_to_copy", "aten::to",
                     "aten::div", "aten::cos", "aten::sin", "aten::exp", "aten::clone", "aten::contiguous",
                     "aten::empty_like", "aten::fill_", "aten::where", "aten::index_select", "aten::embedding"),
}


def category(op: str) -> str:
    return next((name for name, ops in CATEGORIES.items() if op in ops), "other")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="genscore --model value")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, default=32, help="`short` prompts in the batch")
    parser.add_argument("--repeats", type=int, default=5, help="profiled forwards")
    parser.add_argument("--top", type=int, default=15, help="ops listed by self time")
    parser.add_argument("--compile", action="store_true", help="load with --compile (compiled decoder layers)")
    args = parser.parse_args()

    torch.set_grad_enabled(False)
    from bench.workload import short_workload
    from models import load_model
    from models.forward import forward_logits

    loaded = load_model(args.model, "cpu", args.dtype, compile=args.compile)
    model, plan, pad = loaded.model, loaded.plan, loaded.pad_token_id
    prompts = [r.prompts[0] for r in short_workload(loaded.tokenizer, args.batch, seed=2)]
    tokens = sum(len(p) for p in prompts)
    for _ in range(2):
        forward_logits(model, plan, prompts, pad)  # warm-up: first-call allocations and kernel selection

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        started = time.perf_counter()
        for _ in range(args.repeats):
            forward_logits(model, plan, prompts, pad)
        wall = (time.perf_counter() - started) / args.repeats

    per_op: dict[str, tuple[float, int]] = {}
    for event in prof.key_averages():
        if event.self_cpu_time_total > 0:
            per_op[event.key] = (event.self_cpu_time_total / 1e6 / args.repeats, event.count // args.repeats)
    by_category: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    for op, (seconds, count) in per_op.items():
        by_category[category(op)] += seconds
        calls[category(op)] += count
    accounted = sum(by_category.values())

    compiled = ", compiled layers" if plan.compiled else ""
    print(f"{args.model}, {args.dtype}{compiled}, {args.batch} `short` prompts ({tokens} tokens), layout {plan.layout}, "
          f"torch {torch.__version__} with {torch.get_num_threads()} threads; one forward {wall * 1e3:.1f} ms "
          f"({args.batch / wall:.1f} prompts/s), mean of {args.repeats}\n")
    print("| part | ms a forward | share | op calls a forward |")
    print("| --- | ---: | ---: | ---: |")
    for name in (*CATEGORIES, "other"):
        print(f"| {name} | {by_category[name] * 1e3:.1f} | {by_category[name] / wall:.0%} | {calls[name]} |")
    rest = max(wall - accounted, 0.0)
    print(f"| between ops (Python, dispatch) | {rest * 1e3:.1f} | {rest / wall:.0%} | |\n")
    print("| op | part | ms a forward | calls | µs a call |")
    print("| --- | --- | ---: | ---: | ---: |")
    for op, (seconds, count) in sorted(per_op.items(), key=lambda kv: -kv[1][0])[:args.top]:
        print(f"| `{op}` | {category(op)} | {seconds * 1e3:.2f} | {count} | {seconds / max(count, 1) * 1e6:.0f} |")


if __name__ == "__main__":
    main()
