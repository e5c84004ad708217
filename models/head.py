"""The model's own output head: final hidden states -> logits through the CausalLM forward's own code (lm_head and
whatever the architecture does after it: soft-capping, logit scaling, ...), never a re-implementation of it."""

from __future__ import annotations

import copy
import weakref

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPastAndCrossAttentions

from models.float32_head import Float32Head, float32_logits
from models.invariant import is_batch_invariant, tiled_head


class _BodyOutput(BaseModelOutputWithPastAndCrossAttentions):
    """The body's output as the head reads it: the hidden states, and None for anything else a head asks for
    (router logits of a mixture of experts, caches, attentions)."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return None


class _GivenHidden(nn.Module):
    """Stands in for the decoder body: returns the hidden states it is handed as `inputs_embeds`."""

    def forward(self, *_: object, inputs_embeds: torch.Tensor, **__: object) -> _BodyOutput:
        return _BodyOutput(last_hidden_state=inputs_embeds)


# model -> {batch-invariant?: a shallow copy of it whose body is _GivenHidden}; built once per model and mode,
# shares every other module
_HEADS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# model -> the module its (not batch-invariant) view runs in place of lm_head: a pre-packed copy (models/prepack.py)
_HEAD_LINEARS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def set_head_linear(model: PreTrainedModel, linear: nn.Module | None) -> None:
    """Make head_logits run `linear` in place of the model's lm_head (None: lm_head itself again).

    Only the view changes: the model's own lm_head, often tied to its input embeddings, stays in place.
    """
    if linear is None:
        _HEAD_LINEARS.pop(model, None)
    else:
        _HEAD_LINEARS[model] = linear
    _HEADS.pop(model, None)  # views are rebuilt around it


def forget_head_views(model: PreTrainedModel) -> None:
    """Drop the head views of `model`: the next head_logits builds them again around the current choices."""
    _HEADS.pop(model, None)


def head_linear(model: PreTrainedModel) -> nn.Module | None:
    """The module set_head_linear put in place of the model's lm_head, if any (its weights are held on top)."""
    return _HEAD_LINEARS.get(model)


def _head_view(model: PreTrainedModel) -> PreTrainedModel:
    """A view of `model` that runs only what its forward does after the body, on hidden states it is given.

    A copy, not a swap on the model itself: the model's body stays in place for every other caller, and the
    view shares lm_head, config and any scale parameters with it (no weights are copied). For a batch-invariant
    model the view's lm_head runs in fixed row tiles (models/invariant.py); otherwise the view runs the module
    set_head_linear gave it, if any, else (half precision) lm_head with a float32 product (models/float32_head.py).
    The model's own lm_head stays as it is.
    """
    invariant = is_batch_invariant(model)
    views = _HEADS.setdefault(model, {})
    head = views.get(invariant)
    if head is None:
        lm_head = model.get_output_embeddings()
        head = copy.copy(model)
        head._modules = dict(model._modules)  # a new dict: replacing the body must not touch the model's own
        for name, child in model.named_children():
            if child is model.base_model:
                head._modules[name] = _GivenHidden()
            elif child is lm_head and invariant:
                head._modules[name] = tiled_head(child)
            elif child is lm_head and model in _HEAD_LINEARS:
                head._modules[name] = _HEAD_LINEARS[model]
            elif child is lm_head and float32_logits(model, child):
                head._modules[name] = Float32Head(child)
        views[invariant] = head
    return head


@torch.inference_mode()
def head_logits(model: PreTrainedModel, hidden: torch.Tensor) -> torch.Tensor:
    """hidden [N, H] -> float32 logits [N, V], exactly the numbers the model's forward gives for those positions."""
    logits = _head_view(model)(inputs_embeds=hidden[None], use_cache=False).logits  # [1, N, V]
    return logits[0].float()
