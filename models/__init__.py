"""Model side of genscore: loading (bundled default, HF dir, GGUF, hub id), the batched forward pass, tiny test models."""

from models.forward import forward_hidden, forward_logits
from models.loading import LoadedModel, ModelNotFoundError, load_model, resolve_device, resolve_dtype
from models.plan import ForwardPlan, PathCheck
from models.tiny import TINY_ARCHITECTURES, make_tiny_model

__all__ = [
    "ForwardPlan",
    "PathCheck",
    "LoadedModel",
    "ModelNotFoundError",
    "TINY_ARCHITECTURES",
    "forward_hidden",
    "forward_logits",
    "load_model",
    "make_tiny_model",
    "resolve_device",
    "resolve_dtype",
]
