"""The model's own output head: final hidden states -> logits through the CausalLM forward's own code (lm_head and
whatever the architecture does after it: soft-capping, logit scaling, multipliers, ...), never a re-implementation."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPastAndCrossAttentions

from models.float32_head import Float32Head, float32_applies

if TYPE_CHECKING:
    from models.plan import ForwardPlan


class _BodyOutput(BaseModelOutputWithPastAndCrossAttentions):
    """The body's output as the head reads it: the hidden states, and None for anything else a head asks for
    (router logits of a mixture of experts, caches, attentions)."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return None


def given_hidden(*_: object, inputs_embeds: torch.Tensor, **__: object) -> _BodyOutput:
    """The stand-in body's forward: the hidden states it is handed as `inputs_embeds`, as the body's output."""
    return _BodyOutput(last_hidden_state=inputs_embeds)


def _stand_in(body: nn.Module) -> nn.Module:
    """A shallow copy of the body whose forward returns what it is handed: every attribute the CausalLM's forward
    reads from its body (a logit multiplier, a config) is still there, and no weight is copied."""
    stand_in = copy.copy(body)
    for name, value in vars(body).items():
        if name.endswith("_hooks") or "_hooks_" in name:
            # its own empty hook tables: a hook on the body must not fire when the head runs
            object.__setattr__(stand_in, name, type(value)())
    stand_in.forward = given_hidden
    return stand_in


def build_head(model: PreTrainedModel, body: nn.Module, lm_head: nn.Module | None = None,
               float32_logits: bool = True) -> PreTrainedModel:
    """A view of `model` that runs only what its forward does after `body`, on hidden states it is given.

    A copy, not a swap on the model itself: the body stays in place for every other caller, and the view shares
    lm_head, config and any scale parameters with the model. Each module on the path to the body is copied with a
    fresh child dict, so replacing the body touches none of the model's own. `lm_head`: a module to run in place
    of the model's lm_head in the view (a pre-packed or row-tiled copy); the model's own stays as it is. Without
    one, a half-precision plain linear lm_head runs through Float32Head (models/float32_head.py) unless
    `float32_logits` is False: its product kept in float32 instead of rounded to the model's dtype first.
    """
    own_head = model.get_output_embeddings()
    path = next(name for name, module in model.named_modules() if module is body).split(".")
    view = copy.copy(model)
    view._modules = dict(model._modules)
    parent = view
    for name in path[:-1]:
        child = copy.copy(parent._modules[name])
        child._modules = dict(child._modules)
        parent._modules[name] = child
        parent = child
    parent._modules[path[-1]] = _stand_in(body)
    if lm_head is None and float32_logits and float32_applies(model, own_head):
        lm_head = Float32Head(own_head)
    if lm_head is not None:
        for name, child in model.named_children():
            if child is own_head:
                view._modules[name] = lm_head
    return view


@torch.inference_mode()
def head_logits(plan: ForwardPlan, hidden: torch.Tensor) -> torch.Tensor:
    """hidden [N, H] -> float32 logits [N, V], exactly the numbers the model's forward gives for those positions."""
    logits = plan.head(inputs_embeds=hidden[None], use_cache=False).logits  # [1, N, V]
    return logits[0].float()
