"""The benchmark's generation cell: concurrent /v1/completions with n > 1 and a fixed max_tokens, sent over HTTP by
one client to genscore and to vLLM CPU alike; completion tokens per second of wall time."""

from __future__ import annotations

import random
from dataclasses import dataclass

import httpx
import orjson

from bench.loop import closed_loop
from bench.workload import _text_ids


@dataclass(frozen=True)
class GenerationCell:
    """What every system is asked: `requests` prompts sent by `concurrency` callers, each for n choices of up to
    max_tokens tokens, sampled at `temperature` with a seed per request (greedy at 0)."""

    concurrency: int = 4
    n: int = 4
    max_tokens: int = 128
    requests: int = 8
    temperature: float = 1.0
    seed: int = 0

    @classmethod
    def parse(cls, spec: str, requests: int, temperature: float, seed: int) -> GenerationCell:
        """'CONCURRENCYxNxTOKENS', e.g. 4x4x128."""
        concurrency, n, tokens = (int(x) for x in spec.split("x"))
        return cls(concurrency, n, tokens, requests, temperature, seed)

    @property
    def label(self) -> str:
        sampling = "greedy" if self.temperature == 0 else f"temperature {self.temperature:g}, seeded"
        return (f"{self.requests} requests of n={self.n}, max_tokens {self.max_tokens}, {sampling}, "
                f"concurrency {self.concurrency}")


def generation_prompts(tokenizer, count: int, seed: int = 7) -> list[list[int]]:
    """Token-id prompts of 20-60 tokens of plain words: every system sees the same tokens."""
    rng = random.Random(seed)
    return [_text_ids(tokenizer, rng, rng.randint(20, 60)) for _ in range(count)]


class CompletionClient:
    """POST /v1/completions with a prompt of token ids; returns the completion tokens the server reports."""

    def __init__(self, base_url: str, cell: GenerationCell, model: str | None = None):
        self._client = httpx.AsyncClient(base_url=base_url, timeout=1800, limits=httpx.Limits(
            max_connections=cell.concurrency + 2, max_keepalive_connections=cell.concurrency + 2))
        self._cell = cell
        self._model = model

    async def __call__(self, request: tuple[int, list[int]]) -> dict:
        number, prompt = request
        cell = self._cell
        body = {"prompt": prompt, "n": cell.n, "max_tokens": cell.max_tokens, "temperature": cell.temperature}
        if cell.temperature:
            body["seed"] = cell.seed + number
        if self._model is not None:
            body["model"] = self._model
        response = await self._client.post("/v1/completions", content=orjson.dumps(body),
                                           headers={"content-type": "application/json"})
        response.raise_for_status()
        answer = orjson.loads(response.content)
        return {"tokens": answer["usage"]["completion_tokens"], "choices": len(answer["choices"])}

    async def aclose(self) -> None:
        await self._client.aclose()


async def run_cell(base_url: str, cell: GenerationCell, prompts: list[list[int]], warmup: int, repeats: int,
                   model: str | None = None) -> dict:
    """The fastest of `repeats` timed passes (after `warmup` untimed requests): tokens/s and latencies."""
    client = CompletionClient(base_url, cell, model)
    try:
        result = await closed_loop(client, list(enumerate(prompts)), cell.concurrency, warmup=warmup,
                                   repeats=repeats)
    finally:
        await client.aclose()
    tokens = sum(v["tokens"] for v in result.values)
    assert all(v["choices"] == cell.n for v in result.values), "a server answered fewer choices than asked"
    return {"cell": cell.__dict__, "wall_s": result.wall_s, "completion_tokens": tokens,
            "tokens_per_s": tokens / result.wall_s, "p50_s": result.percentile(0.5), "p95_s": result.percentile(0.95)}


def markdown(generation: dict) -> list[str]:
    """The report's generation section: one row per system."""
    if not generation or not generation.get("systems"):
        return []
    lines = ["## Generation", "", f"{generation['label']}; prompts of 20-60 tokens, token ids in, over HTTP, the same "
             "client for every system; tokens/s = completion tokens reported in `usage` / wall time of the fastest "
             "pass.", "", "| system | tokens/s | completion tokens | wall s | p50 s | p95 s |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for system, cell in generation["systems"].items():
        lines.append(f"| {system} | {cell['tokens_per_s']:.1f} | {cell['completion_tokens']} | {cell['wall_s']:.1f} | "
                     f"{cell['p50_s']:.1f} | {cell['p95_s']:.1f} |")
    ratios = generation.get("ratios", {})
    if ratios:
        lines += [""] + [f"- genscore {k} / vLLM CPU: {v:.2f}x tokens/s" for k, v in ratios.items()]
    before = generation.get("before_ratios", {})
    if before:
        lines += [""] + [f"- genscore {k} after ÷ before (`--before`): {v:.2f}x tokens/s" for k, v in before.items()]
    return lines + [""]
