"""The tokenizer routes in vLLM's shapes (/tokenize, /detokenize, /tokenizer_info), as lm-eval's remote tokenizer
uses them."""

from __future__ import annotations

import pytest

from tests.api.conftest import TINY_NAME

TEXT = "The quick brown fox"


def test_tokenize_shape_and_ids(client, tiny_loaded):
    out = client.post("/tokenize", json={"model": TINY_NAME, "prompt": TEXT}).json()
    ids = tiny_loaded.tokenizer(TEXT)["input_ids"]
    assert out == {"count": len(ids), "max_model_len": tiny_loaded.max_length, "tokens": ids, "token_strs": None}
    with_strs = client.post("/tokenize", json={"prompt": TEXT, "return_token_strs": True,
                                               "add_special_tokens": False}).json()
    assert with_strs["tokens"] == tiny_loaded.tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    assert with_strs["token_strs"] == tiny_loaded.tokenizer.convert_ids_to_tokens(with_strs["tokens"])


def test_tokenize_chat_uses_the_template(client, tiny_loaded):
    messages = [{"role": "user", "content": "hi"}]
    out = client.post("/tokenize", json={"messages": messages}).json()
    text = tiny_loaded.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert out["tokens"] == tiny_loaded.tokenizer(text, add_special_tokens=False)["input_ids"]
    without = client.post("/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
    assert without["count"] < out["count"]


def test_detokenize_round_trip(client, tiny_loaded):
    ids = tiny_loaded.tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    assert client.post("/detokenize", json={"tokens": ids}).json() == {"prompt": TEXT}


def test_tokenizer_info_has_what_remote_tokenizers_read(client, tiny_loaded):
    info = client.get("/tokenizer_info").json()
    assert info["tokenizer_class"] == type(tiny_loaded.tokenizer).__name__
    assert info["eos_token"] == tiny_loaded.tokenizer.eos_token and "bos_token" in info and "pad_token" in info
    assert info["chat_template"] == tiny_loaded.tokenizer.chat_template
    assert not {"name_or_path", "vocab_file", "merges_file"} & set(info)  # no paths of this server


@pytest.mark.parametrize("route, body, param", [
    ("/tokenize", {"prompt": TEXT, "model": "other"}, "model"),
    ("/tokenize", {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": True,
                   "continue_final_message": True}, "continue_final_message"),
    ("/detokenize", {"tokens": [100_000]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": ["a"]}, "tokens[0]"),
])
def test_bad_requests(client, route, body, param):
    response = client.post(route, json=body)
    assert response.status_code in (400, 404), response.text
    assert response.json()["error"]["param"] == param
