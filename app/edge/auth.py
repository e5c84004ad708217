"""Access control at the ASGI edge: the optional API key (Authorization: Bearer, constant-time check) and CORS when configured."""

from __future__ import annotations

import hashlib
import hmac

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from app.edge.paths import METRICS_PATH, PROBE_PATHS
from app.edge.responses import error_response
from app.errors import AuthenticationError
from app.settings import Settings


class ApiKeyMiddleware:
    """Every HTTP request outside `public_paths` needs `Authorization: Bearer <api_key>`, else 401.

    The key is compared as SHA-256 digests with hmac.compare_digest: constant time, and equal-length inputs,
    so neither the content nor the length of the key leaks through timing.
    """

    def __init__(self, app: ASGIApp, *, api_key: str, public_paths: frozenset[str]):
        self.app = app
        self._key_digest = hashlib.sha256(api_key.encode()).digest()
        self.public_paths = public_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self._path(scope) in self.public_paths:
            await self.app(scope, receive, send)
            return
        problem = self._problem(scope)
        if problem is not None:
            await error_response(AuthenticationError(problem))(scope, receive, send)
            return
        await self.app(scope, receive, send)

    @staticmethod
    def _path(scope: Scope) -> str:
        path: str = scope["path"]
        root = scope.get("root_path", "")
        return path[len(root):] if root and path.startswith(root) else path

    def _problem(self, scope: Scope) -> str | None:
        """Why the request is refused (never quoting what it sent), or None."""
        header = next((value for name, value in scope["headers"] if name == b"authorization"), None)
        if header is None:
            return "missing API key: send the header `Authorization: Bearer <key>`"
        scheme, _, token = header.partition(b" ")
        if scheme.lower() != b"bearer":
            return "the Authorization header must use the Bearer scheme: `Authorization: Bearer <key>`"
        if not hmac.compare_digest(hashlib.sha256(token.strip()).digest(), self._key_digest):
            return "invalid API key"
        return None


def install_access_control(app: FastAPI, settings: Settings) -> None:
    """Add the API key check and CORS as configured; with neither setting, nothing is added."""
    if settings.api_key is not None:
        public = PROBE_PATHS | ({METRICS_PATH} if settings.public_metrics else set())
        app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key.get_secret_value(), public_paths=public)
    if settings.cors_allow_origins:
        # Added last, so outermost: preflight requests (which carry no credentials) are answered before the
        # key check, and error responses carry the CORS headers a browser needs to read them.
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.cors_allow_origins,
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type", "X-Request-Timeout"],
        )
