"""The forward plan: every fast-path decision the load-time self-check made for one model, in one frozen object."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal

from torch import nn

# How scoring calls lay out many sequences: packed back to back in one row, left-padded micro-batches, or each
# sequence alone through the model's own forward (the plain path, right for every model).
Layout = Literal["packed", "padded", "one_at_a_time"]
# How a shared prefix is reused: not at all, its attention keys and values (every cache layer plain attention),
# or a copy of the model's whole cache at the prefix boundary (attention, convolution and recurrent states).
PrefixReuse = Literal["off", "key_values", "whole_cache"]
# How generation advances: rows batched in one key/value cache, each row alone with the model's own cache, or each
# token by a full forward over the sequence so far (for a model that keeps no cache object of its own).
Decoding = Literal["batched", "per_request", "recompute"]
# How packed suffixes attend to their shared prefix (models/packed.py): SDPA under the mask of what each token sees,
# or cascade attention (models/cascade.py): the prefix's keys in one non-causal call, their own keys causally,
# merged by log-sum-exp, with no mask.
PrefixAttention = Literal["masked", "cascade"]


@dataclass(frozen=True)
class PathCheck:
    """One fast path's verdict: on or off, its largest difference from the plain forward, and why it is off."""

    name: str
    enabled: bool
    difference: float | None
    reason: str = ""


@dataclass(frozen=True, eq=False)
class ForwardPlan:
    """What every forward of one model runs: the body and head it reads, the layout of scoring calls, prefix reuse,
    decoding, batch invariance and compiled layers, and each path's verdict (why it is on or off).

    Built by the self-check (models/selfcheck.py) or by plain_plan; held by the loaded model and passed to every
    function in models/ that runs the model. The default values are the plain path.
    """

    body: nn.Module  # the module the model's forward reads its final hidden states from (models/body.py)
    head: nn.Module  # the model's forward from those hidden states on (models/head.py)
    layout: Layout = "one_at_a_time"
    prefix_reuse: PrefixReuse = "off"
    packed_suffixes: bool = False  # suffixes over key/value prefixes run packed (models/prefix.py)
    decoding: Decoding = "recompute"
    batch_invariant: bool = False  # linears run in fixed row tiles and layouts do not depend on neighbours
    compiled: bool = False  # decoder layers run compiled on packed calls (models/compiled.py)
    # The implementation of the packed-attention op (models/packed.py segment_attention): "loop", one SDPA call per
    # segment, or "varlen", one flash-attention call per layer (models/attention_cuda.py, CUDA only).
    attention_kernel: str = "loop"
    # Decode steps' attention through the CPU decode kernel (models/attention_cpu.py decode_attention_cpu): each row's
    # query against its own keys in one call per layer, instead of SDPA over the padded cache under its mask.
    decode_kernel: bool = False
    # CUDA graphs of packed calls, one per bucket of packed lengths (models/cuda_graphs.py PackedGraphs), or None.
    graphs: object | None = None
    prefix_attention: PrefixAttention = "masked"
    held_head: nn.Module | None = None  # a module the head holds beside the model's weights (a pre-packed lm_head)
    checks: tuple[PathCheck, ...] = ()
    tolerance: float | None = None
    seconds: float = 0.0
    stateful_layers: tuple[str, ...] = field(default=())  # cache layers that carry state across positions

    def enabled(self, name: str) -> bool:
        return any(check.name == name and check.enabled for check in self.checks)

    @property
    def shares_prefixes(self) -> bool:
        """Whether a shared prefix is computed once and reused (checked at load)."""
        return self.prefix_reuse != "off"

    def as_dict(self) -> dict:
        """What /v1/models reports: each decision, and each path's verdict with its reason."""
        return {"tolerance": self.tolerance, "seconds": round(self.seconds, 3), "layout": self.layout,
                "prefix_reuse": self.prefix_reuse, "decoding": self.decoding,
                "attention_kernel": self.attention_kernel, "decode_kernel": self.decode_kernel,
                "prefix_attention": self.prefix_attention, "batch_invariant": self.batch_invariant,
                "cuda_graph_buckets": [] if self.graphs is None else self.graphs.bucket_tokens,
                "stateful_layers": list(self.stateful_layers),
                "paths": [asdict(check) for check in self.checks]}
