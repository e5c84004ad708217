"""Conformance fixtures: one tiny seeded model per architecture of the zoo, served over HTTP, next to a plain copy
of the same weights loaded straight from transformers (never genscore's loader or forward code)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from transformers import AutoModelForCausalLM

from app.main import create_app
from app.settings import Settings
from models import LoadedModel, load_model
from models.tiny import CONFORMANCE_ARCHITECTURES, make_tiny_model
from tests.conftest import live_server

MAX_POSITIONS = 256


@dataclass
class Zoo:
    """One architecture under test: its folder, genscore's served model, the plain model and the server's URL."""

    arch: str
    folder: object
    served: LoadedModel
    plain: torch.nn.Module
    url: str


@pytest.fixture(scope="session")
def zoo_root(tmp_path_factory):
    return tmp_path_factory.mktemp("zoo")


@pytest.fixture(scope="module", params=CONFORMANCE_ARCHITECTURES)
def zoo(request, zoo_root) -> Zoo:
    arch = request.param
    folder = make_tiny_model(zoo_root / arch, arch, max_positions=MAX_POSITIONS)
    served = load_model(str(folder), device="cpu", dtype="float32", cache_dir=None)
    plain = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    settings = Settings(model="unused", served_model_name=arch, device="cpu", dtype="float32")
    with live_server(create_app(settings, loaded=served)) as url:
        yield Zoo(arch, folder, served, plain, url)
