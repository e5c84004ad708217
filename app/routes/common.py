"""What every route shares: the ready engine of the app, and a fast JSON response."""

from __future__ import annotations

import orjson
from fastapi import Request
from fastapi.responses import JSONResponse

from app.engine import Engine
from app.errors import ServiceUnavailableError


class FastJSONResponse(JSONResponse):
    """orjson-encoded body: the score lists are long and the stdlib encoder is the slow part of a response.

    A JSONResponse subclass, so the OpenAPI schema documents the route's response model (for any other
    Response class FastAPI documents the body as a bare string, and schemathesis rightly flags every 200)."""

    def render(self, content) -> bytes:
        return orjson.dumps(content)


def ready_engine(request: Request) -> Engine:
    """The engine, or 503 while the model loads or warms up. While draining after SIGTERM the engine still
    serves: uvicorn has stopped accepting connections, so every request that gets here was received before."""
    state = request.app.state.lifecycle
    if not state.warmed or state.engine is None or state.failure() is not None:
        raise ServiceUnavailableError(state.not_ready_reason())
    return state.engine
