"""Benchmark subprocesses (own process, so peak RSS is theirs alone): the naive transformers loop, and genscore's Engine in-process.

`python -m bench.workers naive|engine SPEC.json OUT.json`
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

from bench.loop import closed_loop, peak_rss_mb


def _model_facts(model) -> dict:
    """What the FLOP count needs: parameters outside the embedding tables, layers, width, vocabulary."""
    config = model.config
    embed_ids = {id(p) for p in model.get_input_embeddings().parameters()}
    embed_ids |= {id(p) for p in model.get_output_embeddings().parameters()}
    body = sum(p.numel() for p in model.parameters() if id(p) not in embed_ids)
    return {
        "body_params": body,
        "total_params": sum(p.numel() for p in model.parameters()),
        "layers": config.num_hidden_layers,
        "hidden": config.hidden_size,
        "kv_heads": getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        "head_dim": getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
        "vocab": model.get_output_embeddings().weight.shape[0],
    }


def naive(spec: dict) -> dict:
    """The hand-written loop: one prompt at a time, float32, full model call; its numbers are the reference."""
    import torch

    from models import load_model

    started = time.perf_counter()
    loaded = load_model(spec["model"], device="cpu", dtype="float32", cache_dir=Path(spec["cache_dir"]),
                        optimize=False)  # plain transformers: the reference
    load_s = time.perf_counter() - started
    model = loaded.model

    @torch.inference_mode()
    def score(request: dict) -> list[list[float]]:
        out = []
        for prompt in request["prompts"]:
            logits = model(input_ids=torch.tensor([prompt])).logits[0, -1].float()  # [V]
            out.append(torch.log_softmax(logits, dim=-1)[request["labels"]].tolist())
        return out

    async def call(request: dict):
        return score(request)

    runs = {}
    for name, requests in spec["workloads"].items():
        result = asyncio.run(closed_loop(call, requests, 1, warmup=spec["warmup"], repeats=spec["repeats"]))
        runs[name] = {"1": result.__dict__}
    return {"load_s": load_s, "peak_rss_mb": peak_rss_mb(), "model": _model_facts(model), "runs": runs}


def engine(spec: dict) -> dict:
    """genscore's Engine in this process, no HTTP: the same batcher, forward pass and response building."""
    from app.api.front import Front
    from app.api.score import serving
    from app.api.score.protocol import ScoreRequest
    from app.engine.core import Engine
    from app.engine.device import device_thread
    from app.settings import Settings
    from models import load_model

    settings = Settings(model=spec["model"], dtype=spec["dtype"], cache_dir=Path(spec["cache_dir"]),
                        **spec.get("settings", {}))
    started = time.perf_counter()
    device = device_thread()  # the model loads on the thread that serves it, as in genscore serve
    loaded = device.submit(load_model, settings.model, settings.device, settings.dtype, settings.cache_dir,
                           batch_invariant=settings.batch_invariant, compile=settings.compile).result()
    load_s = time.perf_counter() - started

    async def main() -> dict:
        eng = Engine(loaded, settings, device=device)
        front = Front(eng)
        eng.start()
        await eng.warm_up()

        async def call(request: dict):
            response = await serving.score(front, ScoreRequest(**request["body"]))
            return [row["label_logprobs"] for row in response["data"]]

        def counters() -> dict:
            stats = eng.prefix_cache.stats
            return {"prefix_hits": stats.hits, "prefix_misses": stats.misses}

        runs: dict = {}
        try:
            for name, requests in spec["workloads"].items():
                runs[name] = {}
                for concurrency in spec["levels"][name]:
                    before = counters()
                    result = await closed_loop(call, requests, concurrency, warmup=spec["warmup"],
                                               repeats=spec["repeats"])
                    result.__dict__["cache_counters"] = {k: v - before[k] for k, v in counters().items()}
                    runs[name][str(concurrency)] = result.__dict__
        finally:
            await eng.stop()
            front.close()
        return runs

    runs = asyncio.run(main())
    return {"load_s": load_s, "peak_rss_mb": peak_rss_mb(), "runs": runs}


if __name__ == "__main__":
    kind, spec_path, out_path = sys.argv[1:4]
    spec = json.loads(Path(spec_path).read_text())
    result = {"naive": naive, "engine": engine}[kind](spec)
    Path(out_path).write_text(json.dumps(result))
