"""The benchmark's vLLM client, workloads and report on synthetic data (no vLLM, no model)."""

from __future__ import annotations

import httpx
import orjson

from bench import report
from bench.vllm_peer import VllmClient
from bench.workload import WORKLOADS, BenchRequest, long_items_workload, short_workload


class WordTokenizer:
    """One id per whitespace-separated word: enough for the workload builders."""

    def __init__(self):
        self.vocab: dict[str, int] = {}

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        return {"input_ids": [self.vocab.setdefault(word, len(self.vocab) + 1) for word in text.split()]}


def test_short_and_long_items_workloads_have_the_promised_shapes_and_are_deterministic():
    short = short_workload(WordTokenizer(), 64)
    assert len(short) == 64 and all(23 <= len(r.query) <= 51 and 2 <= len(r.labels) <= 10 for r in short)
    assert short == short_workload(WordTokenizer(), 64)
    items = long_items_workload(WordTokenizer(), 16)
    assert all(150 <= len(r.query) <= 400 and 20 <= len(r.items) <= 50 for r in items)
    assert all(8 <= len(it) <= 30 for r in items for it in r.items)
    assert all(r.prompts == [r.query + it for it in r.items] and len(r.labels) == 2 for r in items)
    assert {"scoring", "items", "short", "long-items"} <= set(WORKLOADS)


async def test_vllm_client_asks_for_the_labels_and_reads_them_by_token_id():
    seen = []

    def answer(request: httpx.Request) -> httpx.Response:
        body = orjson.loads(request.content)
        seen.append(body)
        prompts = body["prompt"] if isinstance(body["prompt"][0], list) else [body["prompt"]]
        # Out of order on purpose, and the sampled token (id 7) comes along as vLLM sends it.
        choices = [{"index": i, "logprobs": {"top_logprobs": [
            {"token_id:7": -0.5, **{f"token_id:{t}": -float(t + i) for t in body["logprob_token_ids"]}}]}}
            for i in reversed(range(len(prompts)))]
        return httpx.Response(200, json={"choices": choices})

    client = VllmClient("http://vllm", 1)
    client._client = httpx.AsyncClient(base_url="http://vllm", transport=httpx.MockTransport(answer))
    single = await client(BenchRequest(query=[1, 2], labels=[3, 5], prompts=[[1, 2]]))
    many = await client(BenchRequest(query=[1], labels=[4], items=[[2], [3]], prompts=[[1, 2], [1, 3]]))
    await client.aclose()
    assert single == [[-3.0, -5.0]] and many == [[-4.0], [-5.0]]
    assert seen[0]["prompt"] == [1, 2] and seen[1]["prompt"] == [[1, 2], [1, 3]]
    assert all(b["max_tokens"] == 1 and b["logprobs"] == 0 and b["return_tokens_as_token_ids"] for b in seen)


def _results(systems: dict) -> dict:
    tokens = [[30], [40]]
    return {
        "model": {"body_params": 10**8, "total_params": 1.3 * 10**8, "layers": 30, "hidden": 576, "vocab": 49152},
        "gemm_gflops": {"float32": 100.0, "bfloat16": 400.0},
        "workloads": {"short": {"requests": 2, "prompts": [1, 1], "tokens": tokens, "labels": [2, 2],
                                "query_tokens": None, "concurrency": [1, 8]}},
        "reference": {"short": [[[-1.0, -2.0]], [[-3.0, -4.0]]]},
        "systems": systems,
    }


def _run(values, wall_s: float) -> dict:
    return {"wall_s": wall_s, "latencies_s": [0.1, 0.2], "values": values}


def test_report_compares_vllm_with_genscore_and_states_batch_variation():
    reference = [[[-1.0, -2.0]], [[-3.0, -4.0]]]
    shifted = [[[-1.0, -2.5]], [[-3.0, -4.0]]]
    systems = {
        "genscore HTTP f32": {"dtype": "float32", "runs": {"short": {"1": _run(reference, 1.0),
                                                                    "8": _run(reference, 0.5)}}},
        "vLLM CPU f32": {"dtype": "float32", "runs": {"short": {"1": _run(reference, 2.0), "8": _run(shifted, 0.5)}},
                         "servers": [{"workloads": ["short"], "prefix_caching": False, "ready_s": 50.0,
                                      "compiled": True, "peak_rss_mb": 3000.0, "pss_mb": 2500.0, "processes": 3}]},
    }
    results = _results(systems)
    summary = report.summarise(results)
    genscore, vllm = summary["systems"]["genscore HTTP f32"], summary["systems"]["vLLM CPU f32"]
    assert genscore["err_max"] == 0.0 and genscore["variation"] == 0.0
    assert vllm["err_max"] == 0.5 and vllm["by_workload"]["short"]["variation"] == 0.5
    assert summary["claims"]["f32_vs_vllm"]["short"] == {1: 2.0, 8: 1.0}
    results.update(machine={"cpu": "x", "cores": 2, "avx512_bf16": True, "amx_bf16": True, "torch": "2.13.0",
                            "torch_threads": 2, "python": "3.11"},
                   loadavg_start=(0.1, 0.1, 0.1), loadavg_end=(0.2, 0.2, 0.2), total_s=60.0,
                   args={"model": "smollm2-135m", "repeats": "2", "warmup": "2"})
    text = report.markdown(results, summary)
    assert "vs vLLM CPU f32, workload `short` (prompts/s ratio): c=1: 2.00×, c=8: 1.00×" in text
    assert "### vLLM servers" in text
