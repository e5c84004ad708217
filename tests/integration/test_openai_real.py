"""The real default model (SmolLM2-135M) through /v1/completions and /v1/chat/completions: echo logprobs within
1e-4 of a plain float32 transformers forward pass, greedy output token for token what transformers' generate
gives (alone and batched), and the openai SDK against a live server."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
import torch

from app.main import create_app
from app.settings import Settings
from tests.conftest import live_server
from tests.gates import Step, StepGate, async_wait_until

TOL = 1e-4
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "Question: What is two plus two?\nAnswer:",
]
MAX_TOKENS = 16


def test_echo_logprobs_match_float32_transformers(real_client, real_loaded, reference_model):
    tokenizer = real_loaded.tokenizer
    out = real_client.post("/v1/completions", json={"prompt": PROMPTS, "max_tokens": 0, "echo": True, "logprobs": 5})
    assert out.status_code == 200, out.text
    worst = 0.0
    for prompt, choice in zip(PROMPTS, out.json()["choices"]):
        ids = tokenizer(prompt)["input_ids"]
        with torch.inference_mode():
            reference = torch.log_softmax(reference_model(torch.tensor([ids])).logits[0].float(), -1)  # [T, V]
        lp = choice["logprobs"]
        assert choice["text"] == prompt and lp["tokens"] == [tokenizer.decode([i]) for i in ids]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        expected = torch.tensor([reference[j - 1, ids[j]].item() for j in range(1, len(ids))])
        got = torch.tensor(lp["token_logprobs"][1:])
        worst = max(worst, (got - expected).abs().max().item())
        for j in range(1, len(ids)):
            best = reference[j - 1].topk(5)
            for token, value in zip(best.indices.tolist(), best.values.tolist()):
                assert lp["top_logprobs"][j][tokenizer.decode([token])] == pytest.approx(value, abs=TOL)
    assert worst <= TOL


def _generate_reference(reference_model, ids: list[int], max_new_tokens: int) -> list[int]:
    out = reference_model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=max_new_tokens)
    return out[0, len(ids):].tolist()


def _assert_generated(tokenizer, choice, expected_ids, eos_ids):
    tokens = choice["logprobs"]["tokens"]
    assert tokens == [tokenizer.decode([t]) for t in expected_ids]
    text_ids = expected_ids[:-1] if expected_ids and expected_ids[-1] in eos_ids else expected_ids
    assert choice["text"] == tokenizer.decode(text_ids, skip_special_tokens=True)


def test_greedy_equals_generate_alone_and_batched(real_client, real_loaded, reference_model):
    tokenizer = real_loaded.tokenizer
    eos_ids = {tokenizer.eos_token_id}
    references = [_generate_reference(reference_model, tokenizer(p)["input_ids"], MAX_TOKENS) for p in PROMPTS]
    alone = real_client.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": MAX_TOKENS,
                                                      "temperature": 0, "logprobs": 0}).json()
    _assert_generated(tokenizer, alone["choices"][0], references[0], eos_ids)

    generator = real_client.app.state.lifecycle.generator
    gate = StepGate(generator)

    async def concurrently():
        """Separate requests: the first starts decoding, the others join its running batch in one step."""
        transport = httpx.ASGITransport(app=real_client.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=300) as client:
            def post(prompt):
                return asyncio.create_task(client.post("/v1/completions", json={
                    "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 0}))
            gate.hold()
            first = post(PROMPTS[0])
            await async_wait_until(gate.entered.is_set, what="the first step to reach the gate")
            rest = [post(p) for p in PROMPTS[1:]]
            await async_wait_until(lambda: len(generator._waiting) == len(rest), what="the others to queue")
            gate.release()
            return [await first] + list(await asyncio.gather(*rest))

    try:
        responses = real_client.portal.call(concurrently)
    finally:
        gate.remove()
    assert Step(admitted=len(PROMPTS) - 1, running=1) in gate.steps, gate.steps  # they joined a running batch
    assert max(step.running for step in gate.steps) >= 3, gate.steps  # and decoded together (one may end at once)
    for response, reference in zip(responses, references):
        assert response.status_code == 200
        _assert_generated(tokenizer, response.json()["choices"][0], reference, eos_ids)


def test_chat_greedy_equals_generate_on_the_template(real_client, real_loaded, reference_model):
    tokenizer = real_loaded.tokenizer
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tokenizer(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                    add_special_tokens=False)["input_ids"]
    reference = _generate_reference(reference_model, ids, 24)
    out = real_client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 24, "temperature": 0,
                                                         "logprobs": True}).json()
    choice = out["choices"][0]
    assert [e["token"] for e in choice["logprobs"]["content"]] == [tokenizer.decode([t]) for t in reference]
    ended = reference[-1] == tokenizer.eos_token_id
    assert choice["finish_reason"] == ("stop" if ended else "length")
    assert choice["message"]["content"] == tokenizer.decode(reference, skip_special_tokens=True)
    assert out["usage"]["prompt_tokens"] == len(ids)


def test_lm_eval_style_continuation_loglikelihood(real_client, real_loaded, reference_model):
    tokenizer = real_loaded.tokenizer
    context = tokenizer("Question: What is the capital of France?\nAnswer:", add_special_tokens=False)["input_ids"]
    continuation = tokenizer(" Paris", add_special_tokens=False)["input_ids"]
    body = {"prompt": [context + continuation], "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0,
            "seed": 1234}
    lp = real_client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == len(context) + len(continuation) + 1
    with torch.inference_mode():
        reference = torch.log_softmax(reference_model(torch.tensor([context + continuation])).logits[0].float(), -1)
    expected = sum(reference[len(context) - 1 + j, t].item() for j, t in enumerate(continuation))
    assert sum(lp["token_logprobs"][len(context):-1]) == pytest.approx(expected, abs=TOL)


@pytest.fixture(scope="module")
def real_sdk(real_loaded):
    with live_server(create_app(Settings(device="cpu", dtype="float32"), loaded=real_loaded), timeout_s=120) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_sdk_against_the_real_model(real_sdk, real_loaded, reference_model):
    tokenizer = real_loaded.tokenizer
    out = real_sdk.completions.create(model="smollm2-135m", prompt=PROMPTS[0], max_tokens=8, temperature=0)
    reference = _generate_reference(reference_model, tokenizer(PROMPTS[0])["input_ids"], 8)
    assert out.choices[0].text == tokenizer.decode(reference, skip_special_tokens=True)
    messages = [{"role": "user", "content": "Say hello."}]
    stream = real_sdk.chat.completions.create(model="smollm2-135m", messages=messages, max_completion_tokens=8,
                                              temperature=0, stream=True)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    ids = tokenizer(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                    add_special_tokens=False)["input_ids"]
    assert streamed == tokenizer.decode(_generate_reference(reference_model, ids, 8), skip_special_tokens=True)
