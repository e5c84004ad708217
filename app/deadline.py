"""The current request's deadline: set by the edge (per HTTP request), read by the engine when it admits work."""

from __future__ import annotations

from contextvars import ContextVar

request_deadline: ContextVar[float | None] = ContextVar("genscore_request_deadline", default=None)
"""time.monotonic() by which the current request's work must have started; set per HTTP request (app/edge/limits.py)
so every route that submits work gets its deadline without threading it through each call."""
