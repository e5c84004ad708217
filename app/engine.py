"""The scoring engine: validated requests -> token sequences -> batched forward pass -> sampler -> per-item results.

The only module that knows both models/ and sampler/.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache

import torch

import sampler
from app.batcher import BatchStats, Batcher
from app.errors import InvalidRequestError, ModelNotServedError
from app.schemas import ScoreRequest
from app.settings import Settings
from models import LoadedModel, forward_logits
from sampler import LogprobsMode, SamplingParams

log = logging.getLogger("genscore.engine")

NEG_INF_JSON = -9999.0  # JSON has no -inf; this stands for it everywhere


@dataclass(frozen=True)
class ScoreWork:
    """One sequence to run: the batcher's unit of work."""

    token_ids: list[int]
    params: SamplingParams


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

    def __init__(self, loaded: LoadedModel, settings: Settings, on_batch=None):
        self.loaded = loaded
        self.settings = settings
        self.model_name = settings.model_name
        self.max_prompt_tokens = min(settings.max_prompt_tokens or loaded.max_length, loaded.max_length)
        # One worker thread: torch already uses every core inside a forward pass.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="genscore-forward")
        # issue 7: tokenizing a long text takes seconds; off the event loop so probes and other callers go on.
        # One thread: a fast tokenizer shared by threads can fail with "Already borrowed".
        self._tokenize_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="genscore-tokenize")
        self.batcher: Batcher[ScoreWork, sampler.RowScores] = Batcher(
            self.run_batch,
            tokens_of=lambda work: len(work.token_ids),
            executor=self._executor,
            max_batch_size=settings.max_batch_size,
            max_batch_tokens=settings.max_batch_tokens,
            max_wait_ms=settings.max_wait_ms,
            max_queued_requests=settings.max_queued_requests,  # issue 7: bounded admission
            retry_after_s=settings.retry_after_s,
            on_batch=on_batch,
        )
        self._token_text = lru_cache(maxsize=65536)(self._decode_one)

    # --- lifecycle -----------------------------------------------------------------
    def start(self) -> None:
        self.batcher.start()

    async def stop(self) -> None:
        await self.batcher.stop()
        self._executor.shutdown(wait=True)
        self._tokenize_executor.shutdown(wait=True)

    def warm_up(self) -> None:
        """One real batch through the same path requests take, so the first caller does not pay for lazy init."""
        ids = self.loaded.tokenizer("warm up", add_special_tokens=True)["input_ids"] or [self.loaded.pad_token_id]
        self.run_batch([ScoreWork(ids, SamplingParams(label_token_ids=(0,), top_logprobs=1))] * 2)

    # --- the batch handler (runs on the worker thread) -------------------------------
    def run_batch(self, works: list[ScoreWork]) -> list[sampler.RowScores]:
        logits = forward_logits(self.loaded.model, [w.token_ids for w in works], self.loaded.pad_token_id)  # [B, V]
        params = [w.params for w in works]
        return sampler.to_rows(sampler.score(logits, params), params)

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

    def sampling_params(self, request: ScoreRequest) -> SamplingParams:
        """Validate the per-request options against this model and server, once, before any batching."""
        if not request.label_token_ids:
            raise InvalidRequestError("label_token_ids must not be empty", "label_token_ids")
        if len(request.label_token_ids) > self.settings.max_label_token_ids:
            raise InvalidRequestError(
                f"{len(request.label_token_ids)} label_token_ids exceed the limit of {self.settings.max_label_token_ids}",
                "label_token_ids")
        self._check_token_ids(request.label_token_ids, "label_token_ids")
        if request.top_logprobs > self.settings.max_top_logprobs:
            raise InvalidRequestError(
                f"top_logprobs = {request.top_logprobs} exceeds the server cap of {self.settings.max_top_logprobs}",
                "top_logprobs")
        bias: list[tuple[int, float]] = []
        for key, value in (request.logit_bias or {}).items():
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
            bias.append((token_id, value))
        try:
            return SamplingParams(
                logprobs_mode=request.logprobs_mode or self.settings.default_logprobs_mode,
                temperature=request.temperature,
                top_k=request.top_k,
                top_p=request.top_p,
                min_p=request.min_p,
                logit_bias=tuple(bias),
                label_token_ids=tuple(request.label_token_ids),
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
            if not request.items:
                raise InvalidRequestError("items must hold at least one item when given", "items")
            if len(request.items) > self.settings.max_items:
                raise InvalidRequestError(
                    f"{len(request.items)} items exceed the limit of {self.settings.max_items}", "items")
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

    # --- the request path ------------------------------------------------------------
    async def score(self, request: ScoreRequest) -> dict:
        """Validate, queue every prompt of the request in the batcher, and build the /score response body."""
        self.check_model(request.model)
        params = self.sampling_params(request)
        loop = asyncio.get_running_loop()
        prompts = await loop.run_in_executor(self._tokenize_executor, self.score_prompts, request)
        rows = await self.batcher.submit([ScoreWork(ids, params) for ids in prompts])
        return self._score_response(request, params, prompts, rows)

    def _decode_one(self, token_id: int) -> str:
        return self.loaded.tokenizer.decode([token_id])

    def _score_response(self, request: ScoreRequest, params: SamplingParams, prompts, rows) -> dict:
        is_logprobs = params.logprobs_mode.is_logprobs
        data = []
        for index, row in enumerate(rows):
            values = row.label_values
            if request.apply_softmax:
                scores = softmax_over(values)
            elif is_logprobs:
                scores = [math.exp(v) for v in values]
            else:
                scores = None
            top = None
            if params.top_logprobs:
                top = [{"token_id": t, "token": self._token_text(t), "logprob": finite(v)}
                       for t, v in zip(row.top_ids, row.top_values)]
            data.append({
                "index": index,
                "label_logprobs": [finite(v) for v in values],
                "scores": scores,
                "label_ranks": row.label_ranks,
                "top_logprobs": top,
            })
        prompt_tokens = sum(len(p) for p in prompts)
        return {
            "id": f"score-{uuid.uuid4().hex}",
            "object": "score",
            "created": int(time.time()),
            "model": self.model_name,
            "logprobs_mode": params.logprobs_mode.value,
            "data": data,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
        }


def set_torch_threads(settings: Settings) -> None:
    if settings.torch_threads:
        torch.set_num_threads(settings.torch_threads)


__all__ = ["BatchStats", "Engine", "LogprobsMode", "NEG_INF_JSON", "ScoreWork", "set_torch_threads"]
