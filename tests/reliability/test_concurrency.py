"""Routes working at once, over real HTTP on 127.0.0.1: a long tokenization on any route does not stall probes,
every route tokenizes on the one tokenizing thread (a fast tokenizer shared by threads can fail with "Already
borrowed"), and a /score forward pass interleaved with streaming generation steps gives both their own numbers."""

from __future__ import annotations

import asyncio
import copy
import json
import threading
from dataclasses import replace

import httpx
import pytest
import torch

from tests.gates import async_wait_until, wait_until
from tests.reference import greedy_reference, last_logits
from tests.reliability.conftest import serving

HOLD = "HOLD-THIS-TEXT"  # a text holding this marker stops at the tokenizer's gate


class GatedTokenizer:
    """The model's tokenizer, recording the thread of every encode call; a text with HOLD waits at a gate there."""

    def __init__(self, inner):
        self._inner = inner
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.threads: list[str] = []

    def __call__(self, text, *args, **kwargs):
        self.threads.append(threading.current_thread().name)
        if isinstance(text, str) and HOLD in text:
            self.entered.set()
            if not self.gate.wait(60):
                raise AssertionError("the test never opened the tokenizer gate")
        return self._inner(text, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def __deepcopy__(self, memo):  # the generation loop decodes with its own copy: a plain tokenizer
        return copy.deepcopy(self._inner, memo)


@pytest.fixture
def gated_tokenizer_server(tiny_loaded):
    tokenizer = GatedTokenizer(tiny_loaded.tokenizer)
    with serving(replace(tiny_loaded, tokenizer=tokenizer)) as (base_url, app):
        yield base_url, app, tokenizer
        tokenizer.gate.set()


LONG = " ".join(["the quick brown fox jumps over the lazy dog"] * 2)  # the gate, not the length, makes it slow
ROUTES = {
    "/score": {"query": f"{HOLD} {LONG}", "label_token_ids": [5]},
    "/v1/completions": {"prompt": f"{HOLD} {LONG}", "max_tokens": 2},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": f"{HOLD} {LONG}"}], "max_tokens": 2},
    "/tokenize": {"prompt": f"{HOLD} {LONG}"},
}


@pytest.mark.parametrize("route", list(ROUTES))
def test_a_long_tokenization_does_not_stall_probes(gated_tokenizer_server, route):
    base_url, _, tokenizer = gated_tokenizer_server
    tokenizer.gate.clear()
    tokenizer.entered.clear()
    with httpx.Client(base_url=base_url, timeout=60) as client:
        result: dict = {}
        worker = threading.Thread(target=lambda: result.update(r=client.post(route, json=ROUTES[route])))
        worker.start()
        try:
            wait_until(tokenizer.entered.is_set, what=f"{route} to start tokenizing")
            # the tokenizer is held: the event loop must still answer probes (a blocked loop times out here)
            assert client.get("/health", timeout=10).status_code == 200
            assert client.get("/ready", timeout=10).status_code == 200
        finally:
            tokenizer.gate.set()
            worker.join(60)
    assert result["r"].status_code == 200, result["r"].text


def test_every_route_tokenizes_on_one_thread_and_gets_its_own_ids(gated_tokenizer_server, tiny_loaded):
    """Many texts through four routes at once: each answer carries its own text's ids, and no two threads ever
    used the shared tokenizer."""
    base_url, _, tokenizer = gated_tokenizer_server
    texts = [" ".join(["word"] * (3 + 2 * i)) + f" number {i}" for i in range(12)]
    expected = [tiny_loaded.tokenizer(t)["input_ids"] for t in texts]
    tokenizer.threads.clear()

    async def together():
        async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
            routes, calls = [], []
            for i, text in enumerate(texts):
                route = list(ROUTES)[i % 4]
                body = {"/score": {"query": text, "label_token_ids": [5]},
                        "/v1/completions": {"prompt": text, "max_tokens": 1, "echo": True, "logprobs": 0},
                        "/v1/chat/completions": {"messages": [{"role": "user", "content": text}], "max_tokens": 1},
                        "/tokenize": {"prompt": text}}[route]
                routes.append(route)
                calls.append(client.post(route, json=body))
            return list(zip(routes, await asyncio.gather(*calls)))

    answers = asyncio.run(together())
    for (route, response), ids, text in zip(answers, expected, texts):
        assert response.status_code == 200, response.text
        body = response.json()
        if route == "/score":
            assert body["usage"]["prompt_tokens"] == len(ids)
        elif route == "/v1/completions":
            assert body["choices"][0]["text"].startswith(text)
            assert body["usage"]["prompt_tokens"] == len(ids)
        elif route == "/tokenize":
            assert body["tokens"] == ids
        else:
            assert body["usage"]["prompt_tokens"] > len(ids)  # the template wraps the text
    assert len(tokenizer.threads) >= len(texts)
    assert set(tokenizer.threads) == {"genscore-tokenize_0"}, set(tokenizer.threads)


def test_a_generation_step_waits_for_the_scoring_pass_on_the_one_device_thread(tiny_loaded, plain_tiny):
    """Scoring and generation share one device thread: a /score pass (two prompts packed in one row) is held
    halfway through the layers while a streamed completion is admitted; its step is handed to the device
    thread but enters the model only after the scoring pass has left it. Both answers are the plain model's."""
    layers = tiny_loaded.model.base_model.layers
    middle = layers[len(layers) // 2]
    score_held, go_score = threading.Event(), threading.Event()
    go_score.set()
    entries: list[int] = []  # tokens per call reaching the middle layer, in order: 21 is the packed scoring row

    def hold(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]  # [B, T, H]
        entries.append(hidden.shape[0] * hidden.shape[1])
        if not go_score.is_set():
            score_held.set()
            go_score.wait(60)

    handle = middle.register_forward_pre_hook(hold, with_kwargs=True)
    score_ids, items = [5, 6, 7, 8, 9, 10, 11, 12], [[30, 31], [40, 41, 42]]
    prompt_ids = [20, 21, 22]
    try:
        with serving(tiny_loaded, share_prefixes=False) as (base_url, app):  # the two prompts are packed
            generator = app.state.lifecycle.generator

            async def read_stream(client: httpx.AsyncClient) -> list[str]:
                async with client.stream("POST", "/v1/completions", json={
                        "prompt": prompt_ids, "max_tokens": 6, "temperature": 0, "logprobs": 0,
                        "stream": True}) as stream:
                    return [line async for line in stream.aiter_lines() if line]

            async def scenario():
                async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
                    entries.clear()
                    go_score.clear()
                    score = asyncio.create_task(client.post("/score", json={
                        "query": score_ids, "items": items, "label_token_ids": [0, 5, 100], "top_logprobs": 3}))
                    await async_wait_until(score_held.is_set, what="the scoring pass to reach the middle layer")
                    stream = asyncio.create_task(read_stream(client))
                    # the prompt waits in the decode loop: the engine loop is busy with the scoring pass
                    await async_wait_until(lambda: generator.waiting == 1, what="the prompt to queue")
                    assert entries == [21], entries  # nothing else has entered the model
                    go_score.set()
                    return await score, await stream

            score, lines = asyncio.run(scenario())
    finally:
        go_score.set()
        handle.remove()
    assert entries[0] == 21 and entries[1] == len(prompt_ids), entries  # the prefill came after the scoring pass
    greedy = greedy_reference(plain_tiny, prompt_ids, 6, tiny_loaded.pad_token_id)
    eos = tiny_loaded.tokenizer.eos_token_id
    if eos in greedy:  # the server stops at the end-of-sequence token too
        greedy = greedy[:greedy.index(eos) + 1]
    assert lines[-1] == "data: [DONE]"
    tokens = [t for line in lines[:-1] for t in json.loads(line[6:])["choices"][0]["logprobs"]["tokens"]]
    assert tokens == [tiny_loaded.tokenizer.decode([t]) for t in greedy]
    assert score.status_code == 200, score.text
    for item, entry in zip(items, score.json()["data"]):
        expected = torch.log_softmax(last_logits(plain_tiny, score_ids + item), -1)
        assert entry["label_logprobs"] == pytest.approx(expected[[0, 5, 100]].tolist(), abs=1e-5)
