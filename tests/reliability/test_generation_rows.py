"""Generation with several rows decoding together, over real HTTP on 127.0.0.1: one row's decode step fails, one
row's client disconnects, stop strings while streaming, and the cache budget as rows grow. Each scenario is set up
with the generation loop held at a gate (tests/gates.py), and asserted from the steps the loop really ran."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.gates import Step, StepGate, async_wait_until, join_running_batch, wait_until
from tests.reliability.conftest import POISON, serving


def completion(prompt: list[int], **extra) -> dict:
    return {"prompt": prompt, "temperature": 0, "logprobs": 0, **extra}


@pytest.fixture
def step_gated(tiny_loaded):
    """A live server with the generation loop's step wrapped in a gate: (base_url, app, gate)."""
    with serving(tiny_loaded) as (base_url, app):
        gate = StepGate(app.state.lifecycle.generator)
        try:
            yield base_url, app, gate
        finally:
            gate.remove()


def test_a_decode_step_failing_for_one_row_leaves_the_other_rows_decoding(step_gated, probe):
    base_url, app, gate = step_gated
    steady = completion([5, 6, 7, 8], max_tokens=6)
    alone = httpx.post(f"{base_url}/v1/completions", json=steady, timeout=30).json()["choices"][0]
    # logit_bias makes this row's first token the poisoned id, which its next decode step feeds to the model
    poisoned = completion([20, 21, 22], max_tokens=4, logit_bias={str(POISON): 100})
    probe.fault = lambda ids: RuntimeError("injected decode fault") if ids.shape[1] == 1 and (
        ids == POISON).any() else None

    async def scenario():
        async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
            head, (other,) = await join_running_batch(client, app.state.lifecycle.generator, gate, steady, [poisoned])
            return await head, await other

    steady_answer, poisoned_answer = asyncio.run(scenario())
    assert Step(admitted=1, running=1) in gate.steps, gate.steps  # the poisoned row joined the steady one
    assert poisoned_answer.status_code == 500
    assert steady_answer.status_code == 200, steady_answer.text
    assert steady_answer.json()["choices"][0]["text"] == alone["text"]


def test_one_of_several_streams_disconnecting_leaves_the_others_decoding(step_gated):
    base_url, app, gate = step_gated
    generator = app.state.lifecycle.generator
    bodies = [completion([5, 6, 7, 8], max_tokens=10), completion([30, 31], max_tokens=10),
              completion([40, 41, 42], max_tokens=10)]
    alone = [httpx.post(f"{base_url}/v1/completions", json=b, timeout=30).json()["choices"][0] for b in bodies]
    leaver = {**completion([20, 21, 22], max_tokens=60), "stream": True}

    async def leave_after_three_chunks(client: httpx.AsyncClient) -> int:
        async with client.stream("POST", "/v1/completions", json=leaver) as stream:
            seen = 0
            async for line in stream.aiter_lines():
                seen += line.startswith("data: ")
                if seen == 3:  # the others have joined by now: leave while everyone decodes
                    return seen
        return seen

    async def scenario():
        async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
            gate.hold()
            leaving = asyncio.create_task(leave_after_three_chunks(client))
            await async_wait_until(gate.entered.is_set, what="the leaver's first step")
            rest = [asyncio.create_task(client.post("/v1/completions", json=b)) for b in bodies]
            await async_wait_until(lambda: len(generator._waiting) == len(bodies), what="the others to queue")
            gate.release()
            assert await leaving == 3
            return await asyncio.gather(*rest)

    answers = asyncio.run(scenario())
    wait_until(lambda: generator.running == 0, what="the batch to empty")
    steps = gate.steps
    assert Step(admitted=3, running=1) in steps, steps  # the three joined the leaver's running batch
    assert max(s.running for s in steps) == 4, steps
    # the leaver's row was dropped when its client left: it never ran to its 60 tokens (59 steps)
    assert len(steps) < leaver["max_tokens"] - 1, steps
    for answer, expected in zip(answers, alone):
        assert answer.status_code == 200, answer.text
        choice = answer.json()["choices"][0]
        assert choice["text"] == expected["text"] and choice["finish_reason"] == expected["finish_reason"]
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(expected["logprobs"]["token_logprobs"], abs=1e-5)


def test_stop_strings_while_streaming_cut_like_the_full_response(tiny_loaded):
    prompt = [5, 6, 7, 8]
    with serving(tiny_loaded) as (base_url, _):
        free = httpx.post(f"{base_url}/v1/completions", json=completion(prompt, max_tokens=16), timeout=30).json()
        text = free["choices"][0]["text"]
        assert len(text) >= 8, text
        # a stop string that starts inside one token's text and ends in a later one, and one that never appears
        tokens = free["choices"][0]["logprobs"]["tokens"]
        cut = len(tokens[0]) + len(tokens[1]) // 2 if len(tokens[1]) > 1 else len(tokens[0]) + 1
        stop = text[cut - 1:cut + 2]
        body = completion(prompt, max_tokens=16, stop=[stop, "\u2603never"])
        full = httpx.post(f"{base_url}/v1/completions", json=body, timeout=30).json()["choices"][0]
        assert full["finish_reason"] == "stop" and full["text"] == text[:text.index(stop)]
        with httpx.stream("POST", f"{base_url}/v1/completions", json={**body, "stream": True}, timeout=30) as r:
            lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:])["choices"][0] for line in lines[:-1]]
    streamed = ""
    for chunk in chunks:
        streamed += chunk["text"]
        assert stop not in streamed  # a held-back stop string start is never sent, then taken back
    assert streamed == full["text"]
    assert chunks[-1]["finish_reason"] == "stop"


def test_cache_budget_holds_as_decoding_rows_grow(tiny_loaded):
    """max_cache_tokens bounds the KV cache of the running batch (rows x width) at every step, not only at
    admission: rows that grow while decoding must not take the batch over the budget."""
    budget = 64
    with serving(tiny_loaded, max_cache_tokens=budget) as (base_url, app):
        generator = app.state.lifecycle.generator
        widths: list[int] = []
        inner = generator._step

        def recording(admitted):
            events = inner(admitted)
            if generator._batch is not None:
                widths.append(generator._batch.size * generator._batch.width)
            return events

        generator._step = recording
        bodies = [completion([5 + i, 6, 7, 8, 9, 10], max_tokens=20) for i in range(4)]
        alone = [httpx.post(f"{base_url}/v1/completions", json=b, timeout=30).json()["choices"][0] for b in bodies]
        widths.clear()

        async def together():
            async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
                return await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies))

        answers = asyncio.run(together())
        del generator._step
    for answer, expected in zip(answers, alone):
        assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == expected["text"]
    assert widths and max(widths) <= budget, widths


def test_generation_batch_width_is_what_decode_steps_feed(tiny_loaded):
    """The batch's width is the cache length the model sees (a check on what the budget test reads)."""
    with serving(tiny_loaded) as (base_url, app):
        generator = app.state.lifecycle.generator
        seen: list[tuple[int, int]] = []
        inner = generator._step

        def recording(admitted):
            events = inner(admitted)
            if generator._batch is not None:
                key = generator._batch.cache.layers[0].keys  # [B, H, T, D]
                seen.append((generator._batch.size * generator._batch.width, key.shape[0] * key.shape[2]))
            return events

        generator._step = recording
        assert httpx.post(f"{base_url}/v1/completions", json=completion([5, 6, 7], max_tokens=5),
                          timeout=30).status_code == 200
        del generator._step
    assert seen and all(a == b for a, b in seen), seen


def test_one_request_with_a_large_n_holds_at_most_its_share_of_rows(tiny_loaded):
    """With max_rows_per_request = 2, a request with n = 6 decodes two rows at a time, and a request sent while it
    runs joins the batch at once instead of waiting for all six choices to finish."""
    with serving(tiny_loaded, max_rows_per_request=2, max_batch_size=8) as (base_url, app):
        generator = app.state.lifecycle.generator
        big = completion([5, 6, 7, 8], max_tokens=12, n=6, temperature=1.0, seed=7)
        small = completion([30, 31], max_tokens=3)
        alone = httpx.post(f"{base_url}/v1/completions", json=big, timeout=60).json()["choices"]
        small_alone = httpx.post(f"{base_url}/v1/completions", json=small, timeout=60).json()["choices"][0]
        held: list[int] = []  # rows of the big request in each step
        inner = generator._step

        def recording(admitted):
            events = inner(admitted)
            held.append(sum(1 for c in generator._rows if c.group.params.n == 6))
            return events

        generator._step = recording
        gate = StepGate(generator)  # wraps the recording step; removing the gate restores the class's step

        async def scenario():
            async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
                head, (other,) = await join_running_batch(client, generator, gate, big, [small])
                return await head, await other

        try:
            big_answer, small_answer = asyncio.run(scenario())
        finally:
            gate.remove()
    assert held and max(held) <= 2, held
    assert gate.steps[1] == Step(admitted=1, running=2), gate.steps  # the small prompt joined at the second step
    assert big_answer.status_code == 200 and small_answer.status_code == 200
    # seeded choices give the same text whichever rows they shared the batch with
    assert [c["text"] for c in big_answer.json()["choices"]] == [c["text"] for c in alone]
    assert small_answer.json()["choices"][0]["text"] == small_alone["text"]
