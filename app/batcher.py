"""Dynamic batcher: one asyncio queue, one consumer task, one Future per unit of work; batches close on size, token budget or max wait."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from app.errors import EngineError, ServiceUnavailableError

log = logging.getLogger("genscore.batcher")

W = TypeVar("W")  # a unit of work, e.g. one sequence to score
R = TypeVar("R")  # its result


@dataclass
class _Pending(Generic[W]):
    work: W
    tokens: int
    future: asyncio.Future
    enqueued_at: float = field(default_factory=time.perf_counter)


@dataclass(frozen=True)
class BatchStats:
    """What one batch looked like, for metrics and logs."""

    size: int
    padded_tokens: int
    queue_wait_s: float  # longest wait of a unit in this batch
    compute_s: float


class Batcher(Generic[W, R]):
    """Coalesce units of work from many callers into calls of `handler(list[W]) -> list[R]`.

    Shaped like Ray Serve's batcher: a failed batch sets the exception on every
    Future in it and the loop keeps running; a cancelled caller's units are
    dropped before they reach the handler. The handler runs in `executor` so the
    event loop (probes, request parsing) stays responsive during a forward pass.
    """

    def __init__(
        self,
        handler: Callable[[list[W]], Sequence[R]],
        *,
        tokens_of: Callable[[W], int],
        executor: Executor,
        max_batch_size: int,
        max_batch_tokens: int,
        max_wait_ms: float,
        on_batch: Callable[[BatchStats], None] | None = None,
    ):
        self._handler = handler
        self._tokens_of = tokens_of
        self._executor = executor
        self._max_batch_size = max_batch_size
        self._max_batch_tokens = max_batch_tokens
        self._max_wait_s = max_wait_ms / 1000.0
        self._on_batch = on_batch
        self._queue: asyncio.Queue[_Pending[W]] = asyncio.Queue()
        self._carry: _Pending[W] | None = None  # a unit that did not fit the last batch goes first next time
        self._task: asyncio.Task | None = None
        self._inflight: list[_Pending[W]] = []  # the batch being computed

    # --- lifecycle -----------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="genscore-batcher")
        self._task.add_done_callback(self._on_loop_exit)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    @property
    def alive(self) -> bool:
        return self._task is not None and not self._task.done()

    @property
    def running(self) -> int:
        return len(self._inflight)

    @property
    def waiting(self) -> int:
        return self._queue.qsize() + (self._carry is not None)

    # --- callers -------------------------------------------------------------------
    async def submit(self, works: Sequence[W]) -> list[R]:
        """Queue `works` and wait for their results, in order. Cancelling the caller drops its queued units."""
        if not self.alive:
            raise ServiceUnavailableError("the batcher is not running")
        loop = asyncio.get_running_loop()
        pending = [_Pending(w, self._tokens_of(w), loop.create_future()) for w in works]
        for p in pending:
            self._queue.put_nowait(p)
        return list(await asyncio.gather(*(p.future for p in pending)))

    # --- the consumer --------------------------------------------------------------
    async def _next(self, timeout: float | None) -> _Pending[W] | None:
        if self._carry is not None:
            pending, self._carry = self._carry, None
            return pending
        if timeout is None:
            return await self._queue.get()
        if not self._queue.empty():
            return self._queue.get_nowait()
        if timeout <= 0:
            return None
        try:
            async with asyncio.timeout(timeout):
                return await self._queue.get()
        except TimeoutError:
            return None

    async def _collect(self) -> list[_Pending[W]]:
        """Block for the first live unit, then add more until size, token budget or max wait closes the batch."""
        batch: list[_Pending[W]] = []
        longest = 0
        deadline = None
        while len(batch) < self._max_batch_size:
            timeout = None if not batch else max(0.0, deadline - time.perf_counter())
            pending = await self._next(timeout)
            if pending is None:
                break
            if pending.future.done():  # caller went away (cancelled) while queued
                continue
            new_longest = max(longest, pending.tokens)
            if batch and new_longest * (len(batch) + 1) > self._max_batch_tokens:
                self._carry = pending
                break
            batch.append(pending)
            longest = new_longest
            if deadline is None:
                deadline = time.perf_counter() + self._max_wait_s
        return batch

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = await self._collect()
            batch = [p for p in batch if not p.future.done()]
            if not batch:
                continue
            started = time.perf_counter()
            self._inflight = batch
            try:
                results = await loop.run_in_executor(self._executor, self._handler, [p.work for p in batch])
                if len(results) != len(batch):
                    raise RuntimeError(f"handler returned {len(results)} results for {len(batch)} units")
            except Exception as exc:  # noqa: BLE001 - every caller in the batch must hear about it
                log.exception("batch of %d failed", len(batch))
                error = exc if isinstance(exc, EngineError) else EngineError("the model failed on this batch")
                for p in batch:
                    if not p.future.done():
                        p.future.set_exception(error)
                self._inflight = []
                continue
            # Not in a `finally`: if the loop itself is cancelled, _on_loop_exit must still see this batch.
            self._inflight = []
            for p, result in zip(batch, results):
                if not p.future.done():
                    p.future.set_result(result)
            if self._on_batch is not None:
                longest = max(p.tokens for p in batch)
                self._on_batch(
                    BatchStats(
                        size=len(batch),
                        padded_tokens=longest * len(batch),
                        queue_wait_s=started - min(p.enqueued_at for p in batch),
                        compute_s=time.perf_counter() - started,
                    )
                )

    def _on_loop_exit(self, task: asyncio.Task) -> None:
        """Whatever ended the loop, nobody may wait forever: fail every queued caller at once."""
        if not task.cancelled() and task.exception() is not None:
            log.error("batcher loop died", exc_info=task.exception())
        error = ServiceUnavailableError("the batcher stopped")
        stranded = self._inflight + ([self._carry] if self._carry else [])
        self._inflight, self._carry = [], None
        while not self._queue.empty():
            stranded.append(self._queue.get_nowait())
        for p in stranded:
            if not p.future.done():
                p.future.set_exception(error)
