"""What a generated sequence needs besides the model: its seeded random stream, its end-of-sequence ids, the text
held back for a possible stop string, and the logprobs read at one of its positions."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

import sampler
from app.engine.results import PositionLogprobs
from app.engine.work import GenerationParams
from models import LoadedModel
from sampler import SamplingParams

_GOLDEN_GAMMA = 0x9E3779B97F4A7C15  # spreads the seeds of a request's n choices far apart


def held_back(text: str, stop: Sequence[str]) -> int:
    """Characters at the end of `text` that must wait: an incomplete UTF-8 character, or a possible stop-string start."""
    hold = len(text) - len(text.rstrip("\ufffd"))
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                hold = max(hold, k)
                break
    return hold


def position_params(params: GenerationParams, token_id: int) -> SamplingParams:
    """The sampler row that reads one position: the token there and logprob_token_ids as labels, plus the top-N."""
    return dataclasses.replace(params.sampling, label_token_ids=(token_id, *params.logprob_token_ids),
                               top_logprobs=params.logprobs or 0)


def score_positions(logits: torch.Tensor, asked: list[SamplingParams]) -> list[PositionLogprobs]:
    rows = sampler.to_rows(sampler.score(logits, asked), asked)
    return [PositionLogprobs(p.label_token_ids[0], r.label_values[0], list(zip(r.top_ids, r.top_values)),
                             r.label_values[1:]) for p, r in zip(asked, rows)]


def seeded_generator(seed: int | None, choice: int, device: torch.device) -> torch.Generator | None:
    """Choice i of a seeded request draws from its own stream, so a request is reproducible whatever its neighbours."""
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed((seed + choice * _GOLDEN_GAMMA) % (1 << 64))
    return generator


def eos_ids(loaded: LoadedModel) -> set[int]:
    """End-of-sequence ids: the tokenizer's and the model's generation config's (an int or a list)."""
    ids = set()
    if loaded.tokenizer.eos_token_id is not None:
        ids.add(int(loaded.tokenizer.eos_token_id))
    config_eos = getattr(getattr(loaded.model, "generation_config", None), "eos_token_id", None)
    if isinstance(config_eos, int):
        ids.add(config_eos)
    elif isinstance(config_eos, (list, tuple)):
        ids.update(int(i) for i in config_eos)
    return ids
