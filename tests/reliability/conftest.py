"""Reliability-tier helpers: faults injected inside the real forward pass, a gate that holds the model, and servers on
127.0.0.1 with the limits under test."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

import httpx
import pytest
import torch

from app.main import create_app
from tests.api.conftest import client, tiny_settings  # noqa: F401 - `client`: the in-process app on the tiny model
from tests.conftest import live_server
from tests.gates import async_wait_until, wait_until  # noqa: F401 - re-exported for the tier's tests

POISON = 13  # a token id that makes the injected fault fire when it reaches the model


class ModelProbe:
    """A forward pre-hook on the model body: it sees the input ids of every forward pass as [B, T] (a packed call's
    sequences are unpacked and left-padded with 0), records them, can hold the pass at a gate, and can raise inside
    the pass (the fault a broken or full device would raise there)."""

    def __init__(self, model: torch.nn.Module):
        self.seen: list[list[int]] = []  # every sequence that reached the model (pad ids included)
        self.batch_sizes: list[int] = []
        self.passes: list[list[list[int]]] = []  # the rows of every pass, in order: prefills have more than one
        # column, decode steps one
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()  # set when a forward pass has started (and may be waiting at the gate)
        self.fault: Callable[[torch.Tensor], Exception | None] = lambda ids: None
        self._handle = model.base_model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]  # [B, T]
        bounds = kwargs.get("cu_seq_lens_q")  # set on packed calls: [1, T] holding B sequences back to back
        if bounds is not None:
            rows = [ids[0, a:b] for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist())]
            ids = torch.zeros((len(rows), max(len(r) for r in rows)), dtype=ids.dtype)
            for i, row in enumerate(rows):
                ids[i, ids.shape[1] - len(row):] = row
        self.entered.set()
        self.gate.wait(60)
        self.batch_sizes.append(ids.shape[0])
        self.passes.append(ids.tolist())
        self.seen.extend(ids.tolist())
        error = self.fault(ids)
        if error is not None:
            raise error

    def reached_model(self, ids: list[int]) -> bool:
        """Whether this exact sequence (left-padded or not) ran through the model."""
        n = len(ids)
        return any(row[-n:] == ids for row in self.seen)

    def remove(self) -> None:
        self.gate.set()
        self._handle.remove()


@pytest.fixture
def probe(tiny_loaded):
    model_probe = ModelProbe(tiny_loaded.model)
    yield model_probe
    model_probe.remove()


@contextlib.contextmanager
def serving(tiny_loaded, **settings):
    """A live server on 127.0.0.1 on the tiny Llama model with `settings`; yields (base_url, app)."""
    app = create_app(tiny_settings(**settings), loaded=tiny_loaded)
    with live_server(app) as base_url:
        yield base_url, app


def bisection(size: int, bad: int) -> list[int]:
    """The batch sizes that retrying a failing batch in halves runs, when only the unit at index `bad` fails."""
    def split(lo: int, hi: int) -> list[int]:
        sizes = [hi - lo]
        if hi - lo > 1 and lo <= bad < hi:
            half = (hi - lo) // 2
            sizes += split(lo, lo + half) + split(lo + half, hi)
        return sizes
    return split(0, size)


def poisoned_row(rows: list[list[int]]) -> int:
    (index,) = [i for i, row in enumerate(rows) if POISON in row]
    return index


def score_body(ids: list[int], labels: list[int] | None = None, **extra) -> dict:
    return {"query": ids, "label_token_ids": labels or [5, 9, 200], "top_logprobs": 3, **extra}


def answer(response: httpx.Response) -> list:
    """The numbers of a /score answer, to compare one request's answer alone and in a crowd."""
    return [(d["label_logprobs"], [t["token_id"] for t in d["top_logprobs"] or []]) for d in response.json()["data"]]


def same_answer(a: list, b: list, tol: float = 1e-4) -> bool:
    if len(a) != len(b):
        return False
    for (la, ta), (lb, tb) in zip(a, b):
        if ta != tb or len(la) != len(lb) or any(abs(x - y) > tol for x, y in zip(la, lb)):
            return False
    return True
