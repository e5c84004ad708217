"""The engine core: the one owner of the device. One loop of steps, each asking the scheduler what runs next (a
scoring batch, a generation step, a trim) and running it on one device thread, under one memory budget in bytes.
Typed work of token ids in (ScoreQuery, prompt + GenerationParams), typed results out (ScoredPrompts, stream
events); the API layer checks and tokenizes requests before they get here."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from app.engine.batcher import Batcher, BatchStats
from app.engine.budget import MemoryBudget, baseline_bytes
from app.engine.device import DEVICE_THREAD, device_thread
from app.engine.generation import Generator
from app.engine.results import ChoiceUpdate, PromptLogprobs, ScoredPrompts, ScoreOutcome
from app.engine.scheduler import GenerationStep, Idle, Scheduler, ScoringBatch, Trim
from app.engine.scoring import Scorer, common_prefix_len
from app.engine.token_strings import TokenStrings
from app.engine.work import GenerationParams, ScoreQuery, ScoreWork
from app.errors import InvalidRequestError, ServiceUnavailableError
from app.settings import Settings
from models import LoadedModel
from models.memory import MemoryModel, default_memory_budget, release_free_memory

log = logging.getLogger("genscore.engine")

_STOPPED = "the engine loop (scoring batcher and generation) stopped"


class Engine:
    """Owns the loaded model, the device thread, the scoring batcher, the generator, and the one loop
    of steps that drives them. Scoring and generation never drive the model from two threads: two torch thread
    teams on the same cores would slow both, and the budget could not hold."""

    def __init__(self, loaded: LoadedModel, settings: Settings, on_batch=None, on_tokens=None,
                 device: ThreadPoolExecutor | None = None):
        self.loaded = loaded
        self.settings = settings
        self.model_name = settings.model_name
        # The thread the model was loaded on (app/engine/device.py says why it must be the same one); whoever
        # passes it in shuts it down, a thread of the engine's own is shut down at stop.
        self._owns_device = device is None
        self.device = device or device_thread()
        self.token_strings = TokenStrings(loaded.tokenizer)  # shared with the OpenAI routes: one cache
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
        self.scheduler = Scheduler(self.batcher, self.generator, self._scoring_allowance,
                                   budgeted=lambda: self.budget is not None)
        self._task: asyncio.Task | None = None
        # The memory budget is set once warm (it is measured from what the process then holds); until then only
        # the token limits apply.
        self.budget: MemoryBudget | None = None

    @property
    def share_prefixes(self) -> bool:
        return self.scorer.share_prefixes

    @property
    def work_counts(self) -> tuple[int, int]:
        """(waiting, running) of all the engine's work: scoring sequences plus generation prompts / choices."""
        return (self.batcher.waiting + self.generator.waiting, self.batcher.running + self.generator.running)

    @property
    def prefix_cache(self):
        return self.scorer.prefix_cache

    # --- lifecycle -----------------------------------------------------------------
    async def warm_up(self) -> None:
        """Real work through the paths requests take, on the device thread, so the first caller pays no lazy init."""
        await asyncio.get_running_loop().run_in_executor(self.device, self.scorer.warm_up)
        await self.generator.warm_up()
        await asyncio.get_running_loop().run_in_executor(self.device, release_free_memory)
        self._bound_memory()

    def _bound_memory(self) -> None:
        """Set the memory budget once the process holds the model and its warm-up leftovers (its baseline)."""
        s = self.settings
        device = self.loaded.device
        total = int(s.memory_budget or default_memory_budget(device))
        # a /score of max_items prompts, each with its labels' values, scores and ranks and a top list (id, text, value)
        largest_response = s.max_items * (3 * s.max_label_token_ids + 3 * s.max_top_logprobs)
        budget = self.budget = MemoryBudget.of(MemoryModel.of(self.loaded), total, baseline_bytes(device),
                                               self.scorer.prefix_cache.stats.capacity_bytes, largest_response,
                                               s.max_batch_tokens)
        self.generator.fits_memory = budget.generation_fits
        gib = 2**30
        log.info("memory budget %.2f GiB: %.2f GiB held at ready, %.2f GiB prefix cache, %.2f GiB for responses, "
                 "%.2f GiB for work (scoring batches up to %d tokens; decode rows leave %.2f GiB for scoring)",
                 total / gib, budget.baseline_bytes / gib, budget.prefix_cache_bytes / gib, budget.response_bytes / gib,
                 budget.work_bytes / gib, budget.scoring_tokens(0, 0, s.max_batch_tokens),
                 budget.scoring_reserve_bytes / gib)

    def _scoring_allowance(self) -> int:
        """Padded tokens the next scoring batch may hold beside the decode cache as it is now."""
        if self.budget is None:
            return self.settings.max_batch_tokens
        return self.budget.scoring_tokens(*self.generator.cache_shape, self.settings.max_batch_tokens)

    def start(self) -> None:
        """Start the loop of steps as one task in the running event loop."""
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="genscore-engine")
        self._task.add_done_callback(self._on_loop_exit)

    @property
    def alive(self) -> bool:
        return self._task is not None and not self._task.done()

    async def stop(self) -> None:
        # A loop that already died was reported by _on_loop_exit; stopping it must not raise its error again.
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._owns_device:
            self.device.shutdown(wait=True)

    # --- the loop of steps -------------------------------------------------------------
    async def step(self) -> None:
        """Ask the scheduler what runs next and run it; with nothing to run, wait for work (or a trim's time)."""
        self._wake.clear()
        action = self.scheduler.next()
        match action:
            case ScoringBatch(max_tokens=max_tokens, must_fit=must_fit):
                batch = await self.batcher.collect(max_tokens, must_fit)
                self.scheduler.scored(held=batch is None)
                if batch:
                    # Not in a `finally`: if this task is cancelled, fail_all must still see the batch.
                    await self.batcher.run(batch)
            case GenerationStep(admit_new=admit_new):
                await self.generator.run_step(admit_new)
            case Trim():
                # Queued, not awaited: the device thread may be busy (a held or long job), and work that arrives
                # meanwhile is scheduled at once, to run on the device after the trim.
                self.device.submit(release_free_memory).add_done_callback(_log_trim_failure)
            case Idle(timeout_s=timeout_s):
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout_s)

    async def _loop(self) -> None:
        while True:
            await self.step()

    def _on_loop_exit(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("engine loop died", exc_info=task.exception())
        self.batcher.fail_all(ServiceUnavailableError(_STOPPED))
        self.generator.fail_all(ServiceUnavailableError(_STOPPED))

    # --- the request path ------------------------------------------------------------
    async def score(self, query: ScoreQuery) -> ScoredPrompts:
        """Score every prompt of the query through the batcher, one unit each. The prompts' common prefix is marked
        shared when more than one sequence hangs off it (several prompts, or candidates), so it runs once per batch
        or comes from the cache.

        A prompt too big for any scoring batch the memory budget allows is refused (400 naming its field)."""
        prompts, candidates = query.prompts, query.candidates
        self._check_alive()
        shared = 0
        if self.share_prefixes and (len(prompts) > 1 or candidates):
            shared = common_prefix_len(prompts)
        works = [ScoreWork(ids, query.params, shared, candidates) for ids in prompts]
        if self.budget is not None:
            for i, work in enumerate(works):
                if not self.budget.scoring_unit_fits(len(work.token_ids), work.candidates):
                    raise InvalidRequestError(
                        f"this prompt ({len(work.token_ids)} tokens, {max(1, len(candidates))} row(s)) does not fit "
                        "the server's memory budget (--memory-budget) even alone; shorten it or send fewer "
                        "candidates", query.prompt_param(i))
        outcomes = await self.batcher.submit(works)
        return ScoredPrompts(prompts, candidates, query.params, outcomes)

    def _check_generation(self, prompt_len: int, max_tokens: int, param: str, max_param: str) -> None:
        """400 when one choice of this prompt could never fit the memory budget, even alone: its cache grown to
        prompt + max_tokens, with its prefill. Names max_tokens when a smaller one would fit, else the prompt."""
        if self.budget is None:
            return
        final = min(prompt_len + max_tokens, self.loaded.max_length)
        if self.budget.generation_fits(1 if max_tokens else 0, final, 1, prompt_len):
            return
        if self.budget.generation_fits(1, prompt_len + 1, 1, prompt_len):
            raise InvalidRequestError(
                f"{prompt_len} prompt tokens + {max_tokens} completion tokens do not fit the server's memory budget "
                f"(--memory-budget) even alone; reduce {max_param}", max_param)
        raise InvalidRequestError(f"a prompt of {prompt_len} tokens does not fit the server's memory budget "
                                  "(--memory-budget) even alone; shorten it", param)

    def generate(self, prompt_ids: list[int], params: GenerationParams, param: str = "prompt",
                 max_param: str = "max_tokens") -> AsyncIterator[PromptLogprobs | ChoiceUpdate]:
        """Stream one prompt's events from the generator (see Generator.generate); nothing is queued until the
        stream is iterated.

        A prompt whose choice could never fit the memory budget is refused here, at the call (400 naming `param`,
        the prompt's field, or `max_param`, the request's max_tokens): a caller that calls this before it starts
        its answer gets the 400 before any streamed byte."""
        self._check_alive()
        self._check_generation(len(prompt_ids), params.max_tokens, param, max_param)
        return self.generator.generate(prompt_ids, params)

    def _check_alive(self) -> None:
        if not self.alive:
            raise ServiceUnavailableError(_STOPPED)


def _log_trim_failure(done: Future) -> None:
    if not done.cancelled() and done.exception() is not None:
        log.warning("giving freed memory back to the OS failed", exc_info=done.exception())


def set_torch_threads(settings: Settings) -> None:
    if settings.torch_threads:
        torch.set_num_threads(settings.torch_threads)


__all__ = ["BatchStats", "DEVICE_THREAD", "Engine", "set_torch_threads"]
