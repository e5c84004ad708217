"""What every route shares: the ready engine of the app, and a fast JSON response."""

from __future__ import annotations

import orjson
from fastapi import Request
from fastapi.responses import Response

from app.engine import Engine
from app.errors import ServiceUnavailableError


class FastJSONResponse(Response):
    """orjson-encoded body: the score lists are long and the stdlib encoder is the slow part of a response."""

    media_type = "application/json"

    def render(self, content) -> bytes:
        return orjson.dumps(content)


def ready_engine(request: Request) -> Engine:
    """The engine, or 503 while the model loads or warms up. While draining after SIGTERM the engine still
    serves: uvicorn has stopped accepting connections, so every request that gets here was received before."""
    state = request.app.state.lifecycle
    if not state.warmed or state.engine is None or state.failure() is not None:
        raise ServiceUnavailableError(state.not_ready_reason())
    return state.engine
