"""Packed sequences: many prompts in one row with no padding, attention kept inside each prompt."""

from __future__ import annotations

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

# The attention implementation genscore installs: SDPA, plus a per-prompt path when a call is packed.
PACKED_ATTENTION = "genscore_packed_sdpa"


def packed_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, H, T, D] when packed
    key: torch.Tensor,  # [1, H_kv, T, D]
    value: torch.Tensor,  # [1, H_kv, T, D]
    attention_mask: torch.Tensor | None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """SDPA; when the call carries `cu_seq_lens_q` (prompt boundaries in the packed row), causal SDPA per prompt.

    Per prompt, not one block-diagonal mask over the whole row: a mask would cost (sum of lengths)^2
    attention work, per prompt it is the sum of squares, the same as unpacked prompts.
    """
    boundaries = kwargs.pop("cu_seq_lens_q", None)
    if boundaries is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    bounds = boundaries.tolist()
    parts = [
        sdpa_attention_forward(
            module, query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], None, is_causal=True, **kwargs
        )[0]  # [1, b - a, H, D]
        for a, b in zip(bounds[:-1], bounds[1:])
    ]
    return torch.cat(parts, dim=1), None  # [1, T, H, D]


AttentionInterface.register(PACKED_ATTENTION, packed_sdpa_attention)
# Unpacked calls (padded batches, key/value caches) build the same masks SDPA would.
ALL_MASK_ATTENTION_FUNCTIONS.register(PACKED_ATTENTION, sdpa_mask)


def use_packed_attention(model: PreTrainedModel) -> bool:
    """Switch an SDPA model to the packing-aware implementation (same numbers unpacked); False if it is not SDPA."""
    if model.config._attn_implementation != "sdpa":
        return False
    model.set_attn_implementation(PACKED_ATTENTION)
    return True


def supports_packing(model: PreTrainedModel) -> bool:
    """Whether forward passes of `model` may be packed (use_packed_attention switched it)."""
    return model.config._attn_implementation == PACKED_ATTENTION


def pack(sequences: list[list[int]], device: torch.device):
    """One row holding every sequence back to back: ids, position ids [1, T] and prompt boundaries [n + 1]."""
    lengths = torch.tensor([len(seq) for seq in sequences], dtype=torch.long)
    boundaries = torch.zeros(len(sequences) + 1, dtype=torch.long)
    torch.cumsum(lengths, 0, out=boundaries[1:])
    input_ids = torch.tensor([token for seq in sequences for token in seq], dtype=torch.long)[None]
    # Positions restart at 0 for each prompt, so each sees exactly the positions it would see alone.
    starts = torch.repeat_interleave(boundaries[:-1], lengths)
    position_ids = (torch.arange(input_ids.shape[1]) - starts)[None]
    return input_ids.to(device), position_ids.to(device), boundaries
