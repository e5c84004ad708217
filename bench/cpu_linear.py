"""A model's linears on CPU, oneDNN's packed kernel against genscore's (models/csrc/linear.cpp): ms for every layer's
fused projections and the head at several row counts, each layer with weights of its own so that they stream from
memory as in a forward. Prints a markdown table. Needs AVX-512 (and avx512_bf16 for bfloat16).

    python -m bench.cpu_linear [--dtype bfloat16] [--layers 30] [--hidden 576] [--intermediate 1536] [--kv 192]
"""

from __future__ import annotations

import argparse

import torch

from bench.attention_cpu import ms_per_call
from models.attention_cpu import build_error
from models.cpu_features import describe_cpu
from models.prepack import kernel_refusal, onednn_packed, packed_linear

ROWS = (1, 4, 8, 16, 32, 64, 128, 512, 1224)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--kv", type=int, default=192, help="key (and value) projection width")
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    if (error := build_error(None)) is not None or (error := kernel_refusal(dtype)) is not None:
        raise SystemExit(f"genscore's linear does not run here in {args.dtype}: {error}")
    h, i = args.hidden, args.intermediate
    # a layer's Q/K/V and gate/up fused (models/fused_linears.py), its output and down projections; then the head
    shapes = [(h + 2 * args.kv, h), (2 * i, h), (h, h), (h, i)] * args.layers + [(args.vocab, h)]
    weights = [torch.randn(out, features).to(dtype) for out, features in shapes]
    onednn = [onednn_packed(w) for w in weights]
    blocks = [torch.ops.genscore_cpu.pack_linear_weight(w) for w in weights]
    flops_per_row = 2 * sum(w.numel() for w in weights)
    print(f"{describe_cpu()}, {args.dtype}, {args.threads} threads, "
          f"{sum(w.numel() * w.element_size() for w in weights) / 1e6:.0f} MB of weights\n")
    print("| rows | oneDNN ms | genscore ms | oneDNN GFLOP/s | genscore GFLOP/s | genscore ÷ oneDNN |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for rows in ROWS:
        x = {f: torch.randn(rows, f).to(dtype) for f in {h, i}}  # [rows, in]
        theirs = ms_per_call(lambda x=x: [torch.ops.mkldnn._linear_pointwise(x[w.shape[1]], w, None, "none", [], "")
                                          for w in onednn], args.repeats)
        ours = ms_per_call(lambda x=x: [packed_linear(x[w.shape[1] * w.shape[3]], w, None)
                                        for w in blocks], args.repeats)
        rate = rows * flops_per_row / 1e6  # MFLOP a pass; over ms: GFLOP/s
        print(f"| {rows} | {theirs:.2f} | {ours:.2f} | {rate / theirs:.0f} | {rate / ours:.0f} "
              f"| {theirs / ours:.2f}× |")


if __name__ == "__main__":
    main()
