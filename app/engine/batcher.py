"""Dynamic batcher: bounded admission, one queue, a Future per unit of work; a failing batch is split until the failing
unit stands alone. Passive: the engine's scheduler says when to collect a batch and run it."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from app.engine.admission import admit, deadline_error, time_left
from app.engine.halves import Halves
from app.errors import EngineError

log = logging.getLogger("genscore.batcher")

W = TypeVar("W")  # a unit of work, e.g. one sequence to score
R = TypeVar("R")  # its result

@dataclass(eq=False)
class _Ticket:
    """One submit() call: its units share a deadline (which stops applying once one of them starts) and a fate
    (once one of them fails, the others are dropped: the caller is answered with that error)."""

    deadline: float | None
    started: bool = False
    failed: bool = False

    def expired(self, now: float) -> bool:
        return not self.started and self.deadline is not None and now >= self.deadline


@dataclass(eq=False)
class _Pending(Generic[W]):
    work: W
    tokens: int
    future: asyncio.Future
    ticket: _Ticket
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

    Shaped like Ray Serve's batcher: one consumer (the engine's step), a Future per unit; a cancelled caller's units
    are dropped before they reach the handler. Admission is bounded: at most `max_queued_requests` callers wait at
    once and the next one is refused at once (503 + Retry-After). A batch that raises is retried in halves, so
    only a unit that fails on its own fails its caller (500) and every other caller gets its result. The handler
    runs in `executor` so the event loop (probes, request parsing) stays responsive during a forward pass.
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
        max_queued_requests: int = 1024,
        retry_after_s: int = 1,
        on_batch: Callable[[BatchStats], None] | None = None,
        on_work: Callable[[], None] | None = None,
    ):
        self._handler = handler
        self._tokens_of = tokens_of
        self._executor = executor
        self._max_batch_size = max_batch_size
        self._max_batch_tokens = max_batch_tokens
        self._max_wait_s = max_wait_ms / 1000.0
        self._max_queued_requests = max_queued_requests
        self._retry_after_s = retry_after_s
        self._on_batch = on_batch
        self.on_work = on_work  # told when work is queued (the engine core's wake-up)
        self._queue: asyncio.Queue[_Pending[W]] = asyncio.Queue()
        self._carry: _Pending[W] | None = None  # a unit that did not fit the last batch goes first next time
        self._expected_callers = 1  # callers in the last batch: how many a new batch waits (up to max wait) to hold
        self._inflight: list[_Pending[W]] = []  # the batch being computed (all of it, while its halves are retried)
        self._admitted = 0  # submit() calls not yet answered

    @property
    def running(self) -> int:
        return len(self._inflight)

    @property
    def waiting(self) -> int:
        return self._queue.qsize() + (self._carry is not None)

    @property
    def has_work(self) -> bool:
        """Whether units are queued (some may have been abandoned by their callers since)."""
        return self._carry is not None or not self._queue.empty()

    @property
    def admitted(self) -> int:
        """Requests (submit calls) queued or running now; never more than max_queued_requests."""
        return self._admitted

    # --- callers -------------------------------------------------------------------
    async def submit(self, works: Sequence[W], deadline: float | None = None) -> list[R]:
        """Queue `works` and wait for their results, in order.

        Raises OverloadedError (503) at once when `max_queued_requests` callers are already waiting, and
        DeadlineExceededError (504) when `deadline` (time.monotonic(); default: this request's
        `request_deadline`) passes before any of the units has started. Cancelling the caller drops its
        units that have not started.
        """
        deadline = admit(self._admitted, self._max_queued_requests, self._retry_after_s, "requests", deadline)
        if not works:
            return []
        loop = asyncio.get_running_loop()
        ticket = _Ticket(deadline)
        pending = [_Pending(w, self._tokens_of(w), loop.create_future(), ticket) for w in works]
        futures = [p.future for p in pending]
        self._admitted += 1
        try:
            for p in pending:
                self._queue.put_nowait(p)
            if self.on_work is not None:
                self.on_work()
            _, not_done = await asyncio.wait(futures, timeout=time_left(deadline), return_when=asyncio.FIRST_EXCEPTION)
            if not_done and not any(f.done() and not f.cancelled() and f.exception() is not None for f in futures):
                # The deadline passed. Work that has started runs to the end; work that has not is dropped.
                if not ticket.started:
                    raise deadline_error()
                await asyncio.wait(not_done, return_when=asyncio.FIRST_EXCEPTION)
            return _results_in_order(futures)
        finally:
            self._admitted -= 1
            for f in futures:
                if not f.done():
                    f.cancel()  # the consumer skips cancelled units; a unit being computed finishes unheard

    # --- the consumer (the engine's step) ----------------------------------------------
    async def _next(self, timeout: float) -> _Pending[W] | None:
        if self._carry is not None:
            pending, self._carry = self._carry, None
            return pending
        if not self._queue.empty():
            return self._queue.get_nowait()
        if timeout <= 0:
            return None
        try:
            async with asyncio.timeout(timeout):
                return await self._queue.get()
        except TimeoutError:
            return None

    async def collect(self, max_tokens: int | None = None, must_fit: bool = False) -> list[_Pending[W]] | None:
        """The first live unit queued ([] when none is), then more until size, `max_tokens` (padded tokens, at most
        max_batch_tokens) or max wait closes the batch, or nothing more is queued and the batch holds as many
        callers' units as the last one. The first unit is taken whatever its size, unless `must_fit`: then a first
        unit over `max_tokens` stays first in line and None says it waits for room."""
        max_tokens = min(self._max_batch_tokens, max_tokens or self._max_batch_tokens)
        batch: list[_Pending[W]] = []
        callers: set[int] = set()  # the submit() calls the batch holds units of
        longest = 0
        deadline = None
        while len(batch) < self._max_batch_size:
            if batch:
                # Wait for more only while the batch holds fewer callers than the last one: that many callers have
                # been keeping work in flight and their next requests are on the way. A lone caller (the last batch
                # held only its request, however many units) is not kept waiting max_wait_ms for company that is
                # not coming.
                if len(callers) >= self._expected_callers and self._queue.empty():
                    break
                timeout = max(0.0, deadline - time.perf_counter())
            else:
                timeout = 0.0
            pending = await self._next(timeout)
            if pending is None:
                break
            if _abandoned(pending):  # caller went away (cancelled) or already failed while queued
                continue
            if pending.ticket.expired(time.monotonic()):
                pending.future.set_exception(deadline_error())
                continue
            new_longest = max(longest, pending.tokens)
            if (batch or must_fit) and new_longest * (len(batch) + 1) > max_tokens:
                self._carry = pending
                if not batch:
                    return None
                break
            pending.ticket.started = True
            batch.append(pending)
            callers.add(id(pending.ticket))
            longest = new_longest
            if deadline is None:
                deadline = time.perf_counter() + self._max_wait_s
        if batch:
            self._expected_callers = len(callers)
        return batch

    async def run(self, batch: list[_Pending[W]]) -> None:
        """Compute `batch` on the executor; when it raises, retry each half, so one bad unit (or an out-of-memory
        batch) only fails the units that fail on their own."""
        self._inflight = batch  # fail_all answers these too, should the engine's loop end while they compute
        halves = Halves(batch, _fail_alone, log, "scoring batch", "unit")
        for piece in halves:
            piece = [p for p in piece if not _abandoned(p)]  # callers may have gone while an earlier piece ran
            if not piece:
                continue
            started = time.perf_counter()
            try:
                results = await asyncio.get_running_loop().run_in_executor(
                    self._executor, self._handler, [p.work for p in piece])
                if len(results) != len(piece):
                    raise RuntimeError(f"handler returned {len(results)} results for {len(piece)} units")
            except Exception as exc:  # noqa: BLE001 - every caller in the batch must hear about it
                halves.failed(piece, exc)
                continue
            for p, result in zip(piece, results):
                if not p.future.done():
                    p.future.set_result(result)
            self._report(piece, started)
        self._inflight = []

    def _report(self, batch: list[_Pending[W]], started: float) -> None:
        if self._on_batch is None:
            return
        longest = max(p.tokens for p in batch)
        stats = BatchStats(
            size=len(batch),
            padded_tokens=longest * len(batch),
            queue_wait_s=started - min(p.enqueued_at for p in batch),
            compute_s=time.perf_counter() - started,
        )
        try:
            self._on_batch(stats)
        except Exception:  # noqa: BLE001 - a metrics bug must not end the loop that serves everyone
            log.exception("on_batch callback failed")

    def fail_all(self, error: Exception) -> None:
        """Whatever ended the engine's loop, nobody may wait forever: fail every queued and running caller at once."""
        stranded = self._inflight + ([self._carry] if self._carry else [])
        self._inflight, self._carry = [], None
        while not self._queue.empty():
            stranded.append(self._queue.get_nowait())
        for p in stranded:
            if not p.future.done():
                p.future.set_exception(error)


def _fail_alone(piece: list[_Pending], exc: Exception) -> None:
    """A unit that failed on its own: its caller gets the error (a 500 unless it is an engine error already), and
    the rest of that caller's units are dropped."""
    pending = piece[0]
    pending.ticket.failed = True
    if not pending.future.done():
        pending.future.set_exception(exc if isinstance(exc, EngineError) else EngineError("the model failed on this request"))


def _abandoned(pending: _Pending) -> bool:
    """Whether nobody waits for this unit any more; a unit whose request already failed is cancelled here."""
    if pending.ticket.failed and not pending.future.done():
        pending.future.cancel()
    return pending.future.done()


def _results_in_order(futures: list[asyncio.Future]) -> list:
    """Every future's result, or the first error in submit order (the others' errors are read so asyncio does
    not report them as never retrieved)."""
    errors = [f.exception() for f in futures if f.done() and not f.cancelled()]
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return [f.result() for f in futures]
