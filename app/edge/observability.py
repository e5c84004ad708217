"""The outermost ASGI middleware: a request id on every response (X-Request-ID), HTTP metrics and the access log."""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from contextvars import ContextVar

import orjson
from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.edge.metrics import UNMATCHED_ROUTE, Metrics
from app.edge.paths import METRICS_PATH, PROBE_PATHS
from app.errors import error_body

REQUEST_ID_HEADER = "X-Request-ID"
request_id_var: ContextVar[str | None] = ContextVar("genscore_request_id", default=None)
"""The id of the request being handled; log records carry it (app.logs.RequestIdFilter)."""

access_log = logging.getLogger("genscore.access")

# A caller's id is echoed into headers and logs: accept only short, plain tokens (no spaces, quotes or newlines).
_VALID_REQUEST_ID = re.compile(r"[A-Za-z0-9._:/+=@-]{1,128}")
# The kubelet probes every few seconds, and Prometheus scrapes as often: their lines are DEBUG only. A failing
# probe too (503 while loading or draining): the server logs those changes of state once, at INFO or ERROR.
# A failing scrape (401 with --no-public-metrics) is not logged elsewhere, so it stays at INFO.
_CLIENT_CLOSED = 499  # nginx's code for "the client went away"; the status label when no response was sent


async def _try_send_shutdown_503(send: Send) -> bool:
    """Answer 503 to a request cancelled by the shutdown; False when it could not be sent."""
    body = orjson.dumps(error_body("the server shut down before this request could be served; retry it",
                                   "service_unavailable_error"))
    try:
        await send({"type": "http.response.start", "status": 503,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()), (b"retry-after", b"1")]})
        await send({"type": "http.response.body", "body": body})
    except Exception:  # noqa: BLE001 - the client is gone: nothing more to tell it
        return False
    return True


def request_id_from(scope: Scope) -> str:
    """The caller's X-Request-ID when it is a plain token, else a fresh one."""
    for name, value in scope.get("headers", ()):
        if name == b"x-request-id":
            candidate = value.decode("latin-1")
            if _VALID_REQUEST_ID.fullmatch(candidate):
                return candidate
            break
    return uuid.uuid4().hex


class ObservabilityMiddleware:
    """Pure ASGI (not BaseHTTPMiddleware), so streamed responses are timed to their last byte and
    the request id's context variable reaches the route and everything it awaits."""

    def __init__(self, app: ASGIApp, metrics: Metrics, access_log_enabled: bool = True):
        self.app = app
        self.metrics = metrics
        self.access_log_enabled = access_log_enabled

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        request_id = request_id_from(scope)
        scope.setdefault("state", {})["request_id"] = request_id
        token = request_id_var.set(request_id)
        method = Metrics.method_label(scope["method"])
        in_progress = self.metrics.http_in_progress
        in_progress.inc()
        status = 0

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                MutableHeaders(scope=message)[REQUEST_ID_HEADER] = request_id
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except asyncio.CancelledError:
            # uvicorn cancels the requests still running when its graceful-shutdown timeout
            # (drain_timeout_s) runs out, and would answer a bare 500: say 503, so clients retry elsewhere.
            # Once the response has started, or if the connection is gone, the cancel goes on as it came.
            if status or not await _try_send_shutdown_503(send_with_id):
                raise
            task = asyncio.current_task()
            if task is not None and hasattr(task, "uncancel"):  # Python >= 3.11: the cancel is handled here
                task.uncancel()
        except Exception:
            status = status or 500  # Starlette's ServerErrorMiddleware has already answered 500 and re-raises
            raise
        finally:
            in_progress.dec()
            route_obj = scope.get("route")
            route = getattr(route_obj, "path", None) or UNMATCHED_ROUTE
            elapsed = time.perf_counter() - started
            self.metrics.http_requests.labels(route=route, method=method, status=str(status or _CLIENT_CLOSED)).inc()
            self.metrics.http_latency.labels(route=route, method=method).observe(elapsed)
            if self.access_log_enabled:
                self._log(scope, route, status or _CLIENT_CLOSED, elapsed, request_id)
            request_id_var.reset(token)

    @staticmethod
    def _log(scope: Scope, route: str, status: int, elapsed: float, request_id: str) -> None:
        quiet = route in PROBE_PATHS or (route == METRICS_PATH and status < 400)
        level = logging.DEBUG if quiet else logging.INFO
        if not access_log.isEnabledFor(level):
            return
        client = scope.get("client")
        client_addr = f"{client[0]}:{client[1]}" if client else "-"
        path = scope.get("path", "")
        fields = {
            "client": client_addr,
            "method": scope["method"],
            "path": path,
            "route": route,
            "status": status,
            "duration_ms": round(elapsed * 1000, 3),
            "http_version": scope.get("http_version", "1.1"),
        }
        access_log.log(
            level,
            '%s "%s %s HTTP/%s" %d %.1f ms',
            client_addr, scope["method"], path, fields["http_version"], status, elapsed * 1000,
            extra={"http": fields, "request_id": request_id},
        )
