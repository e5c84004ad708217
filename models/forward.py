"""The batched forward pass, laid out as the plan says: sequences packed into one row, padded micro-batches, or each alone; lm_head on the needed positions only."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from models.head import head_logits
from models.packed import PACKED_ROW, no_padding, pack, packed_ends, packed_row, to_device
from models.plan import ForwardPlan

# What one extra model call costs, in padded tokens' worth of compute: python and kernel launch
# overhead across every layer, plus the lower GEMM efficiency of a smaller call. Tuned on CPU
# (SmolLM2-135M, float32 and bfloat16); the grouping is not sensitive to it within a factor of two.
CALL_OVERHEAD_TOKENS = 96
# Tokens per packed model call at 4 bytes an element; a half-precision model packs twice as many (pack_tokens).
# Larger calls keep the GEMMs efficient and pay the per-call cost (Python and a read of every weight, tens of ms
# on CPU) less often; past about this many bytes of activations ([tokens, intermediate] per MLP) they stop fitting
# in cache and element-wise ops slow down. Tuned on CPU (SmolLM2-135M; the measurements are in
# docs/contributors/architecture.md, "Packed sequences").
PACK_TOKENS = 1024

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
    if device.type == "cuda":
        # Pinned host memory lets the three copies overlap with work already queued on the GPU.
        return tuple(t.pin_memory().to(device, non_blocking=True) for t in (input_ids, attention_mask, position_ids))
    return input_ids.to(device), attention_mask.to(device), position_ids.to(device)


def plan_micro_batches(lengths: Sequence[int], call_overhead_tokens: int = CALL_OVERHEAD_TOKENS) -> list[list[int]]:
    """Split sequence indices into groups that minimise padded tokens + a per-call overhead.

    Sorted by length, the best split is contiguous, so an O(n^2) dynamic programme over the
    sorted order finds it exactly: cost(group) = size x its longest length + call overhead.
    Returns groups of original indices, shortest sequences first.
    """
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    n = len(order)
    best = [0.0] + [float("inf")] * n  # best[j]: cheapest cost of the first j sorted sequences
    cut = [0] * (n + 1)  # cut[j]: where the last group of that best split starts
    for end in range(1, n + 1):
        longest = lengths[order[end - 1]]
        for start in range(end):
            cost = best[start] + (end - start) * longest + call_overhead_tokens
            if cost < best[end]:
                best[end], cut[end] = cost, start
    groups = []
    end = n
    while end > 0:
        groups.append(order[cut[end] : end])
        end = cut[end]
    return groups[::-1]


def pack_tokens(model: PreTrainedModel) -> int:
    """Tokens per packed call of `model`: PACK_TOKENS at 4 bytes an element, 2x at 2 bytes (the same activation bytes)."""
    return PACK_TOKENS * 4 // max(1, min(4, model.dtype.itemsize))


def plan_packs(lengths: Sequence[int], pack_tokens: int = PACK_TOKENS) -> list[list[int]]:
    """Split sequence indices, in order, into packs of at most pack_tokens tokens (a longer sequence packs alone)."""
    packs: list[list[int]] = []
    size = 0
    for i, length in enumerate(lengths):
        if packs and size + length <= pack_tokens:
            packs[-1].append(i)
            size += length
        else:
            packs.append([i])
            size = length
    return packs


def _alone_hidden(plan: ForwardPlan, sequence: Sequence[int], keep: int, device: torch.device) -> torch.Tensor:
    """One sequence through the model's own body exactly as its plain forward runs it (no mask, no positions, no
    cache): the final hidden states of its last `keep` positions, [keep, H]."""
    input_ids = torch.tensor([list(sequence)], dtype=torch.long, device=device)
    hidden = plan.body(input_ids=input_ids, use_cache=False).last_hidden_state[0]  # [L, H]
    if keep <= hidden.shape[0]:
        return hidden[-keep:]
    # keep rows even when a caller asks past the sequence's start, as the packed and padded layouts do
    return hidden[torch.arange(hidden.shape[0] - keep, hidden.shape[0], device=device).clamp_(min=0)]


def _picked_hidden(
    model: PreTrainedModel, plan: ForwardPlan, sequences: Sequence[Sequence[int]], pad_token_id: int,
    keep_last: Sequence[int],
) -> torch.Tensor:
    """One padded model call: the final hidden states of each sequence's last keep_last[i] positions, [N, H]."""
    device = model.device
    if len(sequences) == 1:
        return _alone_hidden(plan, sequences[0], keep_last[0], device)
    input_ids, attention_mask, position_ids = pad_left(sequences, pad_token_id, device)
    if len({len(seq) for seq in sequences}) == 1:
        # No padding: without a mask SDPA takes its causal fast path; the numbers are the same.
        attention_mask = None
    hidden = plan.body(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
    ).last_hidden_state  # [B, T, H]
    width = hidden.shape[1]
    if all(k == 1 for k in keep_last):
        return hidden[:, -1, :]  # [B, H]
    rows = torch.repeat_interleave(torch.arange(len(sequences)), torch.tensor(list(keep_last)))
    cols = torch.cat([torch.arange(width - k, width) for k in keep_last])
    return hidden[to_device(rows, device), to_device(cols, device)]  # [N, H]


def _packed_hidden(
    model: PreTrainedModel, plan: ForwardPlan, sequences: Sequence[Sequence[int]], keep_last: Sequence[int]
) -> torch.Tensor:
    """One packed model call: the final hidden states of each sequence's last keep_last[i] positions, [N, H]."""
    lengths = [len(seq) for seq in sequences]
    hidden = None if plan.graphs is None else plan.graphs.hidden(sequences)  # [T, H], or None: no bucket holds them
    if hidden is None:
        input_ids, position_ids, boundaries = pack(sequences, model.device)
        # All ones = no padding: for full-attention layers transformers then builds no mask at all (causal per
        # prompt); for layers with a window shorter than the row it builds the row's banded mask, whose diagonal
        # blocks are each prompt's own mask (packed attention reads them).
        with no_padding():
            hidden = plan.body(
                input_ids=input_ids, attention_mask=torch.ones_like(input_ids), position_ids=position_ids,
                use_cache=False, cu_seq_lens_q=boundaries,
                **{PACKED_ROW: packed_row(model.device, plan.attention_kernel, lengths)},
            ).last_hidden_state[0]  # [T, H]
    ends = [int(end) for end in packed_ends(lengths)]  # on the host: nothing read back from the device
    picked = torch.tensor([i for end, k in zip(ends, keep_last) for i in range(end - k, end)])
    return hidden[to_device(picked, hidden.device)]  # [N, H]


@torch.inference_mode()
def forward_logits(
    model: PreTrainedModel,
    plan: ForwardPlan,
    sequences: Sequence[Sequence[int]],
    pad_token_id: int,
    keep_last: Sequence[int] | None = None,
) -> torch.Tensor:
    """float32 logits [N, V] of the positions forward_hidden keeps, in its order. lm_head runs once, on the N kept
    hidden states only: at V = 49k it would otherwise dominate the cost."""
    return head_logits(plan, forward_hidden(model, plan, sequences, pad_token_id, keep_last))


@torch.inference_mode()
def forward_hidden(
    model: PreTrainedModel,
    plan: ForwardPlan,
    sequences: Sequence[Sequence[int]],
    pad_token_id: int,
    keep_last: Sequence[int] | None = None,
) -> torch.Tensor:
    """Final hidden states of the last `keep_last[i]` positions of each sequence (default 1), stacked row after row.

    Returns [N, H] with N = sum(keep_last); row order is sequence 0's kept
    positions oldest first, then sequence 1's, and so on. Sequences are packed back to back
    into rows of about pack_tokens(model) tokens, attention kept inside each sequence (models/packed.py),
    so no compute goes to padding; a model that cannot pack runs padded micro-batches of
    similar length instead (see plan_micro_batches), and one whose padded batches are not proven runs each
    sequence alone through its own forward (plan.layout says which). Each row's numbers do not depend on its
    neighbours beyond float rounding; on a batch-invariant plan (models/invariant.py) not at all: a packed
    prompt sees the same kernels as alone, and a model that cannot pack runs each sequence alone, since a
    padded layout changes the order attention sums in.
    """
    keep = [1] * len(sequences) if keep_last is None else list(keep_last)
    if plan.layout == "packed":
        packs = plan_packs([len(seq) for seq in sequences], pack_tokens(model))
        # Packs keep the caller's order, so their kept rows concatenate straight into the result's order.
        return torch.cat([
            _packed_hidden(model, plan, [sequences[i] for i in group], [keep[i] for i in group]) for group in packs
        ])  # [N, H]
    if plan.layout == "one_at_a_time" or plan.batch_invariant:
        groups = [[i] for i in range(len(sequences))]
    else:
        groups = plan_micro_batches([len(seq) for seq in sequences])
    if len(groups) == 1:
        return _picked_hidden(model, plan, sequences, pad_token_id, keep)
    parts = [
        _picked_hidden(model, plan, [sequences[i] for i in group], pad_token_id, [keep[i] for i in group])
        for group in groups
    ]  # each [sum(keep over group), H], groups in planned order
    picked = torch.cat(parts)  # [N, H], planned order
    # Row r of `picked` belongs to sequence planned[r]'s block; put the blocks back in caller order.
    planned = [i for group in groups for i in group]
    starts = [0] * len(sequences)
    offset = 0
    for i in planned:
        starts[i] = offset
        offset += keep[i]
    restore = torch.cat([torch.arange(starts[i], starts[i] + keep[i]) for i in range(len(sequences))])
    return picked[to_device(restore, picked.device)]
