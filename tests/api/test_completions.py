"""POST /v1/completions on tiny models: OpenAI's shapes field by field, echo logprobs against a plain forward pass,
greedy against transformers' generate, seeds, stop strings, penalties, logprobs modes, streaming, batching, errors;
and the official openai SDK against a live server."""

from __future__ import annotations

import asyncio
import json
import math

import httpx
import openai
import pytest
import torch
from fastapi.testclient import TestClient

from app.main import create_app
from tests.api.conftest import TINY_NAME, tiny_settings
from tests.conftest import live_server, wait_ready
from tests.gates import Step, StepGate, join_running_batch, wait_until
from tests.reference import greedy_reference

PROMPT = "The quick brown fox"
NEG_INF = -9999.0


def ids_of(loaded, text, special=True):
    return loaded.tokenizer(text, add_special_tokens=special)["input_ids"]


def complete(client, **body):
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()




def sse_events(text: str) -> list:
    lines = [line for line in text.split("\n") if line]
    assert all(line.startswith("data: ") for line in lines), text
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


# --- shapes ---------------------------------------------------------------------------------------------------------

def test_response_shape_field_by_field(client, tiny_loaded):
    out = complete(client, model=TINY_NAME, prompt=PROMPT, max_tokens=5, logprobs=2, temperature=0)
    assert set(out) == {"id", "object", "created", "model", "choices", "usage"}
    assert out["id"].startswith("cmpl-") and out["object"] == "text_completion"
    assert isinstance(out["created"], int) and out["model"] == TINY_NAME
    assert len(out["choices"]) == 1
    choice = out["choices"][0]
    assert set(choice) == {"index", "text", "logprobs", "finish_reason"}
    assert choice["index"] == 0 and isinstance(choice["text"], str) and choice["finish_reason"] in ("length", "stop")
    lp = choice["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    n = len(lp["tokens"])
    assert 1 <= n <= 5 and len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
    assert all(isinstance(t, str) for t in lp["tokens"])
    assert all(isinstance(v, float) and v <= 0 for v in lp["token_logprobs"])
    for token, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert 2 <= len(top) <= 3 and top[token] == value  # top 2, plus the chosen token when not among them
    assert lp["text_offset"][0] == 0
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(n)]
    usage = out["usage"]
    assert usage == {"prompt_tokens": len(ids_of(tiny_loaded, PROMPT)), "completion_tokens": n,
                     "total_tokens": len(ids_of(tiny_loaded, PROMPT)) + n}


def test_no_logprobs_means_null(client):
    choice = complete(client, prompt=PROMPT, max_tokens=3)["choices"][0]
    assert choice["logprobs"] is None


def test_echo_logprobs_match_plain_forward(client, tiny_loaded, plain_tiny):
    ids = ids_of(tiny_loaded, PROMPT)
    out = complete(client, prompt=PROMPT, max_tokens=0, logprobs=3, echo=True)
    choice = out["choices"][0]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    assert lp["tokens"] == [tiny_loaded.tokenizer.decode([i]) for i in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    with torch.inference_mode():
        reference = torch.log_softmax(plain_tiny(torch.tensor([ids])).logits[0].float(), -1)  # [T, V]
    expected = [reference[j, ids[j + 1]].item() for j in range(len(ids) - 1)]
    assert lp["token_logprobs"][1:] == pytest.approx(expected, abs=1e-5)
    decode = tiny_loaded.tokenizer.decode
    for j in range(1, len(ids)):
        expected_top: dict[str, float] = {}
        for token in torch.topk(reference[j - 1], 3).indices.tolist() + [ids[j]]:
            expected_top.setdefault(decode([token]), reference[j - 1, token].item())  # same-text tokens share a key
        assert lp["top_logprobs"][j] == pytest.approx(expected_top, abs=1e-5)
    assert out["usage"]["completion_tokens"] == 0


def test_lm_eval_loglikelihood_request(client, tiny_loaded, plain_tiny):
    """lm-eval's exact request: every prompt token's logprob plus exactly one generated token."""
    ids = ids_of(tiny_loaded, PROMPT + " jumps over")
    out = complete(client, prompt=[ids], max_tokens=1, logprobs=1, echo=True, temperature=0, seed=1234)
    lp = out["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(ids) + 1
    assert lp["token_logprobs"][0] is None
    with torch.inference_mode():
        logits = plain_tiny(torch.tensor([ids])).logits[0].float()
    greedy = int(logits[-1].argmax())
    assert lp["tokens"][-1] == tiny_loaded.tokenizer.decode([greedy])
    assert lp["token_logprobs"][-1] == pytest.approx(torch.log_softmax(logits[-1], -1)[greedy].item(), abs=1e-5)
    ctxlen = 3  # how lm-eval reads it: sum(token_logprobs[ctxlen:-1]) and whether each is the top-1
    continuation = torch.log_softmax(logits, -1)[[j - 1 for j in range(ctxlen, len(ids))], ids[ctxlen:]]
    assert sum(lp["token_logprobs"][ctxlen:-1]) == pytest.approx(continuation.sum().item(), abs=1e-4)


def test_token_id_prompts_equal_text_prompts(client, tiny_loaded):
    by_text = complete(client, prompt=[PROMPT, "Paris is"], max_tokens=4, temperature=0, logprobs=1)
    by_ids = complete(client, prompt=[ids_of(tiny_loaded, PROMPT), ids_of(tiny_loaded, "Paris is")], max_tokens=4,
                      temperature=0, logprobs=1)
    assert [c["text"] for c in by_text["choices"]] == [c["text"] for c in by_ids["choices"]]
    assert [c["index"] for c in by_text["choices"]] == [0, 1]
    single = complete(client, prompt=ids_of(tiny_loaded, PROMPT), max_tokens=4, temperature=0)
    assert single["choices"][0]["text"] == by_text["choices"][0]["text"]


# --- generation -----------------------------------------------------------------------------------------------------

def reference_logprobs(plain, ids, continuation):
    """Plain forward of prompt + continuation: the logprob of each continuation token, float32 [len(continuation)]."""
    with torch.inference_mode():
        logits = plain(torch.tensor([ids + continuation])).logits[0].float()
    logprobs = torch.log_softmax(logits, -1)
    return [logprobs[len(ids) - 1 + j, token].item() for j, token in enumerate(continuation)]


def assert_same_tokens(loaded, plain, ids, choice, expected_ids):
    """The choice generated exactly expected_ids: same token strings and the same logprobs (which tell ids apart)."""
    lp = choice["logprobs"]
    assert lp["tokens"] == [loaded.tokenizer.decode([t]) for t in expected_ids]
    assert lp["token_logprobs"] == pytest.approx(reference_logprobs(plain, ids, expected_ids), abs=1e-5)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen2"])
def test_greedy_equals_transformers_generate(arch, tiny_model_dirs, plain_models):
    from models import load_model

    loaded = load_model(str(tiny_model_dirs[arch]), device="cpu", dtype="float32")
    prompts = [PROMPT, "Paris is the capital of", "0 1 2 3 4 5 6 7 8 9 A B", "Is"]
    with TestClient(create_app(tiny_settings(), loaded=loaded)) as client:
        wait_ready(client)
        # all prompts in one request: they prefill and decode together, left-padded to different lengths
        out = complete(client, prompt=prompts, max_tokens=12, temperature=0, logprobs=0)
    for prompt, choice in zip(prompts, out["choices"]):
        ids = ids_of(loaded, prompt)
        reference = greedy_reference(plain_models[arch], ids, 12, loaded.pad_token_id)
        if loaded.tokenizer.eos_token_id in reference:  # both stop at the end-of-sequence token
            reference = reference[:reference.index(loaded.tokenizer.eos_token_id) + 1]
        assert_same_tokens(loaded, plain_models[arch], ids, choice, reference)


def test_sampling_with_a_seed_is_reproducible(client):
    body = dict(prompt=PROMPT, max_tokens=12, temperature=1.0, seed=7, n=3, logprobs=0)
    first, second = complete(client, **body), complete(client, **body)
    assert [c["text"] for c in first["choices"]] == [c["text"] for c in second["choices"]]
    assert [c["index"] for c in first["choices"]] == [0, 1, 2]
    texts = [c["text"] for c in first["choices"]]
    assert len(set(texts)) > 1  # each choice draws from its own stream
    other_seed = complete(client, **{**body, "seed": 8})
    assert [c["text"] for c in other_seed["choices"]] != texts


async def _join_a_running_batch(app, gate: StepGate, first: dict, others: list[dict]) -> list[httpx.Response]:
    """tests.gates.join_running_batch over the app in-process; every answer, `first`'s first."""
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as ac:
        head, rest = await join_running_batch(ac, app.state.lifecycle.generator, gate, first, others)
        return [await head] + list(await asyncio.gather(*rest))


@pytest.fixture
def step_gate(client):
    gate = StepGate(client.app.state.lifecycle.generator)
    yield gate
    gate.remove()


def test_seeded_request_is_the_same_alongside_other_traffic(client, step_gate):
    """The same seeded request alone and while other requests decode in the same batch."""
    body = dict(prompt="Paris is the capital of", max_tokens=10, temperature=0.9, top_k=20, seed=42)
    alone = complete(client, **body)["choices"][0]["text"]
    noise = dict(prompt="0 1 2 3 4 5 6", n=2, max_tokens=15, temperature=1.0, seed=3)  # two rows of one prompt
    step_gate.steps.clear()
    results = client.portal.call(_join_a_running_batch, client.app, step_gate, noise, [body, noise])
    assert [r.status_code for r in results] == [200] * 3
    assert Step(admitted=2, running=2) in step_gate.steps, step_gate.steps  # joined the noise while it decoded
    assert results[1].json()["choices"][0]["text"] == alone


def test_concurrent_requests_share_decode_steps_and_match_solo_greedy(client, step_gate):
    """Requests of different lengths join and leave the running batch; each still gets its solo greedy output."""
    bodies = [dict(prompt=p, max_tokens=m, temperature=0, logprobs=0)
              for p, m in [(PROMPT, 14), ("Paris is", 3), ("0 1 2 3 4 5 6 7 8 9 A B C D true", 9), ("Is", 6)]]
    solo = [complete(client, **b)["choices"][0] for b in bodies]
    generator = client.app.state.lifecycle.generator
    step_gate.steps.clear()
    results = [r.json() for r in client.portal.call(_join_a_running_batch, client.app, step_gate, bodies[0],
                                                    bodies[1:])]
    for alone, shared in zip(solo, results):
        assert shared["choices"][0]["text"] == alone["text"]
        assert shared["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(
            alone["logprobs"]["token_logprobs"], abs=1e-5)
    # the three joined the first while it was decoding, all four decoded together, and they left one by one
    assert step_gate.steps[:3] == [Step(1, 0), Step(3, 1), Step(0, 4)], step_gate.steps
    total_tokens = sum(len(c["logprobs"]["tokens"]) for c in solo)
    # a step prefills its newcomers (their first token) and decodes every row: the longest, the first, needs n - 1
    assert len(step_gate.steps) == len(solo[0]["logprobs"]["tokens"]) - 1
    assert len(step_gate.steps) < total_tokens
    assert generator.running == 0


def test_stop_string_is_cut_and_excluded(client):
    free = complete(client, prompt=PROMPT, max_tokens=12, temperature=0)["choices"][0]["text"]
    assert len(free) >= 4
    stop = free[2:4]
    choice = complete(client, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop, "never appears"])["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["text"] == free[:free.index(stop)]


def test_end_of_sequence_token_stops_with_stop(client, tiny_loaded):
    eos = tiny_loaded.tokenizer.eos_token_id
    choice = complete(client, prompt=PROMPT, max_tokens=5, temperature=0, logit_bias={str(eos): 100},
                      logprobs=0)["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["text"] == ""
    assert len(choice["logprobs"]["tokens"]) == 1  # the end token is reported, not written into text


def test_logit_bias_steers_greedy(client, tiny_loaded):
    target = ids_of(tiny_loaded, " fox", special=False)[-1]
    choice = complete(client, prompt=PROMPT, max_tokens=3, temperature=0, logit_bias={str(target): 50},
                      logprobs=0)["choices"][0]
    assert choice["logprobs"]["tokens"] == [tiny_loaded.tokenizer.decode([target])] * 3


def test_frequency_and_presence_penalties_follow_openai(client, tiny_loaded, plain_tiny):
    """processed_logits after one generated token t: logit[t] - frequency x 1 - presence."""
    ids = ids_of(tiny_loaded, PROMPT)
    out = complete(client, prompt=PROMPT, max_tokens=2, temperature=0, logprobs=0, logprobs_mode="processed_logits",
                   frequency_penalty=1.5, presence_penalty=0.5, logprob_token_ids=list(range(5)))
    lp = out["choices"][0]["logprobs"]
    with torch.inference_mode():
        first_logits = plain_tiny(torch.tensor([ids])).logits[0, -1].float()
        first = int(first_logits.argmax())
        second_logits = plain_tiny(torch.tensor([ids + [first]])).logits[0, -1].float()
    penalized = second_logits.clone()
    penalized[first] -= 1.5 + 0.5
    assert lp["token_logprobs"][0] == pytest.approx(first_logits[first].item(), abs=1e-4)
    assert lp["token_logprobs"][1] == pytest.approx(penalized[int(penalized.argmax())].item(), abs=1e-4)
    assert list(lp["token_id_logprobs"][1].values()) == pytest.approx(penalized[:5].tolist(), abs=1e-4)


def test_logprobs_modes_and_logprob_token_ids_read_one_snapshot(client, tiny_loaded, plain_tiny):
    ids = ids_of(tiny_loaded, PROMPT)
    with torch.inference_mode():
        logits = plain_tiny(torch.tensor([ids])).logits[0, -1].float()
    wanted = torch.topk(logits, 6).indices.tolist()
    common = dict(prompt=PROMPT, max_tokens=1, temperature=0, logprobs=4, logprob_token_ids=wanted)
    raw = complete(client, **common, logprobs_mode="raw_logprobs")["choices"][0]["logprobs"]
    assert list(raw["token_id_logprobs"][0]) == [str(t) for t in wanted]
    assert list(raw["token_id_logprobs"][0].values()) == pytest.approx(
        torch.log_softmax(logits, -1)[wanted].tolist(), abs=1e-5)
    for token, value in raw["top_logprobs"][0].items():  # the same numbers as the top list, bit for bit
        matches = [raw["token_id_logprobs"][0][str(t)] for t in wanted if tiny_loaded.tokenizer.decode([t]) == token]
        assert value in matches
    processed = complete(client, **common, logprobs_mode="processed_logprobs", top_k=2)["choices"][0]["logprobs"]
    values = list(processed["token_id_logprobs"][0].values())
    assert values[2:] == [NEG_INF] * 4  # filtered by top_k in the processed mode
    kept = torch.log_softmax(logits[wanted[:2]], -1).tolist()
    assert values[:2] == pytest.approx(kept, abs=1e-5)
    logits_mode = complete(client, **common, logprobs_mode="raw_logits")["choices"][0]["logprobs"]
    assert list(logits_mode["token_id_logprobs"][0].values()) == pytest.approx(logits[wanted].tolist(), abs=1e-4)


def test_echo_without_generation_needs_no_logprobs(client):
    out = complete(client, prompt=["abc", PROMPT], max_tokens=0, echo=True, n=2)
    assert [c["text"] for c in out["choices"]] == ["abc", "abc", PROMPT, PROMPT]
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    assert all(c["logprobs"] is None and c["finish_reason"] == "length" for c in out["choices"])
    assert out["usage"]["completion_tokens"] == 0


# --- streaming ----------------------------------------------------------------------------------------------------

def test_stream_chunks_add_up_to_the_full_response(client):
    body = dict(prompt=[PROMPT, "Paris is"], max_tokens=8, temperature=0, logprobs=1, echo=True, n=2)
    full = complete(client, **body)
    response = client.post("/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}})
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response.text)
    *chunks, last = events
    assert last["choices"] == [] and last["usage"] == full["usage"]
    text = {i: "" for i in range(4)}
    tokens = {i: [] for i in range(4)}
    finish = {}
    for chunk in chunks:
        assert set(chunk) == {"id", "object", "created", "model", "choices", "usage"} and chunk["usage"] is None
        assert chunk["object"] == "text_completion" and chunk["id"] == last["id"]
        (choice,) = chunk["choices"]
        assert set(choice) == {"index", "text", "logprobs", "finish_reason"}
        text[choice["index"]] += choice["text"]
        tokens[choice["index"]] += choice["logprobs"]["tokens"]
        if choice["finish_reason"]:
            finish[choice["index"]] = choice["finish_reason"]
    for c in full["choices"]:
        assert text[c["index"]] == c["text"]
        assert tokens[c["index"]] == c["logprobs"]["tokens"]
        assert finish[c["index"]] == c["finish_reason"]


def test_stream_without_usage_option_has_no_usage_field(client):
    events = sse_events(client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "stream": True}).text)
    assert events and all("usage" not in e for e in events)


def test_stream_disconnect_frees_the_batch(client):
    async def read_two_chunks():
        transport = httpx.ASGITransport(app=client.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as ac:
            async with ac.stream("POST", "/v1/completions",
                                 json={"prompt": PROMPT, "max_tokens": 100, "stream": True}) as response:
                seen = 0
                async for line in response.aiter_lines():
                    seen += line.startswith("data: ")
                    if seen == 2:
                        break
        return seen

    assert client.portal.call(read_two_chunks) == 2
    generator = client.app.state.lifecycle.generator
    wait_until(lambda: generator.running == 0, what="the disconnected stream's row to be dropped")
    assert complete(client, prompt=PROMPT, max_tokens=2)["choices"]  # still serving


# --- errors -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("body, param", [
    ({"prompt": PROMPT, "suffix": "x"}, "suffix"),
    ({"prompt": PROMPT, "best_of": 2}, "best_of"),
    ({"prompt": PROMPT, "logprobs": 21}, "logprobs"),
    ({"prompt": PROMPT, "max_tokens": 10_000}, "max_tokens"),
    ({"prompt": PROMPT, "max_tokens": -1}, "max_tokens"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": [[1, 2], [10_000]]}, "prompt[1]"),
    ({"prompt": [[1, True]]}, "prompt[0][1]"),
    ({"prompt": PROMPT, "n": 0}, "n"),
    ({"prompt": PROMPT, "n": 200}, "n"),
    ({"prompt": PROMPT, "temperature": -1}, "temperature"),
    ({"prompt": PROMPT, "top_p": 0}, "top_p"),
    ({"prompt": PROMPT, "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": PROMPT, "stop": [""]}, "stop"),
    ({"prompt": PROMPT, "logit_bias": {"abc": 1}}, "logit_bias"),
    ({"prompt": PROMPT, "logit_bias": {"100000": 1}}, "logit_bias"),
    ({"prompt": PROMPT, "logprobs_mode": "nope"}, "logprobs_mode"),
    ({"prompt": PROMPT, "logprob_token_ids": [1]}, "logprob_token_ids"),
    ({"prompt": PROMPT, "logprobs": 1, "logprob_token_ids": [100000]}, "logprob_token_ids"),
    ({"prompt": PROMPT, "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": PROMPT, "frobnicate": 1}, "frobnicate"),
])
def test_bad_requests_get_a_400_naming_the_field(client, body, param):
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]


def test_unknown_model_is_404(client):
    response = client.post("/v1/completions", json={"model": "gpt-4", "prompt": PROMPT})
    assert response.status_code == 404 and response.json()["error"]["param"] == "model"


class _SmallBudget:
    """A memory budget that holds one generating row only while its cache stays within `final` tokens."""

    def __init__(self, final: int):
        self.final = final

    def generation_fits(self, rows: int, final: int, prefill_rows: int, prefill_width: int) -> bool:
        return final <= self.final

    def scoring_tokens(self, cache_rows: int, cache_final: int, max_batch_tokens: int) -> int:
        return max_batch_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_a_generation_the_memory_budget_cannot_hold_is_a_400_before_any_streamed_byte(client, monkeypatch, stream):
    """A prompt whose choice could never fit even alone is refused with a status line, not a stream's error event;
    the field named is max_tokens when a smaller one would fit, else the prompt."""
    monkeypatch.setattr(client.app.state.lifecycle.engine, "budget", _SmallBudget(final=24))
    too_many = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 40, "stream": stream})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "max_tokens", too_many.text
    too_long = client.post("/v1/completions", json={"prompt": [[5, 6, 7], list(range(5, 35))], "max_tokens": 1,
                                                    "stream": stream})
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "prompt[1]", too_long.text
    fits = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "stream": stream})
    assert fits.status_code == 200, fits.text


# --- the official openai SDK against a live server --------------------------------------------------------------

@pytest.fixture(scope="module")
def sdk(tiny_loaded):
    with live_server(create_app(tiny_settings(), loaded=tiny_loaded)) as base_url:
        yield openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_sdk_completion_with_logprobs_and_echo(sdk):
    out = sdk.completions.create(model=TINY_NAME, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2, echo=True)
    assert out.object == "text_completion" and out.model == TINY_NAME
    choice = out.choices[0]
    assert choice.text.startswith(PROMPT) and choice.finish_reason in ("length", "stop")
    assert choice.logprobs.token_logprobs[0] is None and len(choice.logprobs.tokens) == out.usage.total_tokens
    assert out.usage.completion_tokens == 4


def test_sdk_stream(sdk):
    plain = sdk.completions.create(model=TINY_NAME, prompt=PROMPT, max_tokens=6, temperature=0)
    stream = sdk.completions.create(model=TINY_NAME, prompt=PROMPT, max_tokens=6, temperature=0, stream=True,
                                    stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == plain.choices[0].text
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens


def test_sdk_errors_raise_the_sdk_exceptions(sdk):
    with pytest.raises(openai.BadRequestError) as bad:
        sdk.completions.create(model=TINY_NAME, prompt=PROMPT, suffix="no")
    assert bad.value.body["param"] == "suffix"
    with pytest.raises(openai.NotFoundError):
        sdk.completions.create(model="gpt-4", prompt=PROMPT)
    assert math.isfinite(sdk.completions.create(model=TINY_NAME, prompt=PROMPT, max_tokens=1).usage.total_tokens)


def test_a_failed_step_fails_its_requests_and_the_loop_goes_on(client, monkeypatch):
    def broken_decode_step(model, plan, batch, next_tokens):
        raise RuntimeError("simulated model failure")

    monkeypatch.setattr("app.engine.generation.decode_step", broken_decode_step)
    response = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3})
    assert response.status_code == 500
    assert response.json()["error"] == {"message": "the model failed while generating",
                                        "type": "internal_server_error", "param": None, "code": None}
    streamed = sse_events(client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3,
                                                               "stream": True}).text)
    assert streamed[-1]["error"]["type"] == "internal_server_error"  # the stream ends with an error event
    monkeypatch.undo()
    assert client.get("/health").status_code == 200
    assert complete(client, prompt=PROMPT, max_tokens=3)["choices"][0]["finish_reason"] == "length"
    assert client.app.state.lifecycle.generator.running == 0


def test_a_dead_generation_loop_fails_liveness_and_waiting_callers(tiny_loaded):
    with TestClient(create_app(tiny_settings(), loaded=tiny_loaded)) as client:
        wait_ready(client)
        engine = client.app.state.lifecycle.engine  # one loop drives scoring and generation
        client.portal.call(_kill_loop, engine)
        health = client.get("/health")
        assert health.status_code == 503 and "generation) died" in health.json()["error"]["message"]
        response = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
        assert response.status_code == 503


async def _kill_loop(engine):
    engine._task.cancel()
    await asyncio.sleep(0)
    await asyncio.sleep(0)


def test_admission_limits_queue_work_without_deadlock(tiny_loaded, client):
    """With room for 2 decoding rows, a request with n = 4 still runs (alone), and queued requests wait their turn."""
    bodies = [dict(prompt=PROMPT, max_tokens=6, temperature=0, n=4),
              dict(prompt="Paris is", max_tokens=5, temperature=0),
              dict(prompt="0 1 2 3 4 5 6 7 8 9", max_tokens=7, temperature=0)]
    expected = [complete(client, **b)["choices"] for b in bodies]
    settings = tiny_settings(max_batch_size=2, max_batch_tokens=16, max_cache_tokens=40)
    with TestClient(create_app(settings, loaded=tiny_loaded)) as small:
        wait_ready(small)

        async def together():
            transport = httpx.ASGITransport(app=small.app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as ac:
                return await asyncio.gather(*(ac.post("/v1/completions", json=b) for b in bodies))

        for response, choices in zip(small.portal.call(together), expected):
            assert response.status_code == 200
            assert [c["text"] for c in response.json()["choices"]] == [c["text"] for c in choices]
