"""The scoring engine: validated requests -> token sequences -> batched forward pass -> sampler -> per-item results.

The only module that knows both models/ and sampler/.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import NamedTuple

import torch

import sampler
from app.batcher import Batcher, BatchStats
from app.errors import InvalidRequestError, ModelNotServedError
from app.schemas import ScoreRequest
from app.settings import Settings
from app.token_strings import TokenStrings
from models import LoadedModel, forward_logits
from models.head import head_logits
from models.prefix import PrefixCache, PrefixState, SuffixRow, forward_suffixes, prefill
from sampler import LogprobsMode, SamplingParams

log = logging.getLogger("genscore.engine")

NEG_INF_JSON = -9999.0  # JSON has no -inf; this stands for it everywhere


@dataclass(frozen=True)
class ScoreWork:
    """One prompt to score: the batcher's unit of work.

    `shared_prefix_len` leading tokens are common to every prompt of its request (the query,
    when items follow it): units carrying the same prefix in a batch run it once. With
    `candidates`, each candidate is scored as a continuation of the prompt.
    """

    token_ids: list[int]
    params: SamplingParams
    shared_prefix_len: int = 0
    candidates: tuple[tuple[int, ...], ...] = ()

    @property
    def cost(self) -> int:
        """Tokens this unit puts through the model if nothing is shared: one row per candidate, or one row."""
        longest_candidate = max((len(c) for c in self.candidates), default=0)
        return max(1, len(self.candidates)) * (len(self.token_ids) + longest_candidate)


class ScoreOutcome(NamedTuple):
    """The result of one ScoreWork."""

    labels: sampler.RowScores | None  # label values, ranks and top list at the next position (label requests)
    candidate_values: list[list[float]] | None  # [C][tokens of candidate c]: each token's value under the mode
    reused_tokens: int  # prompt tokens whose key/value states came from a shared prefix instead of being computed


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


# logits rows projected through lm_head at a time when reading candidate tokens: bounds [N, V] memory
_CANDIDATE_ROWS_PER_CHUNK = 256


def check_list_size(values: list, limit: int, param: str, noun: str) -> None:
    """A list field that is given must hold between 1 and `limit` entries; else a 400 naming `param`."""
    if not values:
        raise InvalidRequestError(f"{param} must hold at least one {noun} when given", param)
    if len(values) > limit:
        raise InvalidRequestError(f"{len(values)} {param} exceed the limit of {limit}", param)


def finite(value: float) -> float:
    return NEG_INF_JSON if value == -math.inf else value


def softmax_over(values: list[float]) -> list[float]:
    """Softmax over a short list; labels all at -inf have no distribution and get 0.0 each."""
    top = max(values)
    if top == -math.inf:
        return [0.0] * len(values)
    exps = [math.exp(v - top) for v in values]
    total = sum(exps)
    return [e / total for e in exps]


class Engine:
    """Owns the loaded model, the worker thread and the batcher; turns ScoreRequests into response dicts."""

    def __init__(self, loaded: LoadedModel, settings: Settings, on_batch=None,
                 device: ThreadPoolExecutor | None = None):
        self.loaded = loaded
        self.settings = settings
        self.model_name = settings.model_name
        self.max_prompt_tokens = min(settings.max_prompt_tokens or loaded.max_length, loaded.max_length)
        # One worker thread: torch already uses every core inside a forward pass. `device` is the app's one
        # device thread, shared with the generation loop so the two never drive the model at once.
        self._owns_device = device is None
        self._executor = device or ThreadPoolExecutor(max_workers=1, thread_name_prefix="genscore-forward")
        # Tokenizing a long text takes seconds; off the event loop so probes and other callers go on.
        # One thread: a fast tokenizer shared by threads can fail with "Already borrowed".
        self._tokenize_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="genscore-tokenize")
        self.batcher: Batcher[ScoreWork, ScoreOutcome] = Batcher(
            self.run_batch,
            tokens_of=lambda work: work.cost,
            executor=self._executor,
            max_batch_size=settings.max_batch_size,
            max_batch_tokens=settings.max_batch_tokens,
            max_wait_ms=settings.max_wait_ms,
            max_queued_requests=settings.max_queued_requests,  # bounded admission
            retry_after_s=settings.retry_after_s,
            on_batch=on_batch,
        )
        self.token_strings = TokenStrings(loaded.tokenizer)  # shared with the OpenAI routes: one cache
        self.share_prefixes = settings.share_prefixes and loaded.shares_prefixes
        self.prefix_cache = PrefixCache(int(settings.prefix_cache_mb * 2**20) if self.share_prefixes else 0)

    # --- lifecycle -----------------------------------------------------------------
    def start(self) -> None:
        self.batcher.start()

    async def stop(self) -> None:
        await self.batcher.stop()
        if self._owns_device:
            self._executor.shutdown(wait=True)
        self._tokenize_executor.shutdown(wait=True)

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
        states = self._prefix_states(works, reused)
        rows: list[_Row] = []
        for i, work in enumerate(works):
            split = work.shared_prefix_len if states else 0
            if work.candidates:
                # the candidate's last token is only predicted, never fed
                rows += [_Row(i, work.token_ids + list(c[:-1]), split, len(c), c) for c in work.candidates]
            else:
                rows.append(_Row(i, work.token_ids, split, 1, ()))

        label_logits: dict[int, torch.Tensor] = {}  # work -> [V]
        candidate_values: dict[int, list[list[float]]] = {i: [] for i, w in enumerate(works) if w.candidates}
        for chunk in self._chunks(rows):
            logits = self._kept_logits(chunk, states)  # [sum of keep, V], row after row
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

    def _prefix_states(self, works: list[ScoreWork], reused: list[int]) -> dict[tuple[int, ...], PrefixState]:
        """Key/value states of every shared prefix in the batch: from the cache, else one prefill for all missing."""
        if not self.share_prefixes:
            return {}
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
        if missing:
            for state in prefill(self.loaded.model, missing, self.loaded.pad_token_id):
                states[state.tokens] = state
                self.prefix_cache.put(state)
        return states

    @staticmethod
    def _chunks(rows: list[_Row]):
        """Consecutive rows whose kept positions fit one lm_head projection (a label row keeps one)."""
        chunk: list[_Row] = []
        kept = 0
        for row in rows:
            if chunk and kept + row.keep > _CANDIDATE_ROWS_PER_CHUNK:
                yield chunk
                chunk, kept = [], 0
            chunk.append(row)
            kept += row.keep
        if chunk:
            yield chunk

    def _kept_logits(self, rows: list[_Row], states: dict[tuple[int, ...], PrefixState]) -> torch.Tensor:
        """float32 logits of each row's kept positions, row after row: [sum of keep, V].

        Rows without a shared prefix take the plain padded pass; the others run over their prefix's states.
        """
        model, pad = self.loaded.model, self.loaded.pad_token_id
        parts: list[torch.Tensor | None] = [None] * len(rows)
        plain = [i for i, r in enumerate(rows) if r.split == 0]
        shared = [i for i, r in enumerate(rows) if r.split > 0]
        if plain:
            keep = [rows[i].keep for i in plain]
            logits = forward_logits(model, [rows[i].tokens for i in plain], pad, keep_last=keep)
            for i, block in zip(plain, logits.split(keep)):
                parts[i] = block
        if shared:
            keep = [rows[i].keep for i in shared]
            suffix_rows = [SuffixRow(states[tuple(rows[i].tokens[: rows[i].split])], tuple(rows[i].tokens[rows[i].split :]),
                                     rows[i].keep) for i in shared]
            logits = head_logits(model, forward_suffixes(model, suffix_rows, pad))
            for i, block in zip(shared, logits.split(keep)):
                parts[i] = block
        return torch.cat(parts)

    # --- request -> work -------------------------------------------------------------
    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise ModelNotServedError(f"model {name!r} is not served here; this server serves {self.model_name!r}",
                                     param="model", code="model_not_found")

    def _check_token_ids(self, ids: list[int], param: str) -> None:
        vocab = self.loaded.vocab_size
        for i, token_id in enumerate(ids):
            if not 0 <= token_id < vocab:
                raise InvalidRequestError(f"{param}[{i}] = {token_id} is outside the vocabulary [0, {vocab})", param)

    def _encode(self, text_or_ids: str | list[int], add_special_tokens: bool, param: str) -> list[int]:
        if isinstance(text_or_ids, str):
            return self.loaded.tokenizer(text_or_ids, add_special_tokens=add_special_tokens)["input_ids"]
        self._check_token_ids(text_or_ids, param)
        return list(text_or_ids)

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The model tokenizer's ids for text."""
        return self.loaded.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]

    def logit_bias_pairs(self, logit_bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
        """OpenAI-style {"<token id>": bias} -> (id, bias) pairs, each id checked against this model's vocabulary."""
        pairs: list[tuple[int, float]] = []
        for key, value in (logit_bias or {}).items():
            try:
                token_id = int(key)
            except ValueError:
                raise InvalidRequestError(f"logit_bias key {key!r} is not a token id", "logit_bias") from None
            if not 0 <= token_id < self.loaded.vocab_size:
                raise InvalidRequestError(
                    f"logit_bias token id {token_id} is outside the vocabulary [0, {self.loaded.vocab_size})",
                    "logit_bias")
            if not math.isfinite(value):
                raise InvalidRequestError("logit_bias values must be finite", "logit_bias")
            pairs.append((token_id, value))
        return tuple(pairs)

    def sampling_params(self, request: ScoreRequest) -> SamplingParams:
        """Validate the per-request options against this model and server, once, before any batching."""
        if request.candidates is not None:
            if request.label_token_ids is not None:
                raise InvalidRequestError("give either label_token_ids or candidates, not both", "candidates")
            if request.top_logprobs:
                raise InvalidRequestError("top_logprobs applies to label_token_ids; it is not available with candidates",
                                          "top_logprobs")
        elif request.label_token_ids is None:
            raise InvalidRequestError("label_token_ids (or candidates) is required", "label_token_ids")
        else:
            if not request.label_token_ids:
                raise InvalidRequestError("label_token_ids must not be empty", "label_token_ids")
            if len(request.label_token_ids) > self.settings.max_label_token_ids:
                raise InvalidRequestError(
                    f"{len(request.label_token_ids)} label_token_ids exceed the limit of "
                    f"{self.settings.max_label_token_ids}", "label_token_ids")
            self._check_token_ids(request.label_token_ids, "label_token_ids")
        if request.top_logprobs > self.settings.max_top_logprobs:
            raise InvalidRequestError(
                f"top_logprobs = {request.top_logprobs} exceeds the server cap of {self.settings.max_top_logprobs}",
                "top_logprobs")
        bias = self.logit_bias_pairs(request.logit_bias)
        try:
            return SamplingParams(
                logprobs_mode=request.logprobs_mode or self.settings.default_logprobs_mode,
                temperature=request.temperature,
                top_k=request.top_k,
                top_p=request.top_p,
                min_p=request.min_p,
                logit_bias=bias,
                label_token_ids=tuple(request.label_token_ids or ()),
                top_logprobs=request.top_logprobs,
            )
        except ValueError as exc:  # the schema already bounds these; this is the sampler's own word
            raise InvalidRequestError(str(exc)) from None

    def score_prompts(self, request: ScoreRequest) -> list[list[int]]:
        """Token sequences to score: the query alone, or query + each item (item + query with item_first)."""
        query = self._encode(request.query, request.add_special_tokens, "query")
        if request.items is None:
            prompts = [query]
        else:
            check_list_size(request.items, self.settings.max_items, "items", "item")
            prompts = []
            for i, item in enumerate(request.items):
                item_ids = self._encode(item, False, f"items[{i}]")  # items never get special tokens
                prompts.append(item_ids + query if request.item_first else query + item_ids)
        for i, ids in enumerate(prompts):
            param = "query" if request.items is None else f"items[{i}]"
            if not ids:
                raise InvalidRequestError("the prompt is empty (no tokens to condition on)", param)
            if request.truncate_prompt_tokens is not None:
                if request.truncate_prompt_tokens > self.max_prompt_tokens:
                    raise InvalidRequestError(
                        f"truncate_prompt_tokens = {request.truncate_prompt_tokens} exceeds the maximum prompt length "
                        f"{self.max_prompt_tokens}", "truncate_prompt_tokens")
                prompts[i] = ids = ids[-request.truncate_prompt_tokens:]
            if len(ids) > self.max_prompt_tokens:
                raise InvalidRequestError(
                    f"the prompt has {len(ids)} tokens, more than the maximum of {self.max_prompt_tokens}; "
                    "shorten it or set truncate_prompt_tokens", param)
        return prompts

    def score_candidates(self, request: ScoreRequest, prompts: list[list[int]]) -> tuple[tuple[int, ...], ...]:
        """The candidates as token ids (text tokenized alone, without special tokens); () for a label request."""
        if request.candidates is None:
            return ()
        check_list_size(request.candidates, self.settings.max_candidates, "candidates", "candidate")
        candidates = []
        for i, candidate in enumerate(request.candidates):
            ids = self._encode(candidate, False, f"candidates[{i}]")
            if not ids:
                raise InvalidRequestError("the candidate is empty (no tokens to score)", f"candidates[{i}]")
            candidates.append(tuple(ids))
        longest = max(len(c) for c in candidates)
        for i, prompt in enumerate(prompts):
            if len(prompt) + longest > self.max_prompt_tokens:
                raise InvalidRequestError(
                    f"the prompt ({len(prompt)} tokens) plus the longest candidate ({longest}) exceed the maximum of "
                    f"{self.max_prompt_tokens} tokens", "query" if request.items is None else f"items[{i}]")
        return tuple(candidates)

    # --- the request path ------------------------------------------------------------
    async def on_tokenizer_thread(self, fn, *args):
        """Run fn(*args) on the one tokenizer thread: long texts stall no one, and the tokenizer is never shared."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_executor, fn, *args)

    async def score(self, request: ScoreRequest) -> dict:
        """Validate, queue every prompt of the request in the batcher, and build the /score response body."""
        self.check_model(request.model)
        params = self.sampling_params(request)
        prompts = await self.on_tokenizer_thread(self.score_prompts, request)
        candidates = self.score_candidates(request, prompts)
        outcomes = await self.run_prompts(prompts, params, candidates)
        return self._score_response(request, params, prompts, candidates, outcomes)

    async def run_prompts(self, prompts: list[list[int]], params: SamplingParams,
                          candidates: tuple[tuple[int, ...], ...] = ()) -> list[ScoreOutcome]:
        """One unit per prompt through the batcher. The prompts' common prefix is marked shared when more than one
        sequence hangs off it (several prompts, or candidates), so it runs once per batch or comes from the cache."""
        shared = 0
        if self.share_prefixes and (len(prompts) > 1 or candidates):
            shared = common_prefix_len(prompts)
        return await self.batcher.submit([ScoreWork(ids, params, shared, candidates) for ids in prompts])

    def _score_response(self, request: ScoreRequest, params: SamplingParams, prompts: list[list[int]],
                        candidates: tuple[tuple[int, ...], ...], outcomes: list[ScoreOutcome]) -> dict:
        entry = self._candidate_entry if candidates else self._label_entry
        data = [entry(index, request, params, outcome) for index, outcome in enumerate(outcomes)]
        # every prompt token once, plus every candidate token once per prompt it follows
        prompt_tokens = sum(len(p) for p in prompts) + len(prompts) * sum(len(c) for c in candidates)
        return {
            "id": f"score-{uuid.uuid4().hex}",
            "object": "score",
            "created": int(time.time()),
            "model": self.model_name,
            "logprobs_mode": params.logprobs_mode.value,
            "data": data,
            "usage": usage(prompt_tokens, outcomes),
        }

    @staticmethod
    def _scores(values: list[float], request: ScoreRequest, params: SamplingParams) -> list[float] | None:
        if request.apply_softmax:
            return softmax_over(values)
        if params.logprobs_mode.is_logprobs:
            return [math.exp(v) for v in values]
        return None

    def _label_entry(self, index: int, request: ScoreRequest, params: SamplingParams, outcome: ScoreOutcome) -> dict:
        row = outcome.labels
        top = None
        if params.top_logprobs:
            top = [{"token_id": t, "token": self.token_strings.text(t), "logprob": finite(v)}
                   for t, v in zip(row.top_ids, row.top_values)]
        return {
            "index": index,
            "label_logprobs": [finite(v) for v in row.label_values],
            "scores": self._scores(row.label_values, request, params),
            "label_ranks": row.label_ranks,
            "top_logprobs": top,
        }

    def _candidate_entry(self, index: int, request: ScoreRequest, params: SamplingParams,
                         outcome: ScoreOutcome) -> dict:
        totals = [math.fsum(values) for values in outcome.candidate_values]  # a filtered (-inf) token gives -inf
        return {
            "index": index,
            "candidate_logprobs": [finite(v) for v in totals],
            "scores": self._scores(totals, request, params),
            "candidate_token_logprobs": [[finite(v) for v in values] for values in outcome.candidate_values],
            "candidate_num_tokens": [len(values) for values in outcome.candidate_values],
        }


def usage(prompt_tokens: int, outcomes: list[ScoreOutcome]) -> dict:
    """OpenAI-style usage; cached_tokens counts prompt tokens whose key/value states were reused, not recomputed."""
    cached = sum(o.reused_tokens for o in outcomes)
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}


def set_torch_threads(settings: Settings) -> None:
    if settings.torch_threads:
        torch.set_num_threads(settings.torch_threads)


__all__ = ["BatchStats", "Engine", "LogprobsMode", "NEG_INF_JSON", "ScoreOutcome", "ScoreWork", "common_prefix_len",
           "set_torch_threads", "usage"]
