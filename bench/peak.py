"""The machine's matmul rate (GEMM GFLOP/s per dtype, measured in the same run) and the model FLOPs a workload needs."""

from __future__ import annotations

import time


def gemm_gflops(dtype_name: str, size: int = 2048, repeats: int = 5) -> float:
    """Best-of-`repeats` GFLOP/s of a [size, size] x [size, size] matmul with torch's default threads."""
    import torch

    dtype = getattr(torch, dtype_name)
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    torch.mm(a, b)  # first call pays for packing / kernel selection
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - started)
    return 2 * size**3 / best / 1e9


def prompt_flops(tokens: int, model: dict) -> float:
    """Useful FLOPs to score one prompt of `tokens` tokens: every system does this much work at least.

    2 x non-embedding parameters per token (the linear layers), causal attention
    (QK^T and AV: 2 x 2 x layers x hidden x T^2 / 2), and lm_head on the last position only.
    """
    linear = 2 * model["body_params"] * tokens
    attention = 2 * model["layers"] * model["hidden"] * tokens * tokens
    lm_head = 2 * model["vocab"] * model["hidden"]
    return linear + attention + lm_head
