"""float32 logits from a half-precision model's output head: the head's product summed and kept in float32 instead
of rounded to the model's dtype first (bfloat16 logits above 16 fall on a grid of 1/8 and tie)."""

from __future__ import annotations

from functools import lru_cache

import torch
from torch import nn
from transformers import PreTrainedModel

_HALF = (torch.bfloat16, torch.float16)


def float32_applies(model: PreTrainedModel, lm_head: nn.Module) -> bool:
    """Whether Float32Head can run `model`'s lm_head: a plain linear head of a half-precision model."""
    return model.dtype in _HALF and type(lm_head) is nn.Linear


@lru_cache(maxsize=4)
def _mm_to_float32(device_type: str) -> bool:
    """Whether this torch multiplies half-precision matrices straight into a float32 result on `device_type`."""
    try:
        a = torch.ones(2, 2, dtype=torch.bfloat16, device=device_type)
        return torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except (RuntimeError, TypeError, NotImplementedError):
        return False


class Float32Head(nn.Module):
    """lm_head's own weights, its product returned in float32: [..., H] -> [..., V] float32."""

    def __init__(self, inner: nn.Linear):
        super().__init__()
        self.inner = inner

    # A model's forward may read lm_head.weight or .bias itself (Mamba casts the hidden states to its dtype).
    @property
    def weight(self) -> torch.Tensor:
        return self.inner.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.inner.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # [N, H]
        weight = self.inner.weight  # [V, H]
        if _mm_to_float32(flat.device.type):
            # the GPU GEMM accumulates in float32 anyway: only the final rounding to the model dtype is skipped
            out = torch.mm(flat, weight.t(), out_dtype=torch.float32)  # [N, V]
        else:  # a float32 copy of the weight per call (CPU: no half-precision GEMM with a float32 output)
            out = flat.float() @ weight.float().t()
        if self.inner.bias is not None:
            out = out + self.inner.bias.float()
        return out.reshape(*x.shape[:-1], out.shape[-1])
