"""What every route shares: the served model's Front (ready, or loaded), a fast JSON response, and how numbers go
on the wire."""

from __future__ import annotations

import math

import orjson
from fastapi import Request
from fastapi.responses import JSONResponse

from app.api.front import Front
from app.errors import ServiceUnavailableError

NEG_INF_JSON = -9999.0  # JSON has no -inf; this stands for it everywhere


def finite(value: float) -> float:
    return NEG_INF_JSON if value == -math.inf else value


def softmax_over(values: list[float]) -> list[float]:
    """Softmax over a short list; labels all at -inf have no distribution and get 0.0 each."""
    top = max(values)
    if top == -math.inf:
        return [0.0] * len(values)
    exps = [math.exp(v - top) for v in values]
    total = sum(exps)
    return [e / total for e in exps]


def usage(prompt_tokens: int, cached_tokens: int) -> dict:
    """OpenAI-style usage of a scoring request; cached_tokens counts prompt tokens whose key/value states were
    reused, not recomputed."""
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class FastJSONResponse(JSONResponse):
    """orjson-encoded body: the score lists are long and the stdlib encoder is the slow part of a response.

    A JSONResponse subclass, so the OpenAPI schema documents the route's response model (for any other
    Response class FastAPI documents the body as a bare string, and schemathesis rightly flags every 200)."""

    def render(self, content) -> bytes:
        return orjson.dumps(content)


async def ready_front(request: Request) -> Front:
    """The served model's Front, or 503 while the model loads or warms up. While draining after SIGTERM it still
    serves: uvicorn has stopped accepting connections, so every request that gets here was received before.

    The dependencies here are coroutines so that FastAPI runs them on the event loop: a plain function would be
    sent to its thread pool and back on every request."""
    state = request.app.state.lifecycle
    if not state.warmed or state.front is None or state.failure() is not None:
        raise ServiceUnavailableError(state.not_ready_reason())
    return state.front


async def loaded_front(request: Request) -> Front:
    """The Front for routes that need only the model's tokenizer and facts, not the engine's loop: 503 until it is
    warmed up, and then served even if the engine's loop has died."""
    state = request.app.state.lifecycle
    if not state.warmed or state.front is None:
        raise ServiceUnavailableError(state.not_ready_reason())
    return state.front
