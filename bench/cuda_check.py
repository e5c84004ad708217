"""One-shot check and measurement of the CUDA path on a lent GPU machine: `python bench/cuda_check.py --out DIR`.

Sections (--sections, all by default): env; gemm (the bf16 and fp32 matmul peaks); varlen (the packed-attention op's
varlen kernel against the per-segment loop on the same inputs: max |difference| and ms); cascade (packed suffixes'
attention: masked loop, varlen over gathered keys, cascade; max |difference| and ms); then per model (`model`:
--model, a GGUF file, a bundled name or an HF folder, random weights for a folder without any; `gemma`:
Gemma-3-270M's shape with random weights): accuracy against plain float32 transformers (max and p95 over each
prompt's top-20 tokens), in-process throughput with and without varlen, kernels (profiler) and syncs (sync debug
mode and the op counter) of one forward, the GEMM roofline share, mem_get_info against the memory budget; http:
/score over HTTP at concurrency 1, 8, 32 on short, items and long-items; engine: the same Engine without HTTP, with
the device thread's busy share and profiles. Results go to DIR/cuda_check.json after every section (a run cut
short keeps what it measured). `--device cpu --dtypes float32` dry-runs every step on small sizes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
import traceback
import warnings
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

TOP = 20  # accuracy is measured over each prompt's top-20 tokens under the float32 reference


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_ms(device, fn, repeats: int = 10) -> float:
    """Median wall time of fn in ms, the device synchronised around each call."""
    fn()
    sync(device)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def gemm_tflops(device, dtype, size: int, repeats: int = 10) -> float:
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    ms = timed_ms(device, lambda: torch.mm(a, b), repeats)
    return 2 * size**3 / (ms / 1e3) / 1e12


def section_env(args, device) -> dict:
    import transformers

    from models.attention_cuda import _varlen

    found = _varlen()
    out = {"torch": torch.__version__, "transformers": transformers.__version__, "device": str(device),
           "varlen_attn_params": sorted(found[1]) if found else None}
    if device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(device)
        free, total = torch.cuda.mem_get_info(device)
        out["mem_free_gib"], out["mem_total_gib"] = free / 2**30, total / 2**30
    return out


def section_gemm(args, device) -> dict:
    size = 8192 if device.type == "cuda" else 512
    torch.backends.cuda.matmul.allow_tf32 = False
    return {"size": size, "bf16_tflops": gemm_tflops(device, torch.bfloat16, size),
            "fp32_tflops": gemm_tflops(device, torch.float32, size)}


def _row(lengths, window, heads, kv_heads, dim, device, dtype, generator):
    """Random q, k, v of a packed row, its banded mask (the model's row mask for a sliding window), boundaries."""
    from models.packed import packed_ends

    total = sum(lengths)
    q = torch.randn(1, heads, total, dim, generator=generator).to(device, dtype)
    k = torch.randn(1, kv_heads, total, dim, generator=generator).to(device, dtype)
    v = torch.randn(1, kv_heads, total, dim, generator=generator).to(device, dtype)
    mask = None
    if window is not None:
        i = torch.arange(total)[:, None]
        j = torch.arange(total)[None]
        mask = ((j <= i) & (i - j < window))[None, None].to(device)  # [1, 1, T, T]
    bounds = [0, *packed_ends(lengths)]
    return q, k, v, mask, bounds


def section_varlen(args, device) -> dict:
    """The varlen kernel against the per-segment loop on the same packed rows (bf16; SmolLM2 and Gemma-3 heads)."""
    import random

    from models.attention_cuda import VARLEN
    from models.packed import LOOP, segment_attention

    rng = random.Random(0)
    generator = torch.Generator().manual_seed(0)
    shapes = {"smollm2 (9/3 heads x 64)": (9, 3, 64, None), "gemma3 (4/1 heads x 256, window 512)": (4, 1, 256, 512)}
    rows = {"32 short (23-51)": [rng.randint(23, 51) for _ in range(32)],
            "8 x (query 150-400 + 30 items)": [rng.randint(150, 400) if i % 31 == 0 else rng.randint(8, 30)
                                                for i in range(8 * 31)]}
    out = []
    for shape, (heads, kv_heads, dim, window) in shapes.items():
        for row_name, lengths in rows.items():
            q, k, v, mask, bounds = _row(lengths, window, heads, kv_heads, dim, device, torch.bfloat16, generator)
            cu = torch.tensor(bounds, dtype=torch.int32, device=device)

            def run(kernel, q=q, k=k, v=v, mask=mask, bounds=bounds, cu=cu, lengths=lengths, window=window,
                    groups=heads // kv_heads):
                return segment_attention(q, k, v, mask, cu, bounds, max(lengths), groups, None, window, kernel)

            loop = run(LOOP)
            fast = run(VARLEN)
            out.append({"shape": shape, "row": row_name, "tokens": sum(lengths),
                        "max_abs_diff": (loop.float() - fast.float()).abs().max().item(),
                        "loop_ms": timed_ms(device, lambda run=run: run(LOOP)),
                        "varlen_ms": timed_ms(device, lambda run=run: run(VARLEN))})
    return {"rows": out}


def section_cascade(args, device) -> dict:
    """Packed suffixes over their queries' states (models/prefix.py's call): attention as SDPA under the row's mask
    per group (the loop), varlen over keys gathered per segment, and cascade attention (models/cascade.py); each
    against a float32 run of the loop (max |difference|) and ms, bf16 (float32 on CPU, where varlen does not run)."""
    import random

    from models.attention_cuda import VARLEN, runs_varlen_on
    from models.packed import LOOP, _AttentionLayer, packed_row, packed_sdpa_attention
    from models.prefix import _Segments

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rng = random.Random(0)
    generator = torch.Generator().manual_seed(0)
    queries = [rng.randint(150, 400) for _ in range(8)]
    starts = [sum(queries[:i]) for i in range(len(queries))]
    items = [(p, rng.randint(8, 30)) for p in range(len(queries)) for _ in range(30)]
    lengths = [n for _, n in items]
    spans = [(starts[p], starts[p] + queries[p]) for p, _ in items]
    past, total = sum(queries), sum(lengths)
    segments = _Segments(lengths, spans, [queries[p] for p, _ in items])
    mask = segments.mask(past)[None, None].to(device)  # [1, 1, T, past + T]
    out = []
    for shape, (heads, kv_heads, dim) in {"smollm2 (9/3 heads x 64)": (9, 3, 64),
                                          "gemma3 (4/1 heads x 256)": (4, 1, 256)}.items():
        q = torch.randn(1, heads, total, dim, generator=generator).to(device)
        k = torch.randn(1, kv_heads, past + total, dim, generator=generator).to(device)
        v = torch.randn(1, kv_heads, past + total, dim, generator=generator).to(device)

        def run(kernel, cascade, q=q, k=k, v=v, groups=heads // kv_heads, dtype=dtype, scaling=dim ** -0.5):
            row = packed_row(device, kernel, lengths, spans, own_mask=True, past=past, cascade=cascade)
            return packed_sdpa_attention(_AttentionLayer(groups), q.to(dtype), k.to(dtype), v.to(dtype),
                                         None if cascade else mask, packed_row=row, scaling=scaling)[0]

        exact = run(LOOP, False, dtype=torch.float32).float()
        variants = {"masked_loop": (LOOP, False)}
        if runs_varlen_on(device):
            variants.update(gathered_varlen=(VARLEN, False), cascade_varlen=(VARLEN, True))
        else:
            variants["cascade_cpu"] = (LOOP, True)
        entry: dict = {"shape": shape, "query_tokens": past, "item_tokens": total}
        for name, (kernel, cascade) in variants.items():
            try:
                entry[f"{name}_max_abs_diff"] = (run(kernel, cascade).float() - exact).abs().max().item()
                entry[f"{name}_ms"] = timed_ms(device, lambda kernel=kernel, cascade=cascade: run(kernel, cascade))
            except Exception as exc:  # noqa: BLE001 - one variant that cannot run must not cost the others
                entry[f"{name}_error"] = f"{type(exc).__name__}: {exc}"
        out.append(entry)
    return {"dtype": str(dtype).removeprefix("torch."), "rows": out}


def _reference(spec: str, cache_dir: Path, device, prompts) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Plain float32 transformers (no fast path), one unpadded prompt at a time: last-position logprobs [V] and the
    ids of each prompt's top-20 tokens."""
    from models import load_model

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    plain = load_model(spec, device=str(device), dtype="float32", cache_dir=cache_dir, optimize=False)
    logprobs = []
    with torch.inference_mode():
        for p in prompts:
            logits = plain.model(input_ids=torch.tensor([p], device=device)).logits[0, -1].float()
            logprobs.append(torch.log_softmax(logits, -1).cpu())
    del plain
    torch.cuda.empty_cache() if device.type == "cuda" else None
    return logprobs, [lp.topk(TOP).indices for lp in logprobs]


def _accuracy(loaded, plan, prompts, reference, top_ids) -> dict:
    from models import forward_logits

    got = forward_logits(loaded.model, plan, prompts, loaded.pad_token_id).float().log_softmax(-1).cpu()  # [N, V]
    diffs = torch.cat([(got[i, top_ids[i]] - reference[i][top_ids[i]]).abs() for i in range(len(prompts))])
    return {"max": diffs.max().item(), "p95": diffs.quantile(0.95).item()}


def _counts(loaded, plan, prompts, device) -> dict:
    """One forward of the batch plus the sampler: ops and syncs counted by dispatch, CUDA kernels by the profiler,
    syncs by torch's sync debug mode."""
    import sampler
    from models import forward_logits
    from models.op_count import OpCounter
    from sampler import SamplingParams

    params = [SamplingParams(label_token_ids=(1, 2, 3), top_logprobs=TOP)] * len(prompts)

    def step():
        logits = forward_logits(loaded.model, plan, prompts, loaded.pad_token_id)
        return sampler.score(logits, params)

    step()
    with OpCounter() as counter:
        step()
    out = {"ops": counter.counts.kernels, "op_syncs": counter.counts.syncs,
           "op_sync_names": dict(counter.counts.sync_names)}
    if device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        sync(device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            sync(device)
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        out["cuda_kernels"] = len(kernels)
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        out["sync_debug_warnings"] = len(caught)
        out["sync_debug_sites"] = sorted({str(w.message).splitlines()[0][:100] for w in caught})[:8]
    return out


def _throughput(loaded, plan, prompts, device, batch: int = 32, repeats: int = 5) -> dict:
    """In-process: forward_logits + the sampler over `prompts` in batches of `batch`, best of `repeats` passes."""
    import sampler
    from models import forward_logits
    from sampler import SamplingParams

    params = SamplingParams(label_token_ids=(1, 2, 3))

    def one_pass():
        for start in range(0, len(prompts), batch):
            chunk = prompts[start : start + batch]
            logits = forward_logits(loaded.model, plan, chunk, loaded.pad_token_id)
            sampler.to_rows(sampler.score(logits, [params] * len(chunk)), [params] * len(chunk))

    ms = min(timed_ms(device, one_pass, 1) for _ in range(repeats))
    tokens = sum(len(p) for p in prompts)
    return {"prompts_per_s": len(prompts) / (ms / 1e3), "tokens_per_s": tokens / (ms / 1e3), "pass_ms": ms}


def _memory(loaded, device) -> dict:
    from app.engine.budget import MemoryBudget, baseline_bytes
    from models.memory import MemoryModel, default_memory_budget

    memory = MemoryModel.of(loaded)
    total = default_memory_budget(device)
    out = {"budget_gib": total / 2**30, "baseline_gib": baseline_bytes(device) / 2**30,
           "weights_model_gib": memory.weights_bytes / 2**30}
    try:
        budget = MemoryBudget.of(memory, total, baseline_bytes(device), 0, 1_000_000, 8192)
        out["work_gib"] = budget.work_bytes / 2**30
        out["scoring_tokens_allowed"] = budget.scoring_tokens(0, 0, 1 << 20)
    except ValueError as exc:
        out["budget_error"] = str(exc)
    if device.type == "cuda":
        free, total_device = torch.cuda.mem_get_info(device)
        out.update(mem_free_gib=free / 2**30, mem_total_gib=total_device / 2**30,
                   allocated_gib=torch.cuda.memory_allocated(device) / 2**30,
                   peak_allocated_gib=torch.cuda.max_memory_allocated(device) / 2**30)
    return out


def section_model(args, device, spec: str, name: str, tokenizer: Path | None = None) -> dict:
    """Accuracy, throughput, counts, roofline share and memory of one model, float32 and bfloat16."""
    from bench.peak import prompt_flops
    from bench.workers import _model_facts
    from bench.workload import scoring_workload, short_workload
    from models import load_model
    from models.attention_cuda import VARLEN
    from models.head import build_head
    from models.packed import LOOP

    small = device.type != "cuda"
    if tokenizer is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer)
    out: dict = {"model": name}
    reference_prompts = None
    for dtype in args.dtypes.split(","):
        started = time.perf_counter()
        loaded = load_model(spec, device=str(device), dtype=dtype, cache_dir=args.cache_dir)
        plan = loaded.plan
        entry: dict = {"load_s": time.perf_counter() - started, "fast_paths": plan.as_dict(),
                       "kernel": plan.attention_kernel}
        if reference_prompts is None:
            tok = tokenizer or loaded.tokenizer
            short = [r.query for r in short_workload(tok, 8 if small else 64)]
            mixed = [r.query for r in scoring_workload(tok, 4 if small else 32)]
            reference_prompts = short[:32] + mixed
            reference, top_ids = _reference(spec, args.cache_dir, device, reference_prompts)
            facts = _model_facts(loaded.model)
            out["facts"] = facts
        entry["accuracy_top20"] = _accuracy(loaded, plan, reference_prompts, reference, top_ids)
        if dtype == "bfloat16":  # the same plan with the head's logits rounded to bfloat16, as lm_head gives them
            bf16_head = replace(plan, head=build_head(loaded.model, plan.body, plan.held_head, float32_logits=False))
            entry["accuracy_top20_bf16_head"] = _accuracy(loaded, bf16_head, reference_prompts, reference, top_ids)
        # the served plan, then without its CUDA graphs, then with the per-segment loop
        variants = {(f"{plan.attention_kernel}_graphs" if plan.graphs is not None else plan.attention_kernel): plan}
        if plan.graphs is not None:
            variants[plan.attention_kernel] = replace(plan, graphs=None)
        if plan.attention_kernel == VARLEN:
            variants[LOOP] = replace(plan, attention_kernel=LOOP, graphs=None)
        for variant, variant_plan in variants.items():
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            run = _throughput(loaded, variant_plan, short, device, repeats=1 if small else 5)
            flops = sum(prompt_flops(len(p), facts) for p in short)
            run["useful_tflops"] = flops / (run["pass_ms"] / 1e3) / 1e12
            entry[f"short_inprocess_{variant}"] = run
            entry[f"counts_32_short_{variant}"] = _counts(loaded, variant_plan, short[:32], device)
        if plan.graphs is not None:
            entry["accuracy_top20_no_graphs"] = _accuracy(loaded, replace(plan, graphs=None), reference_prompts,
                                                          reference, top_ids)
        if LOOP in variants:
            entry[f"accuracy_top20_{LOOP}"] = _accuracy(loaded, replace(plan, attention_kernel=LOOP, graphs=None),
                                                        reference_prompts, reference, top_ids)
        entry["memory"] = _memory(loaded, device)
        out[dtype] = entry
        del loaded
        if device.type == "cuda":
            torch.cuda.empty_cache()
    out["short_prompts"] = {"n": len(short), "tokens": sum(len(p) for p in short)}
    return out


def random_gemma_dir(cache_dir: Path, tokenizer_dir: Path) -> Path:
    """Gemma-3-270M's architecture (its GGUF's config) with random weights, saved as an HF folder (no weights travel
    to the GPU machine); the tokenizer is the bundled model's, the vocabulary rows past it are never fed."""
    import transformers
    from transformers import AutoModelForCausalLM

    folder = cache_dir / "random-gemma3-270m"
    if (folder / "config.json").is_file():
        return folder
    config = json.loads((Path(__file__).parent / "gemma3_270m_config.json").read_text())
    text = transformers.Gemma3TextConfig(**{k: v for k, v in config.items() if k != "model_type"})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(text, dtype=torch.float32)
    with torch.no_grad():  # a spread like a trained model's: logits of several nats, not a near-uniform vocabulary
        model.get_output_embeddings().weight.normal_(0, 0.05)
    from transformers import AutoTokenizer

    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(folder)
    return folder


def fill_random_weights(folder: Path) -> None:
    """Give an HF folder that holds a config and a tokenizer but no weights random ones of its architecture (when
    the weights could not travel to the GPU machine): the numbers then measure speed and rounding, not the model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if any(folder.glob("*.safetensors")):
        return
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.float32)
    with torch.no_grad():
        model.get_output_embeddings().weight.normal_(0, 0.05)
    model.save_pretrained(folder)


def section_http(args, device, spec: str) -> dict:
    """/score over HTTP (bfloat16 on CUDA, the default), closed loop at concurrency 1, 8, 32, three workloads."""
    import tempfile

    from bench.loop import closed_loop
    from bench.servers import GenscoreClient, start_genscore
    from bench.workload import items_workload, long_items_workload, short_workload
    from models import load_model

    small = device.type != "cuda"
    tokenizer = load_model(spec, device="cpu", dtype="float32", cache_dir=args.cache_dir, optimize=False).tokenizer
    workloads = {"short": short_workload(tokenizer, 8 if small else 128),
                 "items": items_workload(tokenizer, 4 if small else 32),
                 "long-items": long_items_workload(tokenizer, 2 if small else 16)}
    log_path = Path(tempfile.mkdtemp()) / "genscore.log"
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    server = start_genscore(spec, dtype, args.cache_dir, log_path, timeout_s=240,
                            extra_args=("--device", str(device)))
    out: dict = {"ready_s": server.ready_s, "dtype": dtype, "cells": []}
    try:
        for name, requests in workloads.items():
            for concurrency in (1, 8) if small else (1, 8, 32):

                async def cell(requests=requests, concurrency=concurrency):
                    client = GenscoreClient(server.base_url, concurrency)
                    try:
                        return await closed_loop(client, requests, concurrency, warmup=2)
                    finally:
                        await client.aclose()

                run = asyncio.run(cell())
                prompts = sum(len(r.prompts) for r in requests)
                tokens = sum(r.tokens for r in requests)
                out["cells"].append({"workload": name, "concurrency": concurrency,
                                     "requests_per_s": len(requests) / run.wall_s, "prompts_per_s": prompts / run.wall_s,
                                     "tokens_per_s": tokens / run.wall_s, "p50_ms": run.percentile(0.5) * 1e3,
                                     "p95_ms": run.percentile(0.95) * 1e3})
    finally:
        server.stop()
        out["log_tail"] = log_path.read_text().splitlines()[-15:]
    return out


def section_engine(args, device, spec: str) -> dict:
    """genscore's Engine in this process, no HTTP (the same batcher, scorer and response building as /score), on
    short prompts at concurrency 1, 8, 32: how busy the device thread is (time inside Scorer.run_batch over wall
    time), and where the event loop's thread spends its time at 32 (cProfile, top functions)."""
    import cProfile
    import io
    import pstats

    from app.api.front import Front
    from app.api.score import serving
    from app.api.score.protocol import ScoreRequest
    from app.engine.core import Engine
    from app.engine.device import device_thread
    from app.engine.scoring import Scorer
    from app.settings import Settings
    from bench.loop import closed_loop
    from bench.workload import items_workload, short_workload
    from models import load_model

    small = device.type != "cuda"
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    settings = Settings(model=spec, dtype=dtype, device=str(device), cache_dir=args.cache_dir)
    thread = device_thread()
    loaded = thread.submit(load_model, settings.model, settings.device, settings.dtype, settings.cache_dir).result()
    workloads = {"short": short_workload(loaded.tokenizer, 8 if small else 128),
                 "items": items_workload(loaded.tokenizer, 4 if small else 32)}
    busy = [0.0, 0]  # seconds inside run_batch, batches
    device_profile: list = [None]  # a cProfile.Profile of the device thread's batches, when one is wanted
    original = Scorer.run_batch

    def timed(self, works):
        started = time.perf_counter()
        profiler = device_profile[0]
        if profiler is not None:
            profiler.enable()
        try:
            return original(self, works)
        finally:
            if profiler is not None:
                profiler.disable()
            busy[0] += time.perf_counter() - started
            busy[1] += 1

    def top(profiler, lines: int = 25) -> list[str]:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(lines)
        return [line for line in text.getvalue().splitlines() if line.strip()][:lines + 12]

    Scorer.run_batch = timed
    out: dict = {"dtype": dtype, "fast_paths": loaded.plan.as_dict(), "cells": []}

    async def main() -> None:
        engine = Engine(loaded, settings, device=thread)
        front = Front(engine)
        engine.start()
        await engine.warm_up()

        async def call(request):
            response = await serving.score(front, ScoreRequest(**request.score_body()))
            return [row["label_logprobs"] for row in response["data"]]

        try:
            for name, requests in workloads.items():
                for concurrency in (1, 8) if small else (1, 8, 32):
                    for request in requests[:2]:  # warm-up, outside the busy time
                        await call(request)
                    busy[:] = [0.0, 0]
                    run = await closed_loop(call, requests, concurrency, warmup=0)
                    out["cells"].append({"workload": name, "concurrency": concurrency,
                                         "prompts_per_s": sum(len(r.prompts) for r in requests) / run.wall_s,
                                         "p50_ms": run.percentile(0.5) * 1e3, "batches": busy[1],
                                         "device_thread_busy": busy[0] / run.wall_s})
            try:
                profiler = cProfile.Profile()
                profiler.enable()
                await closed_loop(call, workloads["short"], 8 if small else 32, warmup=0)
                profiler.disable()
                out["event_loop_profile_short_c32"] = top(profiler)
                device_profile[0] = cProfile.Profile()
                await closed_loop(call, workloads["items"], 1, warmup=0)
                out["device_thread_profile_items_c1"] = top(device_profile[0], 30)
            except Exception as exc:  # noqa: BLE001 - the cells above are kept
                out["profile_error"] = f"{type(exc).__name__}: {exc}"
            device_profile[0] = None
        finally:
            await engine.stop()
            front.close()

    try:
        asyncio.run(main())
    finally:
        Scorer.run_batch = original
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--model", default="smollm2-135m", help="the model of the model and http sections")
    p.add_argument("--sections", default="env,gemm,varlen,cascade,gemma,model,http")
    p.add_argument("--tokenizer", type=Path, default=None,
                   help="an HF folder with the tokenizer the gemma section's random model gets (default: --model's)")
    p.add_argument("--dtypes", default="float32,bfloat16", help="the model sections' dtypes")
    p.add_argument("--cache-dir", type=Path, default=Path(".cache/bench/weights"))
    p.add_argument("--out", type=Path, default=Path("bench/out/cuda"))
    args = p.parse_args()
    if Path(args.model).is_dir():
        fill_random_weights(Path(args.model))
    if args.tokenizer is None and "gemma" in args.sections:
        from models.loading import converted_weights_dir, load_model

        args.tokenizer = converted_weights_dir(args.model, args.cache_dir)
        if args.tokenizer is None or not (args.tokenizer / "tokenizer_config.json").is_file():
            args.tokenizer = args.cache_dir / "tokenizer"
            load_model(args.model, device="cpu", dtype="float32", cache_dir=args.cache_dir,
                       optimize=False).tokenizer.save_pretrained(args.tokenizer)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("CUDA is not available to this torch build", file=sys.stderr)
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "cuda_check.json"
    report: dict = json.loads(path.read_text()) if path.is_file() else {}
    sections = {
        "env": lambda: section_env(args, device),
        "gemm": lambda: section_gemm(args, device),
        "varlen": lambda: section_varlen(args, device),
        "cascade": lambda: section_cascade(args, device),
        "gemma": lambda: section_model(args, device, str(random_gemma_dir(args.cache_dir, args.tokenizer)),
                                       "Gemma-3-270M shape, random weights"),
        "model": lambda: section_model(args, device, args.model, args.model),
        "http": lambda: section_http(args, device, args.model),
        "engine": lambda: section_engine(args, device, args.model),
    }
    for name in args.sections.split(","):
        started = time.perf_counter()
        try:
            report[name] = sections[name]()
        except Exception as exc:  # noqa: BLE001 - one broken section must not cost the others' numbers
            report[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
        report[name + "_s"] = round(time.perf_counter() - started, 1)
        print(f"section {name}: {report[name + '_s']} s", flush=True)
        path.write_text(json.dumps(report, indent=1, default=str))
    print(json.dumps(report, default=str)[:4000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
