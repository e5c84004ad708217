"""Where a causal LM's forward gets its final hidden states: the body module it calls, found by watching it run."""

from __future__ import annotations

import inspect
from functools import lru_cache

import torch
from torch import nn
from transformers import PreTrainedModel


def _has_hidden(output: object) -> bool:
    return getattr(output, "last_hidden_state", None) is not None


@torch.inference_mode()
def find_body(model: PreTrainedModel) -> nn.Module:
    """The outermost submodule the model's forward calls that returns `last_hidden_state`.

    Not `base_model`, which for some models is the CausalLM itself (Llama 4) or a wrapper whose forward the CausalLM
    never calls (OPT calls `model.decoder`): a two-token forward shows which module the CausalLM really reads.
    """
    seen: list[str] = []
    names = {module: name for name, module in model.named_modules() if name}
    hooks = [module.register_forward_hook(lambda m, _a, out: seen.append(names[m]) if _has_hidden(out) else None)
             for module in names]
    try:
        model(input_ids=torch.zeros((1, 2), dtype=torch.long, device=model.device), use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    if not seen:
        raise RuntimeError(f"{type(model).__name__}'s forward calls no module that returns last_hidden_state")
    return model.get_submodule(min(seen, key=lambda name: name.count(".")))


@lru_cache(maxsize=32)
def _parameters(forward_type: type) -> frozenset[str]:
    return frozenset(inspect.signature(forward_type.forward).parameters)


def cache_kwarg(body: nn.Module) -> str:
    """transformers 5.x renamed `past_key_values` to `cache`; the name this body's forward takes."""
    return "cache" if "cache" in _parameters(type(body)) else "past_key_values"


def run_body(body: nn.Module, input_ids: torch.Tensor, cache=None, **kwargs) -> torch.Tensor:
    """The body's final hidden states [B, T, H]; with `cache`, it reads and extends that cache."""
    if cache is not None:
        kwargs[cache_kwarg(body)] = cache
    return body(input_ids=input_ids, **kwargs).last_hidden_state


def returned_cache(output: object):
    """The cache object a body's output carries, whatever this version names it; None when it keeps none."""
    for name in ("cache", "past_key_values", "cache_params"):
        cache = getattr(output, name, None)
        if cache is not None:
            return cache
    return None
