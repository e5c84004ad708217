"""The request guard at the ASGI edge: a cap on open requests (503), body size cap (413), the request's deadline, and cancelling the work of a client that disconnected."""

from __future__ import annotations

import asyncio
import math
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.deadline import request_deadline
from app.edge.paths import PROBE_PATHS
from app.edge.responses import error_response
from app.errors import GenscoreError, InvalidRequestError, OverloadedError, PayloadTooLargeError
from app.settings import Settings

TIMEOUT_HEADER = "X-Request-Timeout"
_TIMEOUT_HEADER_KEY = TIMEOUT_HEADER.lower().encode()


class _ClientGone(Exception):
    """The client disconnected before its request body arrived."""


class RequestGuard:
    """Pure ASGI middleware (no BaseHTTPMiddleware: that one runs the app in a task group and breaks streaming).

    1. Counts the HTTP requests in progress and answers 503 + Retry-After beyond `max_open_requests`, before
       reading anything: the batcher bounds the queue, this bounds the requests still being read or validated.
    2. Reads the whole body, counting bytes as they arrive (Content-Length is only used to refuse early: a
       chunked or lying client is caught by the count), and answers 413 naming the limit beyond
       `max_body_bytes`.
    3. Sets the request's deadline (`request_timeout_s`, shortened by an `X-Request-Timeout: <seconds>` header)
       for the batcher, which answers 504 when it passes before the work starts.
    4. Runs the app in its own task and cancels it when the client disconnects, so its queued work is dropped
       before it reaches the model. uvicorn does not do this by itself: it only reports `http.disconnect` to a
       `receive()` that nobody calls while a JSON endpoint waits for the batcher.
    """

    def __init__(self, app: ASGIApp, *, settings: Settings):
        self.app = app
        self.max_body_bytes = settings.max_body_bytes
        self.request_timeout_s = settings.request_timeout_s
        self.max_open_requests = settings.max_open_requests
        self.retry_after_s = settings.retry_after_s
        self.open_requests = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope["path"] in PROBE_PATHS:
            await self._guarded(scope, receive, send)
            return
        if self.open_requests >= self.max_open_requests:
            refusal = OverloadedError(f"the server is overloaded: {self.max_open_requests} requests are already in "
                                      "progress (max_open_requests); retry later", self.retry_after_s)
            await error_response(refusal)(scope, receive, send)
            return
        self.open_requests += 1
        try:
            await self._guarded(scope, receive, send)
        finally:
            self.open_requests -= 1

    async def _guarded(self, scope: Scope, receive: Receive, send: Send) -> None:
        arrived = time.monotonic()
        try:
            deadline = self._deadline(scope, arrived)
            body = await self._read_body(scope, receive)
        except GenscoreError as exc:
            await error_response(exc)(scope, receive, send)
            return
        except _ClientGone:
            return
        await self._run_until_disconnect(scope, receive, send, body, deadline)

    def _deadline(self, scope: Scope, arrived: float) -> float | None:
        timeout = self.request_timeout_s or math.inf
        raw = next((value for name, value in scope["headers"] if name == _TIMEOUT_HEADER_KEY), None)
        if raw is not None:
            try:
                asked = float(raw.decode("latin-1"))
            except ValueError:
                asked = math.nan
            if not (asked > 0 and math.isfinite(asked)):
                raise InvalidRequestError(f"{TIMEOUT_HEADER} must be a positive number of seconds", TIMEOUT_HEADER)
            timeout = min(timeout, asked)  # a client may ask for less time than the server allows, never more
        return None if timeout == math.inf else arrived + timeout

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes:
        limit = self.max_body_bytes
        too_large = PayloadTooLargeError(f"the request body exceeds the limit of {limit} bytes (max_body_bytes)",
                                         code="request_too_large")
        declared = next((value for name, value in scope["headers"] if name == b"content-length"), None)
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise too_large
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _ClientGone
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _run_until_disconnect(self, scope: Scope, receive: Receive, send: Send, body: bytes,
                                    deadline: float | None) -> None:
        disconnected = asyncio.Event()
        response_complete = False
        body_delivered = False

        async def replay_receive() -> Message:
            nonlocal body_delivered
            if not body_delivered:
                body_delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            await disconnected.wait()  # the watcher below owns the real receive()
            return {"type": "http.disconnect"}

        async def tracking_send(message: Message) -> None:
            nonlocal response_complete
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                response_complete = True
            await send(message)

        token = request_deadline.set(deadline)
        try:  # the task copies the context now, deadline included
            handler = asyncio.create_task(self.app(scope, replay_receive, tracking_send))
        finally:
            request_deadline.reset(token)

        async def watch_for_disconnect() -> None:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    disconnected.set()
                    if not response_complete:
                        handler.cancel()
                    return

        watcher = asyncio.create_task(watch_for_disconnect())
        try:
            await handler
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if disconnected.is_set() and current is not None and not current.cancelling():
                return  # the client went away and its work was dropped; there is nobody to answer
            raise
        finally:
            watcher.cancel()
