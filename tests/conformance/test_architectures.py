"""Every scoring and generation path, on every architecture of the zoo, against the plain transformers forward of the
same weights, one unpadded sequence at a time (float32, within 1e-4)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from models.tiny import WINDOW

TOL = 1e-4
LABELS = [3, 17, 42, 99, 200]


def random_ids(n: int, seed: int) -> list[int]:
    """Token ids of the tokenizer's ordinary vocabulary (0-2 are special), seeded."""
    return torch.randint(3, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.inference_mode()
def plain_logprobs(zoo, ids: list[int]) -> torch.Tensor:
    """The plain model's float32 logprobs at every position of one unpadded sequence: [T, V]."""
    return zoo.plain(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def score(zoo, body: dict) -> dict:
    response = httpx.post(f"{zoo.url}/score", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def assert_labels(entry: dict, reference: torch.Tensor) -> None:
    assert entry["label_logprobs"] == pytest.approx(reference[LABELS].tolist(), abs=TOL)


def test_concurrent_prompts_of_mixed_lengths(zoo):
    """Concurrent callers, and one request whose prompts share no prefix: both batched, both packed when packable."""
    lengths = [5, 11, 23, 40, 64, 90]
    prompts = [random_ids(n, seed=n) for n in lengths]
    assert max(lengths) > 4 * WINDOW
    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(lambda p: score(zoo, {"query": p, "label_token_ids": LABELS, "top_logprobs": 4}),
                                prompts))
    for prompt, answer in zip(prompts, answers):
        reference = plain_logprobs(zoo, prompt)[-1]
        (entry,) = answer["data"]
        assert_labels(entry, reference)
        top = torch.topk(reference, 4)
        assert [t["token_id"] for t in entry["top_logprobs"]] == top.indices.tolist()
        assert [t["logprob"] for t in entry["top_logprobs"]] == pytest.approx(top.values.tolist(), abs=TOL)
    # item_first with distinct items: no common prefix, so all six run from scratch in one batch
    together = score(zoo, {"query": [5], "items": [p[:-1] for p in prompts], "item_first": True,
                           "label_token_ids": LABELS})
    for prompt, entry in zip(prompts, together["data"]):
        assert_labels(entry, plain_logprobs(zoo, prompt[:-1] + [5])[-1])


def test_items_over_a_shared_query_and_a_prefix_cache_hit(zoo):
    query = random_ids(3 * WINDOW + 5, seed=1)
    items = [random_ids(n, seed=100 + n) for n in (3, 9, 15)]
    body = {"query": query, "items": items, "label_token_ids": LABELS}
    first, second = score(zoo, body), score(zoo, body)
    for answer in (first, second):
        for item, entry in zip(items, answer["data"]):
            assert_labels(entry, plain_logprobs(zoo, query + item)[-1])
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert (cached > 0) == zoo.served.shares_prefixes, cached


def test_multi_token_candidates(zoo):
    query = random_ids(2 * WINDOW + 7, seed=2)
    candidates = [[7], [11, 12, 13], random_ids(WINDOW + 3, seed=3)]
    answer = score(zoo, {"query": query, "items": [[], random_ids(4, seed=4)], "candidates": candidates})
    for item, entry in zip([[], random_ids(4, seed=4)], answer["data"]):
        prompt = query + item
        for candidate, per_token in zip(candidates, entry["candidate_token_logprobs"]):
            reference = plain_logprobs(zoo, prompt + candidate)
            expected = [reference[len(prompt) - 1 + j, token].item() for j, token in enumerate(candidate)]
            assert per_token == pytest.approx(expected, abs=TOL)


def test_echo_prompt_logprobs(zoo):
    prompt = random_ids(6 * WINDOW, seed=5)
    response = httpx.post(f"{zoo.url}/v1/completions", timeout=60, json={
        "model": zoo.arch, "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1})
    assert response.status_code == 200, response.text
    got = response.json()["choices"][0]["logprobs"]["token_logprobs"]
    reference = plain_logprobs(zoo, prompt)
    expected = [reference[j, prompt[j + 1]].item() for j in range(len(prompt) - 1)]
    assert got[0] is None
    assert got[1:] == pytest.approx(expected, abs=TOL)


def test_greedy_generation(zoo):
    prompt = random_ids(3 * WINDOW, seed=6)
    response = httpx.post(f"{zoo.url}/v1/completions", timeout=60, json={
        "model": zoo.arch, "prompt": prompt, "max_tokens": 8, "temperature": 0})
    assert response.status_code == 200, response.text
    ids = list(prompt)
    eos = zoo.served.tokenizer.eos_token_id
    for _ in range(8):  # the plain model's own greedy choice, one full forward per token
        token = int(plain_logprobs(zoo, ids)[-1].argmax())
        if token == eos:
            break
        ids.append(token)
    assert response.json()["choices"][0]["text"] == zoo.served.tokenizer.decode(ids[len(prompt):])


def test_bfloat16_matches_plain_bfloat16(zoo):
    """genscore in bfloat16 against transformers in bfloat16: the same rounding noise, never a different model."""
    from transformers import AutoModelForCausalLM

    from models import forward_logits, load_model
    from models.selfcheck import TOLERANCE

    served = load_model(str(zoo.folder), device="cpu", dtype="bfloat16", cache_dir=None)
    plain = AutoModelForCausalLM.from_pretrained(zoo.folder, dtype=torch.bfloat16).eval()
    prompts = [random_ids(n, seed=10 + n) for n in (6, 3 * WINDOW, 7 * WINDOW)]
    got = forward_logits(served.model, served.plan, prompts, served.pad_token_id).log_softmax(-1)  # [3, V]
    with torch.inference_mode():
        want = torch.stack([plain(torch.tensor([p])).logits[0, -1].float().log_softmax(-1) for p in prompts])
    expected_gap = ((got - want).abs() * want.exp()).sum(-1).max().item()
    assert expected_gap < TOLERANCE[torch.bfloat16], expected_gap


def test_greedy_generation_is_what_generate_gives(zoo):
    """The same prompt through the server and through transformers' own `generate` (greedy, its own cache)."""
    prompt = random_ids(2 * WINDOW + 3, seed=7)
    response = httpx.post(f"{zoo.url}/v1/completions", timeout=60, json={
        "model": zoo.arch, "prompt": prompt, "max_tokens": 6, "temperature": 0})
    assert response.status_code == 200, response.text
    with torch.inference_mode():
        generated = zoo.plain.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                                       eos_token_id=zoo.served.tokenizer.eos_token_id, pad_token_id=0)
    ids = generated[0, len(prompt):].tolist()
    if zoo.served.tokenizer.eos_token_id in ids:
        ids = ids[: ids.index(zoo.served.tokenizer.eos_token_id)]
    assert response.json()["choices"][0]["text"] == zoo.served.tokenizer.decode(ids, skip_special_tokens=True)


def test_self_check_keeps_the_fast_paths_that_apply(zoo):
    """Packing wherever attention is SDPA and no layer carries state, padded batches elsewhere; key/value prefix
    reuse over plain full attention, packed suffixes over it wherever attention is SDPA, else (for layers that carry
    state) a copy of the whole cache where it proves exact; batched decoding over attention caches, else each row alone with its own cache."""
    from models.prefix import supports_prefix_reuse

    plan = zoo.served.plan
    paths = {check.name: check for check in plan.checks}
    assert paths["output_head"].enabled
    assert "prepacked_linears" not in paths or paths["prepacked_linears"].enabled or \
        "has no attribute 'weight'" in paths["prepacked_linears"].reason  # a model that reads a linear's weight
    sdpa = zoo.plain.config._attn_implementation == "sdpa"
    if plan.stateful_layers:
        assert not paths["packed_batches"].enabled and "carry state" in paths["packed_batches"].reason
        assert not paths["batched_decoding"].enabled and plan.decoding != "batched"
        assert plan.prefix_reuse in ("off", "whole_cache")
    elif sdpa and zoo.arch != "llama4":  # chunked attention: a chunk's start depends on the place in the row
        assert paths["packed_batches"].enabled, paths["packed_batches"]
        assert plan.layout == "packed" and plan.decoding == "batched"
    if plan.layout != "packed":
        assert plan.layout == "padded" and paths["padded_batches"].enabled
    key_values = supports_prefix_reuse(zoo.plain) and not plan.stateful_layers
    assert paths["shared_prefix"].enabled == key_values == (plan.prefix_reuse == "key_values")
    assert paths["packed_suffixes"].enabled == (key_values and sdpa), paths["packed_suffixes"]
    if not key_values:
        assert paths["whole_cache_prefix"].enabled == (plan.prefix_reuse == "whole_cache")
    if not plan.stateful_layers:  # attention only: items run from scratch with the rest of the batch
        assert plan.prefix_reuse != "whole_cache"
    assert all(c.difference is None or c.difference <= TOL for c in paths.values() if c.enabled)
