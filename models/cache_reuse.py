"""Shared-prefix reuse for any cache: the model's whole cache at the prefix boundary (attention keys and values,
convolution and recurrent states alike), copied for each suffix, which then runs alone through the model's own body."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from models.body import returned_cache, run_body
from models.plan import ForwardPlan

# Cache layers that hold only keys and values of past positions: everything else carries state across positions.
_ATTENTION_LAYERS = (DynamicLayer, DynamicSlidingWindowLayer)


def stateful_layers(model: PreTrainedModel) -> tuple[str, ...]:
    """The kinds of cache layer of `model` that carry state across positions (recurrent, convolution, linear
    attention), as transformers' generate would build its cache; ("unknown cache",) when that cache cannot be built
    or the model brings a cache class of its own."""
    if not model._supports_default_dynamic_cache():
        return (f"a cache class of its own ({type(model).__name__})",)
    try:
        cache = DynamicCache(config=model.config.get_text_config(decoder=True))
    except Exception as exc:  # noqa: BLE001 - a cache we cannot build is one we cannot reason about
        return (f"unknown cache ({type(exc).__name__})",)
    return tuple(sorted({type(layer).__name__ for layer in cache.layers if type(layer) not in _ATTENTION_LAYERS}))


def _tensor_bytes(obj: object, depth: int = 0) -> int:
    """Bytes of every tensor reachable from a cache object (its layers, their states), a few levels deep."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if depth > 3:
        return 0
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v, depth + 1) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(_tensor_bytes(v, depth + 1) for v in obj)
    if hasattr(obj, "__dict__") and not isinstance(obj, torch.nn.Module):
        return sum(_tensor_bytes(v, depth + 1) for v in vars(obj).values())
    return 0


@dataclass(frozen=True)
class CachedPrefix:
    """What a prefix leaves behind: the model's own cache after it (never changed: each suffix runs on a copy) and
    the hidden state of its last token."""

    tokens: tuple[int, ...]
    cache: object
    last_hidden: torch.Tensor  # [hidden]
    nbytes: int

    @property
    def length(self) -> int:
        return len(self.tokens)


@torch.inference_mode()
def prefill_whole(plan: ForwardPlan, prefix: Sequence[int], device: torch.device) -> CachedPrefix:
    """Run one prefix alone through the body, keeping the cache the model makes for itself."""
    output = plan.body(input_ids=torch.tensor([list(prefix)], dtype=torch.long, device=device), use_cache=True)
    cache = returned_cache(output)
    if cache is None:
        raise RuntimeError("the model returns no cache object: its state stays inside its modules")
    return CachedPrefix(tuple(prefix), cache, output.last_hidden_state[0, -1].clone(), _tensor_bytes(cache))


@torch.inference_mode()
def suffix_hidden(plan: ForwardPlan, prefix: CachedPrefix, suffix: Sequence[int], device: torch.device
                  ) -> torch.Tensor | None:
    """One suffix through the body over a copy of its prefix's whole cache: hidden states [len(suffix), H]."""
    if not suffix:
        return None
    cache = copy.deepcopy(prefix.cache)  # the suffix extends (and recurrent layers overwrite) its own copy
    input_ids = torch.tensor([list(suffix)], dtype=torch.long, device=device)
    return run_body(plan.body, input_ids, cache=cache, use_cache=True)[0]
