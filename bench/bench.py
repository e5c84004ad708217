"""The side-by-side benchmark: naive transformers loop, llama-server, genscore over HTTP (float32, bfloat16) and in-process.

One command (`make bench`, or `python -m bench.bench`) drives the same deterministic workloads
through every system at each concurrency and writes docs/benchmark.md, docs/benchmark.json and
docs/benchmark.png. Not part of the test suite.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import report
from bench.loop import closed_loop
from bench.peak import gemm_gflops
from bench.servers import (
    GenscoreClient,
    LlamaClient,
    find_llama_server,
    genscore_load_seconds,
    start_genscore,
    start_llama,
)
from bench.workload import items_workload, scoring_workload

REPO = Path(__file__).resolve().parent.parent


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="genscore --model value (default: the bundled GGUF)")
    p.add_argument("--scoring-requests", type=int, default=64, help="requests per cell, scoring workload")
    p.add_argument("--items-requests", type=int, default=16, help="requests per cell, query-with-items workload")
    p.add_argument("--concurrency", default="1,8,32", help="comma-separated concurrency levels")
    p.add_argument("--systems", default="naive,inprocess,genscore,llama",
                   help="which systems to run (naive, inprocess, genscore, llama)")
    p.add_argument("--dtypes", default="float32,bfloat16", help="genscore dtypes")
    p.add_argument("--batch-invariant", action="store_true",
                   help="run genscore with --batch-invariant (its systems are named '... invariant')")
    p.add_argument("--llama-server", default=None, help="llama-server binary (default: .cache/bench/bin, then PATH)")
    p.add_argument("--llama-slots", type=int, default=8, help="llama-server parallel slots")
    p.add_argument("--llama-top-k", type=int, default=20, help="n_probs asked of llama-server")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="llama-server threads")
    p.add_argument("--warmup", type=int, default=2, help="untimed requests before each cell")
    p.add_argument("--repeats", type=int, default=2, help="timed passes per cell; the fastest is reported")
    p.add_argument("--cache-dir", type=Path, default=REPO / ".cache" / "bench" / "weights",
                   help="genscore's converted-weights cache for the benchmark")
    p.add_argument("--out", type=Path, default=REPO / "docs", help="where benchmark.md/.json/.png go")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')} load {os.getloadavg()[0]:.2f}] {message}", flush=True)


def machine_facts() -> dict:
    import torch

    flags = ""
    with open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("flags"):
                flags = line
                break
    model_name = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                      platform.processor())
    return {
        "cpu": model_name,
        "cores": os.cpu_count(),
        "avx512_bf16": "avx512_bf16" in flags,
        "amx_bf16": "amx_bf16" in flags,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
    }


def run_worker(kind: str, spec: dict, tmp: Path) -> dict:
    spec_path, out_path = tmp / f"{kind}-spec.json", tmp / f"{kind}-out.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    subprocess.run([sys.executable, "-m", "bench.workers", kind, str(spec_path), str(out_path)], check=True,
                   cwd=REPO, env=env)
    return json.loads(out_path.read_text())


def worker_workloads(workloads: dict) -> dict:
    return {name: [{"prompts": r.prompts, "labels": r.labels, "body": r.score_body()} for r in reqs]
            for name, reqs in workloads.items()}


async def drive(make_client, workloads: dict, concurrency: list[int], warmup: int, repeats: int) -> dict:
    runs: dict = {}
    for name, requests in workloads.items():
        runs[name] = {}
        for level in concurrency:
            client = make_client(level)
            try:
                result = await closed_loop(client, requests, level, warmup=warmup, repeats=repeats)
            finally:
                await client.aclose()
            runs[name][str(level)] = result.__dict__
            log(f"  {name} c={level}: {sum(len(r.prompts) for r in requests) / result.wall_s:.1f} prompts/s")
    return runs


def main(argv=None) -> int:
    args = parse_args(argv)
    concurrency = [int(c) for c in args.concurrency.split(",")]
    systems = set(args.systems.split(","))
    dtypes = args.dtypes.split(",")
    started = time.perf_counter()
    results: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "machine": machine_facts(),
                     "loadavg_start": os.getloadavg(), "systems": {}}
    log("measuring the matmul peak")
    results["gemm_gflops"] = {dtype: gemm_gflops(dtype) for dtype in ("float32", "bfloat16")}
    log(f"GEMM GFLOP/s: {results['gemm_gflops']}")

    from transformers import AutoTokenizer

    from models.loading import resolve_source

    source = resolve_source(args.model)
    tokenizer = AutoTokenizer.from_pretrained(source.location, gguf_file=source.gguf_file)
    workloads = {
        "scoring": scoring_workload(tokenizer, args.scoring_requests, seed=args.seed),
        "items": items_workload(tokenizer, args.items_requests, seed=args.seed + 1),
    }
    for name, reqs in workloads.items():
        log(f"workload {name}: {len(reqs)} requests, {sum(len(r.prompts) for r in reqs)} prompts, "
            f"{sum(r.tokens for r in reqs)} tokens")
    results["workloads"] = {name: {"requests": len(reqs), "prompts": [len(r.prompts) for r in reqs],
                                   "tokens": [[len(p) for p in r.prompts] for r in reqs],
                                   "labels": [len(r.labels) for r in reqs]} for name, reqs in workloads.items()}

    with tempfile.TemporaryDirectory(prefix="genscore-bench-") as tmp_name:
        tmp = Path(tmp_name)
        base_spec = {"model": args.model, "cache_dir": str(args.cache_dir), "workloads": worker_workloads(workloads),
                     "warmup": args.warmup, "repeats": args.repeats}
        # Always run: its numbers are the float32 reference every system is compared with. It also
        # fills the weights cache, so every genscore start below is a start "after the first run".
        log("naive transformers loop (float32, one prompt at a time): the reference")
        naive = run_worker("naive", base_spec, tmp)
        results["model"] = naive.pop("model")
        results["reference"] = {name: runs["1"]["values"] for name, runs in naive["runs"].items()}
        if "naive" in systems:
            results["systems"]["naive transformers f32"] = dict(naive, dtype="float32")

        for dtype in dtypes:
            short = {"float32": "f32", "bfloat16": "bf16"}.get(dtype, dtype)
            if args.batch_invariant:
                short += " invariant"
            if "inprocess" in systems:
                log(f"genscore Engine in-process ({dtype})")
                out = run_worker("engine", dict(base_spec, dtype=dtype, concurrency=concurrency,
                                                batch_invariant=args.batch_invariant), tmp)
                results["systems"][f"genscore in-process {short}"] = dict(out, dtype=dtype)
            if "genscore" in systems:
                log(f"genscore over HTTP ({dtype})")
                server = start_genscore(args.model, dtype, args.cache_dir, args.cache_dir.parent / f"genscore-{dtype}.log",
                                        batch_invariant=args.batch_invariant)
                try:
                    runs = asyncio.run(drive(lambda c, url=server.base_url: GenscoreClient(url, c), workloads,
                                             concurrency, args.warmup, args.repeats))
                    results["systems"][f"genscore HTTP {short}"] = {
                        "dtype": dtype, "runs": runs, "peak_rss_mb": server.peak_rss_mb(), "ready_s": server.ready_s,
                        "load_s": genscore_load_seconds(server.log_path)}
                finally:
                    server.stop()

        binary = find_llama_server(args.llama_server, REPO)
        if "llama" in systems and binary is None:
            log("llama-server not found: run `make bench-peers` to build it; skipping")
        elif "llama" in systems:
            gguf = Path(source.location) / source.gguf_file if source.gguf_file else None
            log(f"llama-server {binary} on {gguf} ({args.llama_slots} slots, top-{args.llama_top_k})")
            server = start_llama(binary, gguf, args.llama_slots, 1024, args.threads,
                                 args.cache_dir.parent / "llama-server.log")
            try:
                runs = asyncio.run(drive(lambda c, url=server.base_url: LlamaClient(url, c, args.llama_top_k),
                                         workloads, concurrency, args.warmup, args.repeats))
                results["systems"]["llama-server"] = {"dtype": f"GGUF {source.gguf_file}", "runs": runs,
                                                      "peak_rss_mb": server.peak_rss_mb(), "ready_s": server.ready_s}
            finally:
                server.stop()

    # Measured again at the end; the higher of the two is the peak (other load only ever lowers it).
    for dtype, first in list(results["gemm_gflops"].items()):
        results["gemm_gflops"][dtype] = max(first, gemm_gflops(dtype))
    log(f"GEMM GFLOP/s (best of start and end): {results['gemm_gflops']}")
    results["loadavg_end"] = os.getloadavg()
    results["total_s"] = time.perf_counter() - started
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "benchmark.json").write_text(json.dumps(results))
    summary = report.summarise(results)
    (args.out / "benchmark.md").write_text(report.markdown(results, summary))
    chart = report.chart(summary, args.out / "benchmark.png")
    log(f"wrote {args.out / 'benchmark.md'}" + (f" and {chart}" if chart else " (no chart: pip install matplotlib)"))
    print(report.headline(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
