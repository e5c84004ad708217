"""The engine core: the one owner of the device. One scheduler loop feeds one device thread with scoring batches and
generation steps in turn, under one budget of key/value tokens; tokenization and input checks run on one tokenizer
thread. Typed work in (ScoreQuery, prompts + GenerationParams), typed results out (ScoredPrompts, stream events)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

import torch

from app.engine.batcher import Batcher, BatchStats
from app.engine.generation import Generator
from app.engine.inputs import InputChecks
from app.engine.loop import ConsumerLoop
from app.engine.results import ChoiceUpdate, PromptLogprobs, ScoredPrompts, ScoreOutcome
from app.engine.score_prompts import ScorePrompts
from app.engine.scoring import Scorer, common_prefix_len
from app.engine.token_strings import TokenStrings
from app.engine.work import GenerationParams, ScoreQuery, ScoreWork
from app.errors import ServiceUnavailableError
from app.settings import Settings
from models import LoadedModel
from sampler import SamplingParams

log = logging.getLogger("genscore.engine")

DEVICE_THREAD = "genscore-device"  # the name of the one thread that runs model calls


class Engine(ConsumerLoop):
    """Owns the loaded model, the device and tokenizer threads, the scoring batcher and the decode loop, and the
    one loop that schedules them. Scoring and generation never drive the model from two threads: two torch thread
    teams on the same cores would slow both, and the budget could not hold."""

    task_name = "genscore-engine"

    def __init__(self, loaded: LoadedModel, settings: Settings, on_batch=None, on_tokens=None):
        self.loaded = loaded
        self.settings = settings
        self.model_name = settings.model_name
        self.checks = InputChecks(settings.model_name, loaded.vocab_size, loaded.max_length, settings)
        self.max_prompt_tokens = self.checks.max_prompt_tokens
        self.device = ThreadPoolExecutor(max_workers=1, thread_name_prefix=DEVICE_THREAD)
        # Tokenizing a long text takes seconds; off the event loop so probes and other callers go on.
        # One thread: a fast tokenizer shared by threads can fail with "Already borrowed".
        self._tokenizer_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="genscore-tokenize")
        self.token_strings = TokenStrings(loaded.tokenizer)  # shared with the OpenAI routes: one cache
        self._score_prompts = ScorePrompts(loaded.tokenizer, self.checks)
        self.scorer = Scorer(loaded, settings.share_prefixes, int(settings.prefix_cache_mb * 2**20))
        self._wake = asyncio.Event()
        self.batcher: Batcher[ScoreWork, ScoreOutcome] = Batcher(
            self.scorer.run_batch,
            tokens_of=lambda work: work.cost,
            executor=self.device,
            max_batch_size=settings.max_batch_size,
            max_batch_tokens=settings.max_batch_tokens,
            max_wait_ms=settings.max_wait_ms,
            max_queued_requests=settings.max_queued_requests,  # bounded admission
            retry_after_s=settings.retry_after_s,
            on_batch=on_batch,
            on_work=self._wake.set,
        )
        self.generator = Generator(loaded, settings, device=self.device, on_tokens=on_tokens, on_work=self._wake.set)
        self.batcher.drive_by(self)
        self.generator.drive_by(self)
        # The one budget of key/value tokens: decoding rows reserve their final length, and a scoring batch gets
        # what they leave (max_batch_tokens at most; one unit always, so scoring is never starved out).
        self.budget_tokens = settings.max_cache_tokens

    @property
    def share_prefixes(self) -> bool:
        return self.scorer.share_prefixes

    @property
    def prefix_cache(self):
        return self.scorer.prefix_cache

    # --- lifecycle -----------------------------------------------------------------
    async def warm_up(self) -> None:
        """Real work through the paths requests take, on the device thread, so the first caller pays no lazy init."""
        await asyncio.get_running_loop().run_in_executor(self.device, self.scorer.warm_up)
        await self.generator.warm_up()

    async def stop(self) -> None:
        await super().stop()
        self.device.shutdown(wait=True)
        self._tokenizer_thread.shutdown(wait=True)

    # --- the scheduler ---------------------------------------------------------------
    async def _loop(self) -> None:
        """Scoring batches and generation steps in turn: neither waits more than one of the other's steps."""
        while True:
            self._wake.clear()
            if not (self.batcher.has_work or self.generator.has_work):
                await self._wake.wait()
            if self.batcher.has_work:
                await self.batcher.run_once(max_tokens=max(1, self.budget_tokens - self.generator.reserved_tokens))
            if self.generator.has_work:
                await self.generator.run_once()

    def _on_loop_exit(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("engine loop died", exc_info=task.exception())
        stopped = "the engine loop (scoring batcher and generation) stopped"
        self.batcher.fail_all(ServiceUnavailableError(stopped))
        self.generator.fail_all(ServiceUnavailableError(stopped))

    # --- the request path ------------------------------------------------------------
    async def on_tokenizer_thread(self, fn, *args):
        """Run fn(*args) on the one tokenizer thread: long texts stall no one, and the tokenizer is never shared."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, fn, *args)

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The model tokenizer's ids for text (call it on the tokenizer thread)."""
        return self.loaded.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]

    def prepare_score(self, query: ScoreQuery):
        """A query's checked SamplingParams, prompts and candidates (runs on the tokenizer thread)."""
        params = self._score_prompts.sampling_params(query)
        prompts = self._score_prompts.prompts(query)
        return params, prompts, self._score_prompts.candidates(query, prompts)

    async def score(self, query: ScoreQuery) -> ScoredPrompts:
        """Check and tokenize the query, then score every prompt through the batcher."""
        self.checks.model(query.model)
        params, prompts, candidates = await self.on_tokenizer_thread(self.prepare_score, query)
        outcomes = await self.run_prompts(prompts, params, candidates)
        return ScoredPrompts(prompts, candidates, params, outcomes)

    async def run_prompts(self, prompts: list[list[int]], params: SamplingParams,
                          candidates: tuple[tuple[int, ...], ...] = ()) -> list[ScoreOutcome]:
        """One unit per prompt through the batcher. The prompts' common prefix is marked shared when more than one
        sequence hangs off it (several prompts, or candidates), so it runs once per batch or comes from the cache."""
        shared = 0
        if self.share_prefixes and (len(prompts) > 1 or candidates):
            shared = common_prefix_len(prompts)
        return await self.batcher.submit([ScoreWork(ids, params, shared, candidates) for ids in prompts])

    def generate(self, prompt_ids: list[int], params: GenerationParams
                 ) -> AsyncIterator[PromptLogprobs | ChoiceUpdate]:
        """Stream one prompt's events from the decode loop (see Generator.generate)."""
        return self.generator.generate(prompt_ids, params)


def set_torch_threads(settings: Settings) -> None:
    if settings.torch_threads:
        torch.set_num_threads(settings.torch_threads)


__all__ = ["BatchStats", "DEVICE_THREAD", "Engine", "set_torch_threads"]
