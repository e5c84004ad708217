"""Scoring on the device: a batch of ScoreWork -> packed forward passes (shared prefixes once, or from the cache) ->
the sampler -> one ScoreOutcome per unit. Runs on the engine's device thread only."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

import sampler
from app.engine.budget import LOGIT_ROWS_PER_CHUNK
from app.engine.results import ScoreOutcome
from app.engine.work import ScoreWork
from models import LoadedModel, forward_hidden
from models.head import head_logits
from models.prefix import PrefixState, SuffixRow, forward_suffixes, prefill_with_suffixes
from models.prefix_cache import PrefixCache
from sampler import SamplingParams


class _Row(NamedTuple):
    """One sequence of a batch: which work it serves, its tokens, where its shared prefix ends, positions kept."""

    work: int
    tokens: list[int]
    split: int  # tokens[:split] is the shared prefix (0: none)
    keep: int  # logits of the last `keep` positions are needed
    candidate: tuple[int, ...]  # for a candidate row, the tokens those positions predict; () for a label row


def common_prefix_len(prompts: Sequence[Sequence[int]]) -> int:
    """Length of the longest token prefix every prompt starts with."""
    first = prompts[0]
    n = min(len(p) for p in prompts)
    for other in prompts[1:]:
        i = 0
        while i < n and other[i] == first[i]:
            i += 1
        n = i
    return n



class Scorer:
    """Runs scoring batches over one loaded model, with the prefix cache of the key/value states it shares."""

    def __init__(self, loaded: LoadedModel, share_prefixes: bool, prefix_cache_bytes: int):
        self.loaded = loaded
        self.share_prefixes = share_prefixes and loaded.shares_prefixes
        self.prefix_cache = PrefixCache(prefix_cache_bytes if self.share_prefixes else 0)

    def warm_up(self) -> None:
        """Real batches through the same paths requests take, so the first caller does not pay for lazy init."""
        ids = self.loaded.tokenizer("warm up", add_special_tokens=True)["input_ids"] or [self.loaded.pad_token_id]
        self.run_batch([ScoreWork(ids, SamplingParams(label_token_ids=(0,), top_logprobs=1))] * 2)
        if self.share_prefixes:
            self.run_batch([ScoreWork(ids + [0], SamplingParams(), len(ids), ((0, 0),))] * 2)
            self.prefix_cache = PrefixCache(self.prefix_cache.stats.capacity_bytes)  # start serving empty, counters at 0

    # --- the batch handler (runs on the worker thread) -------------------------------
    def run_batch(self, works: list[ScoreWork]) -> list[ScoreOutcome]:
        """Every unit's sequences in as few passes as memory allows; shared prefixes run once (or come from the cache)."""
        reused = [0] * len(works)
        states, missing = self._prefix_states(works, reused)
        rows: list[_Row] = []
        for i, work in enumerate(works):
            split = work.shared_prefix_len if self.share_prefixes else 0
            if work.candidates:
                # the candidate's last token is only predicted, never fed
                rows += [_Row(i, work.token_ids + list(c[:-1]), split, len(c), c) for c in work.candidates]
            else:
                rows.append(_Row(i, work.token_ids, split, 1, ()))

        prefilled = self._prefill(missing, rows, states)
        label_logits: dict[int, torch.Tensor] = {}  # work -> [V]
        candidate_values: dict[int, list[list[float]]] = {i: [] for i, w in enumerate(works) if w.candidates}
        for chunk in self._chunks(list(enumerate(rows))):
            # one output-head call per chunk, on every row's kept hidden states
            logits = head_logits(self.loaded.plan, self._kept_hidden(chunk, states, prefilled))  # [sum of keep, V]
            chunk = [row for _, row in chunk]
            positions, params, targets = [], [], []  # the candidate positions of this chunk
            offset = 0
            for row in chunk:
                work = works[row.work]
                if row.candidate:
                    # position j of a candidate row predicts the candidate's token j
                    positions.extend(range(offset, offset + row.keep))
                    params.extend([work.params] * row.keep)
                    targets.extend(row.candidate)
                else:
                    label_logits[row.work] = logits[offset]
                offset += row.keep
            if positions:
                snap = sampler.snapshot(logits[positions], params)  # [n, V], each row under its own mode
                index = torch.tensor(targets, dtype=torch.long, device=snap.device)[:, None]
                values = snap.gather(1, index)[:, 0].tolist()  # [n]
                at = 0
                for row in chunk:
                    if row.candidate:
                        candidate_values[row.work].append(values[at : at + row.keep])
                        at += row.keep

        labels: dict[int, sampler.RowScores] = {}
        if label_logits:
            order = sorted(label_logits)
            params = [works[i].params for i in order]
            scored = sampler.to_rows(sampler.score(torch.stack([label_logits[i] for i in order]), params), params)
            labels = dict(zip(order, scored))
        return [ScoreOutcome(labels.get(i), candidate_values.get(i), reused[i]) for i in range(len(works))]

    def _prefix_states(self, works: list[ScoreWork], reused: list[int]
                       ) -> tuple[dict[tuple[int, ...], PrefixState], list[tuple[int, ...]]]:
        """The batch's shared prefixes: the states of those in the cache, and those missing (each counted once)."""
        if not self.share_prefixes:
            return {}, []
        states: dict[tuple[int, ...], PrefixState] = {}
        missing: list[tuple[int, ...]] = []
        for i, work in enumerate(works):
            if work.shared_prefix_len <= 0:
                continue
            key = tuple(work.token_ids[: work.shared_prefix_len])
            if key in states or key in missing:
                reused[i] = len(key)  # another unit of this batch computes or fetched it
                continue
            state = self.prefix_cache.get(key)
            if state is None:
                missing.append(key)  # this unit pays for it
            else:
                states[key] = state
                reused[i] = len(key)
        return states, missing

    def _prefill(self, missing: list[tuple[int, ...]], rows: list[_Row], states: dict[tuple[int, ...], PrefixState]
                 ) -> dict[int, torch.Tensor]:
        """Compute the missing prefixes (into `states` and the cache) together with the rows hanging off them, in the
        same model calls where the model allows: those rows' kept hidden states, by row index, each [keep, H]."""
        if not missing:
            return {}
        index = {key: p for p, key in enumerate(missing)}
        pending: list[int] = []  # the rows hanging off a missing prefix
        suffixes: list[tuple[int, list[int], int]] = []  # theirs: (prefix index, suffix, keep)
        for r, row in enumerate(rows):
            p = index.get(tuple(row.tokens[: row.split])) if row.split else None
            if p is not None:
                pending.append(r)
                suffixes.append((p, row.tokens[row.split :], row.keep))
        computed, hidden = prefill_with_suffixes(self.loaded.model, self.loaded.plan, missing, suffixes, self.loaded.pad_token_id)
        for state in computed:
            states[state.tokens] = state
            self.prefix_cache.put(state)
        return dict(zip(pending, hidden.split([rows[r].keep for r in pending])))

    @staticmethod
    def _chunks(rows: list[tuple[int, _Row]]):
        """Consecutive (index, row) pairs whose kept positions fit one lm_head projection (a label row keeps one)."""
        chunk: list[tuple[int, _Row]] = []
        kept = 0
        for indexed in rows:
            if chunk and kept + indexed[1].keep > LOGIT_ROWS_PER_CHUNK:
                yield chunk
                chunk, kept = [], 0
            chunk.append(indexed)
            kept += indexed[1].keep
        if chunk:
            yield chunk

    def _kept_hidden(self, chunk: list[tuple[int, _Row]], states: dict[tuple[int, ...], PrefixState],
                     prefilled: dict[int, torch.Tensor]) -> torch.Tensor:
        """Final hidden states of each row's kept positions, row after row: [sum of keep, H].

        Rows without a shared prefix take the plain packed pass; rows run with their prefix's prefill bring their
        hidden states (`prefilled`, by row index); the others run over their prefix's states.
        """
        model, plan, pad = self.loaded.model, self.loaded.plan, self.loaded.pad_token_id
        rows = [row for _, row in chunk]
        parts: list[torch.Tensor | None] = [prefilled.get(r) for r, _ in chunk]  # [keep, H] each, once filled
        plain = [i for i, row in enumerate(rows) if row.split == 0]
        shared = [i for i, row in enumerate(rows) if row.split > 0 and parts[i] is None]
        if plain:
            keep = [rows[i].keep for i in plain]
            hidden = forward_hidden(model, plan, [rows[i].tokens for i in plain], pad, keep_last=keep)
            for i, block in zip(plain, hidden.split(keep)):
                parts[i] = block
        if shared:
            keep = [rows[i].keep for i in shared]
            suffix_rows = [SuffixRow(states[tuple(rows[i].tokens[: rows[i].split])], tuple(rows[i].tokens[rows[i].split :]),
                                     rows[i].keep) for i in shared]
            for i, block in zip(shared, forward_suffixes(model, plan, suffix_rows, pad).split(keep)):
                parts[i] = block
        return torch.cat(parts)
