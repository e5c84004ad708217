"""The one table that maps domain errors and framework errors to HTTP statuses with an OpenAI-shaped body."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.api.protocol import SHAPE_TAG_SUFFIX, ErrorResponse
from app.edge.responses import error_response
from app.errors import GenscoreError, error_body

log = logging.getLogger("genscore.errors")


def error_responses(statuses) -> dict:
    """OpenAPI `responses=` entries: each status answers with the OpenAI-shaped error body."""
    return {status: {"model": ErrorResponse} for status in statuses}


# What a route's own handler can answer: a bad input, an unknown model, a model failure, the engine not ready.
ROUTE_ERRORS = error_responses((400, 404, 500, 503))


def edge_error_responses(with_api_key: bool) -> dict:
    """Error statuses any route can answer (from the middlewares and the batcher), for the OpenAPI schema."""
    return error_responses([413, 503, 504] + ([401] if with_api_key else []))


def _field_name(loc: tuple) -> str | None:
    """('body', 'items', 2, 0) -> 'items[2][0]'; the leading 'body' and pydantic's union branch tags are dropped."""
    name = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            name += f"[{part}]"
        elif isinstance(part, str) and ("[" in part or part in {"str", "int", "list"} or "function-" in part
                                        or part.endswith(SHAPE_TAG_SUFFIX)):
            continue  # union branch labels such as 'list[int]' or a route's request shape ('tei-shape')
        else:
            name += f".{part}" if name else str(part)
    return name or None


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    # With unions (str | list[int]) every branch reports; the deepest location is the real culprit.
    first = max(errors, key=lambda e: len(e.get("loc", ())), default={})
    if first.get("type") == "json_invalid":
        return f"request body is not valid JSON: {first.get('ctx', {}).get('error', 'parse error')}", None
    loc = tuple(first.get("loc", ()))
    param = _field_name(loc)
    msg = first.get("msg", "invalid request")
    if first.get("type") == "extra_forbidden":
        msg = "unknown field"
        # the unknown key is named as sent, even when it looks like a union branch label such as "["
        parent = _field_name(loc[:-1]) if len(loc) > 2 else None
        param = f"{parent}.{loc[-1]}" if parent else str(loc[-1])
    elif first.get("type") == "missing":
        msg = "field required"
    return (f"{param}: {msg}" if param else msg), param


def install_error_handlers(app: FastAPI) -> None:
    """Every error leaves as {"error": {...}}; never a traceback in a body."""

    @app.exception_handler(GenscoreError)
    async def _genscore(_: Request, exc: GenscoreError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return JSONResponse(error_body(message, "invalid_request_error", param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        error_type = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(
            error_body(str(exc.detail), error_type), status_code=exc.status_code, headers=getattr(exc, "headers", None)
        )

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse(error_body("internal server error", "internal_server_error"), status_code=500)
