"""The logits processors (logit_bias, temperature, min_p, top_k, top_p) and process(), which runs them in order."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .batch import check_batch, column, row_index
from .params import SamplingParams

# Each processor touches only the rows whose SamplingParams ask for it, vectorised over
# those rows. Filtered tokens become -inf. Every filter keeps an upward-closed set (if a
# token is kept, every token with a value >= its value is kept), so ties never split
# across the kept/filtered boundary, and the max token always survives.

_NEG_INF = float("-inf")
# top_p first looks at this many best tokens per row before widening (x8) towards a full sort
_TOP_P_FIRST_WIDTH = 1024


def process(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Processed logits: a new [B, V] float32 tensor; logits itself is never written."""
    check_batch(logits, params)
    x = logits.to(torch.float32, copy=True)  # [B, V] private copy: the processors write in place
    apply_processors_(x, params)
    return x


def apply_processors_(x: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    """Run every processor, in the documented order, in place on x ([B, V] float32)."""
    _logit_bias_(x, params)
    _temperature_(x, params)
    _min_p_(x, params)
    _top_k_(x, params)
    _top_p_(x, params)


def _on_rows(x: torch.Tensor, idx: torch.Tensor | None, fn: Callable[[torch.Tensor], None]) -> None:
    """Apply an in-place fn to rows idx of x (all rows when idx is None)."""
    if idx is None:
        fn(x)  # [B, V]
        return
    sub = x[idx]  # [n, V] copy of just the rows that asked
    fn(sub)
    x[idx] = sub


def _logit_bias_(x: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    for i, p in enumerate(params):
        for tok, bias in p.logit_bias:
            rows.append(i)
            cols.append(tok)
            vals.append(bias)
    if not rows:
        return
    dev = x.device
    # one scatter-add for the whole batch; (row, token) pairs are unique (params rejects duplicates)
    x.index_put_(
        (torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)),
        torch.tensor(vals, dtype=torch.float32, device=dev),  # [N]
        accumulate=True,
    )


def _temperature_(x: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    rows, idx = row_index(params, lambda p: p.temperature_on, x.device)
    if not rows:
        return
    temps = column([params[i].temperature for i in rows], x)  # [n, 1]
    _on_rows(x, idx, lambda sub: sub.div_(temps))


def _min_p_(x: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    rows, idx = row_index(params, lambda p: p.min_p_on, x.device)
    if not rows:
        return
    min_p = column([params[i].min_p for i in rows], x)  # [n, 1]

    def fn(sub: torch.Tensor) -> None:  # [n, V]
        # probabilities after bias + temperature, as the definition says; the max
        # token has probs == max >= min_p * max, so it always survives
        probs = torch.softmax(sub, dim=-1)  # [n, V]
        sub.masked_fill_(probs < probs.amax(dim=-1, keepdim=True) * min_p, _NEG_INF)

    _on_rows(x, idx, fn)


def _top_k_(x: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    vocab = x.shape[-1]
    # k >= V keeps everything, so those rows are skipped rather than run through topk
    rows, idx = row_index(params, lambda p: p.top_k_on and p.top_k < vocab, x.device)
    if not rows:
        return
    ks = [params[i].top_k for i in rows]
    k_col = torch.tensor(ks, dtype=torch.long, device=x.device).unsqueeze(1)  # [n, 1]

    def fn(sub: torch.Tensor) -> None:  # [n, V]
        # one topk at the largest k of the subset, then each row reads its own k-th value;
        # keeping ">= k-th value" keeps every token tied with it (HF semantics)
        kth = torch.topk(sub, max(ks), dim=-1).values.gather(1, k_col - 1)  # [n, 1]
        sub.masked_fill_(sub < kth, _NEG_INF)

    _on_rows(x, idx, fn)


def _top_p_(x: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    vocab = x.shape[-1]
    rows, idx = row_index(params, lambda p: p.top_p_on, x.device)
    if not rows:
        return
    top_p = torch.tensor([params[i].top_p for i in rows], dtype=torch.float64, device=x.device).unsqueeze(1)

    def fn(sub: torch.Tensor) -> None:  # [n, V]
        # probabilities after the earlier processors; softmax is monotone in the value, so a
        # set closed upwards in probability is closed upwards in value too
        probs = torch.softmax(sub, dim=-1)  # [n, V]
        # Keep the shortest prefix of the descending order whose mass reaches top_p: every
        # position whose cumulative mass before it is still < top_p. That count depends only
        # on the prefix up to the crossing (cumsum is a running sum), so a topk prefix gives
        # the same answer as a full sort whenever every row crosses inside it. Start narrow,
        # widen x8, and sort the whole vocabulary only as a last resort.
        width = min(vocab, _TOP_P_FIRST_WIDTH)
        while True:
            if width < vocab:
                desc = torch.topk(probs, width, dim=-1).values  # [n, width], sorted desc
            else:
                desc = torch.sort(probs, dim=-1, descending=True).values  # [n, V]
            cum = desc.cumsum(dim=-1, dtype=torch.float64)  # [n, width]
            below = (cum < top_p).sum(dim=-1, keepdim=True)  # [n, 1]
            if width == vocab or bool((below < width).all()):
                break
            width = min(vocab, width * 8)
        n_keep = (below + 1).clamp_(max=vocab)  # [n, 1], >= 1: the max token always stays
        # filter by value, not by sorted position, so ties with the last kept token stay
        threshold = desc.gather(1, n_keep - 1)  # [n, 1]
        sub.masked_fill_(probs < threshold, _NEG_INF)

    _on_rows(x, idx, fn)
