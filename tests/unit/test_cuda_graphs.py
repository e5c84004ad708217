"""CUDA graphs of packed calls, run on CPU through a stand-in graph (it replays the captured call into the captured
output buffer) and the stand-in varlen kernel: the bucketing, the padding segments and the static buffers give the
plain forward's numbers, a call no bucket holds runs eagerly, and the self-check switches off graphs that replay
wrong numbers."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest
import torch

import models.cuda_graphs as cuda_graphs
from models.attention_cuda import VARLEN
from models.cuda_graphs import GRAPHS_PATH, PackedGraphs, padded_lengths
from models.forward import forward_logits
from models.selfcheck import install_fast_paths
from tests.unit.packed_attention_cases import attention_model, packed_plan
from tests.unit.test_varlen_attention import on_cpu  # noqa: F401 - a fixture

pytestmark = pytest.mark.unit


class StandInGraph:
    """A captured call replayed eagerly, its result written into the buffer the capture returned, as a graph's is."""

    def capture(self, call):
        self.call = call
        self.out = call()
        return self.out

    def replay(self):
        self.out.copy_(self.call())


class WrongGraph(StandInGraph):
    """A replay that writes the neighbouring token's states: what a graph with a stale input buffer would give."""

    def replay(self):
        self.out.copy_(self.call().roll(1, dims=1))


def test_padding_fills_a_bucket_with_segments_of_at_least_one_token():
    assert padded_lengths([5, 7], 32, 6) == [5, 7, 1, 1, 1, 17]
    assert padded_lengths([5, 7], 16, 3) == [5, 7, 4]
    assert padded_lengths([5, 7], 12, 3) is None  # no padding segment left
    assert padded_lengths([5, 7], 14, 6) is None  # four padding segments, two tokens
    assert padded_lengths([5, 7], 32, 2) is None  # no room for a padding segment
    assert padded_lengths([5, 0], 32, 6) is None  # an empty segment never reaches the kernel


def _sequences(lengths, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 300, (n,), generator=generator).tolist() for n in lengths]


@pytest.mark.parametrize("window", [None, 8])
def test_replayed_buckets_give_the_eager_packed_forward(on_cpu, monkeypatch, window):  # noqa: F811
    monkeypatch.setattr(cuda_graphs, "stand_in_graph", StandInGraph)
    model = attention_model(window)
    plan = packed_plan(model, VARLEN)
    graphs = PackedGraphs(plan.body, VARLEN, model.device, bucket_tokens=(64, 128))
    assert [(b.tokens, b.segments) for b in graphs.buckets] == [(64, 8), (128, 16)]
    graphed = replace(plan, graphs=graphs)
    for lengths in ([5, 17, 9], [40, 3, 30, 11], [3] * 7, [60, 50]):
        sequences = _sequences(lengths)
        used = graphs.bucket_for(lengths)
        keep = [min(2, n) for n in lengths]
        eager = forward_logits(model, plan, sequences, 0, keep)
        replayed = forward_logits(model, graphed, sequences, 0, keep)
        assert (replayed - eager).abs().max().item() < 1e-5, (lengths, used and used[0].tokens)
    assert graphs.bucket_for([3] * 8) is not None and graphs.bucket_for([3] * 16) is None  # too many segments
    assert graphs.bucket_for([120, 5]) is None  # too many tokens: the call runs eagerly
    eager = forward_logits(model, plan, _sequences([120, 5]), 0)
    assert (forward_logits(model, graphed, _sequences([120, 5]), 0) - eager).abs().max().item() < 1e-5


@pytest.fixture
def graphed_cpu(on_cpu, monkeypatch):  # noqa: F811
    """Graphs captured on CPU through the stand-in, in two small buckets (a tiny model's probe fits them)."""
    monkeypatch.setattr(cuda_graphs, "DEVICE_TYPES", ("cpu",))
    monkeypatch.setattr(cuda_graphs, "BUCKET_TOKENS", (64, 128))
    monkeypatch.setattr(cuda_graphs, "stand_in_graph", StandInGraph)
    return monkeypatch


def test_the_self_check_keeps_graphs_that_agree(graphed_cpu):
    model = attention_model(None)
    plan = install_fast_paths(model, 300, 256, 0)
    assert plan.attention_kernel == VARLEN and plan.enabled(GRAPHS_PATH)
    assert plan.as_dict()["cuda_graph_buckets"] == [64, 128]
    check = next(c for c in plan.checks if c.name == GRAPHS_PATH)
    assert check.difference < 1e-4


def test_the_self_check_switches_off_graphs_that_replay_wrong_numbers(graphed_cpu, caplog):
    graphed_cpu.setattr(cuda_graphs, "stand_in_graph", WrongGraph)
    model = attention_model(None)
    with caplog.at_level(logging.WARNING, logger="genscore.models"):
        plan = install_fast_paths(model, 300, 256, 0)
    assert plan.attention_kernel == VARLEN and plan.graphs is None and not plan.enabled(GRAPHS_PATH)
    assert any(GRAPHS_PATH in r.getMessage() and "OFF" in r.getMessage() for r in caplog.records)


def test_the_loop_kernel_is_never_graphed(graphed_cpu):
    graphed_cpu.setattr("models.attention_cuda._DEVICE_TYPES", ())  # no varlen kernel on this device
    plan = install_fast_paths(attention_model(None), 300, 256, 0)
    assert plan.graphs is None and not plan.enabled(GRAPHS_PATH)
