"""One-shot check and timing of the CUDA path, for a lent GPU machine: `python bench/cuda_check.py [--device cuda]`.

Loads the default model in float32 and bfloat16 on the device, checks forward_logits against a
plain float32 transformers computation (on the same device), times batched scoring and a GEMM,
and prints one JSON report. `--device cpu` dry-runs the same steps on a CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gemm_tflops(device, dtype, size: int, repeats: int = 10) -> float:
    import torch

    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    torch.mm(a, b)
    sync(device)
    started = time.perf_counter()
    for _ in range(repeats):
        torch.mm(a, b)
    sync(device)
    return 2 * size**3 * repeats / (time.perf_counter() - started) / 1e12


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--device", default="cuda")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--batches", type=int, default=8, help="timed batches per batch size")
    p.add_argument("--cache-dir", type=Path, default=Path(".cache/bench/weights"))
    args = p.parse_args()

    import torch

    from models import forward_logits, load_model

    report: dict = {"torch": torch.__version__, "cuda_available": torch.cuda.is_available()}
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            print(json.dumps(report))
            print("CUDA is not available to this torch build", file=sys.stderr)
            return 1
        report["gpu"] = torch.cuda.get_device_name(device)
        report["sdpa_flash"] = torch.backends.cuda.flash_sdp_enabled()
    big = 8192 if device.type == "cuda" else 1024
    report["gemm_tflops"] = {str(dt).removeprefix("torch."): gemm_tflops(device, dt, big)
                             for dt in (torch.float32, torch.bfloat16)}

    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(20, 200))] for _ in range(256)]
    labels = [rng.sample(range(100, 40000), 5) for _ in prompts]

    reference = None
    for dtype in ("float32", "bfloat16"):
        started = time.perf_counter()
        loaded = load_model(args.model, device=args.device, dtype=dtype, cache_dir=args.cache_dir)
        entry: dict = {"load_s": time.perf_counter() - started, "attn": loaded.model.config._attn_implementation}
        if reference is None:
            # Plain float32 transformers, one unpadded prompt at a time: the reference.
            with torch.inference_mode():
                reference = [
                    torch.log_softmax(loaded.model(input_ids=torch.tensor([p], device=device)).logits[0, -1].float(), -1)
                    [label_ids].cpu()
                    for p, label_ids in zip(prompts[:64], labels[:64])
                ]
        got = forward_logits(loaded.model, loaded.plan, prompts[:64], loaded.pad_token_id).log_softmax(-1).cpu()
        errors = torch.stack([(got[i, labels[i]] - reference[i]).abs().max() for i in range(64)])
        entry["err_max"] = errors.max().item()
        entry["err_p95"] = errors.quantile(0.95).item()
        for batch_size in (32, 128):
            forward_logits(loaded.model, loaded.plan, prompts[:batch_size], loaded.pad_token_id)
            sync(device)
            started = time.perf_counter()
            tokens = 0
            for b in range(args.batches):
                batch = [prompts[(b * batch_size + i) % len(prompts)] for i in range(batch_size)]
                tokens += sum(len(s) for s in batch)
                forward_logits(loaded.model, loaded.plan, batch, loaded.pad_token_id)
            sync(device)
            wall = time.perf_counter() - started
            entry[f"batch{batch_size}"] = {"prompts_per_s": args.batches * batch_size / wall,
                                           "tokens_per_s": tokens / wall}
        if device.type == "cuda":
            entry["max_memory_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
            torch.cuda.reset_peak_memory_stats(device)
        report[dtype] = entry
        del loaded
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
