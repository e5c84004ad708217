"""Admission, written once for the scoring queue and the decode loop: a bounded number of waiting callers (503 with
Retry-After beyond it), the request's deadline (504 when it passes before the work has started), and the bisection
for the most work that fits."""

from __future__ import annotations

import time
from collections.abc import Callable

from app.deadline import request_deadline
from app.errors import DeadlineExceededError, OverloadedError


def deadline_error() -> DeadlineExceededError:
    return DeadlineExceededError("the request's deadline passed before its work could start; the server is busy, "
                                 "retry later or allow more time (X-Request-Timeout)", code="deadline_exceeded")


def admit(waiting: int, limit: int, retry_after_s: int, what: str, deadline: float | None = None) -> float | None:
    """Refuse at once when `limit` callers already wait (`what` names them), or when the deadline (default: the
    current request's) has passed; otherwise return that deadline (time.monotonic(), or None for none)."""
    if waiting >= limit:
        raise OverloadedError(f"the server is overloaded: {limit} {what} are already waiting (max_queued_requests); "
                              "retry later", retry_after_s)
    if deadline is None:
        deadline = request_deadline.get()
    if deadline is not None and time.monotonic() >= deadline:
        raise deadline_error()
    return deadline


def time_left(deadline: float | None) -> float | None:
    """Seconds until `deadline` (never negative), or None when there is none."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def most_that_fit(low: int, high: int, fits: Callable[[int], bool]) -> int:
    """The largest n in [low, high] with fits(n), by bisection (fits must be monotone: true up to some n, then
    false); `low` when none above it fits, whether or not `low` itself does (it is the caller's floor)."""
    while low < high:
        mid = (low + high + 1) // 2
        if fits(mid):
            low = mid
        else:
            high = mid - 1
    return low
