"""Compiled decoder layers for packed scoring calls: inductor fuses the element-wise ops between the model's kernels."""

from __future__ import annotations

import inspect
import os
from pathlib import Path

import torch
from transformers import PreTrainedModel

# Where inductor keeps its compiled kernels and graphs, under the cache directory: the next start reuses them.
INDUCTOR_CACHE = "inductor"


class _CompiledWhenPacked:
    """A decoder layer's forward: the compiled graph for packed calls without a key/value cache, else the eager one.

    Only packed scoring calls (models/forward.py) run compiled: their attention is one opaque op
    (models/packed.py), their linears too (models/prepack.py), so the graph holds the layer's own element-wise
    math (norms, rotary, activations, residuals) for inductor to fuse. Calls with a cache (prefill, decoding,
    shared prefixes) mutate Python cache objects and stay eager.
    """

    def __init__(self, eager):
        self.eager = eager
        # dynamic: one graph for every pack length; the layers share it (their weights are its inputs)
        self.compiled = torch.compile(eager, dynamic=True)

    def __call__(self, *args, **kwargs):
        packed = kwargs.get("cu_seq_lens_q") is not None
        cached = kwargs.get("past_key_values") is not None or kwargs.get("cache") is not None
        hidden = args[0] if args else kwargs.get("hidden_states")  # [1, T, H]
        # A one-token call would compile a graph of its own (dynamic shapes specialise size 1) while serving.
        many = hidden is not None and hidden.shape[-2] > 1
        return (self.compiled if packed and many and not cached else self.eager)(*args, **kwargs)


def decoder_layers(model: PreTrainedModel) -> list[torch.nn.Module]:
    """The repeated blocks of the decoder body: the children of its largest ModuleList."""
    lists = [m for m in model.base_model.modules() if isinstance(m, torch.nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []


def compile_layers(model: PreTrainedModel, cache_dir: Path | None) -> bool:
    """Make each decoder layer run compiled on packed calls (undo with uncompile_layers); False if it has none.

    The compile itself happens on the first packed call (the load-time self-check's), on the calling thread.
    """
    layers = decoder_layers(model)
    if not layers or any("cu_seq_lens_q" in inspect.signature(layer.forward).parameters for layer in layers):
        return False  # no layers, or ones that take packing arguments by name (the dispatch reads them from kwargs)
    if cache_dir is not None:
        # The user's own setting wins; inductor reads it when it first compiles.
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(cache_dir) / INDUCTOR_CACHE))
    for layer in layers:
        layer.forward = _CompiledWhenPacked(layer.forward)
    return True


def uncompile_layers(model: PreTrainedModel) -> None:
    """Put each decoder layer's eager forward back."""
    for layer in decoder_layers(model):
        if isinstance(layer.__dict__.get("forward"), _CompiledWhenPacked):
            del layer.forward


def is_compiled(model: PreTrainedModel) -> bool:
    """Whether compile_layers is in force on `model`."""
    return any(isinstance(layer.__dict__.get("forward"), _CompiledWhenPacked) for layer in decoder_layers(model))
