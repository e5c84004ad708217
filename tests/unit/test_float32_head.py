"""build_head: a half-precision plain lm_head gives float32 logits unless told otherwise; a head it is given wins."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from models.body import find_body
from models.float32_head import Float32Head
from models.head import build_head

pytestmark = pytest.mark.unit


def _model(dtype: torch.dtype):
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_hidden_layers=1,
                                      vocab_size=300, tie_word_embeddings=False)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).to(dtype).eval()


def test_float32_logits_from_a_bfloat16_head_and_the_rounded_ones_when_asked():
    model = _model(torch.bfloat16)
    body = find_body(model)
    wide, rounded = build_head(model, body), build_head(model, body, float32_logits=False)
    assert isinstance(wide.lm_head, Float32Head) and type(rounded.lm_head) is torch.nn.Linear
    assert model.lm_head is rounded.lm_head  # the model's own head is untouched
    hidden = torch.randn(1, 5, 32, dtype=torch.bfloat16) * 4  # [1, N, H]
    with torch.inference_mode():
        exact = hidden.float() @ model.lm_head.weight.float().t()  # [1, N, V]
        assert wide(inputs_embeds=hidden).logits.dtype == torch.float32
        torch.testing.assert_close(wide(inputs_embeds=hidden).logits, exact, atol=1e-5, rtol=1e-5)
        assert rounded(inputs_embeds=hidden).logits.dtype == torch.bfloat16


def test_a_given_head_and_a_float32_model_keep_their_own():
    model = _model(torch.bfloat16)
    given = torch.nn.Identity()
    assert build_head(model, find_body(model), given).lm_head is given
    plain = _model(torch.float32)
    assert type(build_head(plain, find_body(plain)).lm_head) is torch.nn.Linear
