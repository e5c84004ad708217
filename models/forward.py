"""The batched forward pass: left-pad sequences of different lengths, run the model, project only the needed positions through lm_head."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedModel


def pad_left(sequences: Sequence[Sequence[int]], pad_token_id: int, device: torch.device):
    """Left-pad so every sequence ends in the last column; returns ids, mask and position ids, each [B, T]."""
    longest = max(len(seq) for seq in sequences)
    input_ids = torch.full((len(sequences), longest), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), longest), dtype=torch.long)
    for row, seq in enumerate(sequences):
        input_ids[row, longest - len(seq) :] = torch.tensor(seq, dtype=torch.long)
        attention_mask[row, longest - len(seq) :] = 1
    # Positions count real tokens only, so a padded sequence sees the same positions as it would alone.
    position_ids = (attention_mask.cumsum(-1) - 1).clamp_(min=0)
    return input_ids.to(device), attention_mask.to(device), position_ids.to(device)


def _lm_head_logits(model: PreTrainedModel, hidden: torch.Tensor) -> torch.Tensor:
    """hidden [N, H] -> float32 logits [N, V], applying the final soft-capping some architectures use."""
    logits = model.get_output_embeddings()(hidden).float()
    softcap = getattr(model.config, "final_logit_softcapping", None)
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return logits


@torch.inference_mode()
def forward_logits(
    model: PreTrainedModel,
    sequences: Sequence[Sequence[int]],
    pad_token_id: int,
    keep_last: Sequence[int] | None = None,
) -> torch.Tensor:
    """Logits for the last `keep_last[i]` positions of each sequence (default 1), stacked row after row.

    Returns float32 [N, V] with N = sum(keep_last); row order is sequence 0's kept
    positions oldest first, then sequence 1's, and so on. lm_head runs on those N
    hidden states only: at V = 49k it would otherwise dominate the cost.
    """
    device = model.device
    input_ids, attention_mask, position_ids = pad_left(sequences, pad_token_id, device)
    hidden = model.base_model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
    ).last_hidden_state  # [B, T, H]
    width = hidden.shape[1]
    if keep_last is None:
        picked = hidden[:, -1, :]  # [B, H]
    else:
        rows = torch.repeat_interleave(torch.arange(len(sequences)), torch.tensor(list(keep_last)))
        cols = torch.cat([torch.arange(width - k, width) for k in keep_last])
        picked = hidden[rows.to(device), cols.to(device)]  # [N, H]
    return _lm_head_logits(model, picked)
