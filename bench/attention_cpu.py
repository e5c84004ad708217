"""One layer's packed attention on CPU, the per-segment SDPA loop against genscore's kernel (models/attention_cpu.py):
ms a call and the largest difference from float64 SDPA, over rows of prompts of several lengths. Prints a markdown
table; the kernel's MAX_SEGMENT is where it stops winning.

    python -m bench.attention_cpu [--heads 9] [--kv-heads 3] [--head-dim 64] [--threads 2] [--repeats 30]
"""

from __future__ import annotations

import argparse
import random
import time

import torch
import torch.nn.functional as F

from models.attention_cpu import build_error
from models.packed import LOOP, packed_ends, segment_attention

# (shortest, longest, prompts in the row): `short`'s prompts, then longer ones up to one long prompt alone.
ROWS = ((23, 51, 32), (100, 200, 8), (196, 351, 8), (384, 384, 4), (1000, 1000, 1))


def ms_per_call(call, repeats: int) -> float:
    """Mean ms of `call` over `repeats` calls, after three to warm up."""
    for _ in range(3):
        call()
    started = time.perf_counter()
    for _ in range(repeats):
        call()
    return (time.perf_counter() - started) / repeats * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    if (error := build_error(None)) is not None:
        raise SystemExit(error)
    torch.set_num_threads(args.threads)
    random.seed(0)
    heads, kv_heads, dim = args.heads, args.kv_heads, args.head_dim
    print(f"{heads}/{kv_heads} heads × {dim}, torch {torch.__version__} with {args.threads} threads")
    print("| dtype | prompts | tokens | loop ms | kernel ms | loop ÷ kernel | loop max diff | kernel max diff |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for dtype in (torch.float32, torch.bfloat16):
        for shortest, longest, prompts in ROWS:
            lengths = [random.randint(shortest, longest) for _ in range(prompts)]
            loop_ms, kernel_ms, loop_diff, kernel_diff = _measure(dtype, lengths, heads, kv_heads, dim, args.repeats)
            print(f"| {str(dtype).removeprefix('torch.')} | {prompts} of {shortest}–{longest} | {sum(lengths)} | "
                  f"{loop_ms:.2f} | {kernel_ms:.2f} | {loop_ms / kernel_ms:.2f}× | {loop_diff:.1e} | {kernel_diff:.1e} |")


def _measure(dtype: torch.dtype, lengths: list[int], heads: int, kv_heads: int, dim: int, repeats: int
             ) -> tuple[float, float, float, float]:
    """ms a call of the loop and of the kernel over one row of `lengths`, and each one's largest difference from
    float64 SDPA."""
    bounds = [0, *packed_ends(lengths)]
    tokens = bounds[-1]
    # as a layer holds them: [1, heads, T, D] views of [1, T, heads, D]
    q = torch.randn(1, tokens, heads, dim).to(dtype).transpose(1, 2)
    k = torch.randn(1, tokens, kv_heads, dim).to(dtype).transpose(1, 2)
    v = torch.randn(1, tokens, kv_heads, dim).to(dtype).transpose(1, 2)
    cu = torch.tensor(bounds, dtype=torch.int32)

    def loop():
        return segment_attention(q, k, v, None, cu, bounds, max(lengths), heads // kv_heads, None, None, LOOP)

    def kernel():  # the op itself, over every segment whatever its length (max_segment 0)
        return torch.ops.genscore_cpu.varlen_attention(
            q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu, None, dim ** -0.5, 0, 0)[None]

    exact = torch.cat([F.scaled_dot_product_attention(
        q[:, :, a:b].double(), k[:, :, a:b].double(), v[:, :, a:b].double(), is_causal=True,
        enable_gqa=True).transpose(1, 2) for a, b in zip(bounds[:-1], bounds[1:])], dim=1)  # [1, T, H, D]
    loop_diff = (loop().double() - exact).abs().max().item()
    kernel_diff = (kernel().double() - exact).abs().max().item()
    return ms_per_call(loop, repeats), ms_per_call(kernel, repeats), loop_diff, kernel_diff


if __name__ == "__main__":
    main()
