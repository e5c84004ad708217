"""/metrics sees the generation loop: generated and prefilled tokens are counted, its wait list and decode batch
are exported, streamed or not."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from app.main import create_app
from tests.api.conftest import tiny_settings
from tests.conftest import live_server


def samples(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


def test_generation_tokens_and_queue_are_exported(tiny_loaded):
    with live_server(create_app(tiny_settings(), loaded=tiny_loaded)) as url:
        before = samples(url)
        assert before["genscore_generation_tokens_total"] == 0  # warm-up is not a caller's work
        assert before["genscore_generation_waiting"] == 0 and before["genscore_generation_running"] == 0
        prompt = [5, 6, 7, 8, 9]
        plain = httpx.post(f"{url}/v1/completions", timeout=60, json={
            "model": "tiny-llama", "prompt": prompt, "max_tokens": 5, "n": 2, "temperature": 1.0, "seed": 1}).json()
        with httpx.stream("POST", f"{url}/v1/completions", timeout=60, json={
                "model": "tiny-llama", "prompt": prompt, "max_tokens": 4, "stream": True}) as stream:
            assert sum(line.startswith("data: ") for line in stream.iter_lines()) > 1
        after = samples(url)
    generated = plain["usage"]["completion_tokens"]
    assert generated > 0
    # the streamed request: at most 4 tokens (it may stop early at eos), at least 1
    assert generated + 1 <= after["genscore_generation_tokens_total"] <= generated + 4
    assert after["genscore_prompt_tokens_total"] - before["genscore_prompt_tokens_total"] == 2 * len(prompt)
