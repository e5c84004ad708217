"""Domain exceptions and the one table that maps them, and framework errors, to HTTP statuses with an OpenAI-shaped body."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.schemas import ErrorResponse

log = logging.getLogger("genscore.errors")


class GenscoreError(Exception):
    """An error a client should see: HTTP status, OpenAI error type, the offending field."""

    status_code = 400
    error_type = "invalid_request_error"

    def __init__(self, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers  # e.g. Retry-After on 503, WWW-Authenticate on 401


class InvalidRequestError(GenscoreError):
    """The request is well-formed JSON but asks for something we cannot do (bad ids, too long, over a cap)."""


class ModelNotServedError(GenscoreError):
    """The request names a model this server does not serve."""

    status_code = 404
    error_type = "not_found_error"


class ServiceUnavailableError(GenscoreError):
    """Not ready yet, draining, or the batcher is gone."""

    status_code = 503
    error_type = "service_unavailable_error"


class OverloadedError(ServiceUnavailableError):
    """The admission queue is full; the client should retry after `Retry-After` seconds."""

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message, code="overloaded", headers={"Retry-After": str(retry_after_s)})


class DeadlineExceededError(GenscoreError):
    """The request's deadline passed before its work reached the model."""

    status_code = 504
    error_type = "timeout_error"


class PayloadTooLargeError(GenscoreError):
    """The request body is larger than the server accepts."""

    status_code = 413


class AuthenticationError(GenscoreError):
    """Missing or wrong API key (OpenAI answers 401 with code invalid_api_key)."""

    status_code = 401

    def __init__(self, message: str):
        super().__init__(message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


class EngineError(GenscoreError):
    """The forward pass or sampler failed on a batch; the message is generic, the log has the cause."""

    status_code = 500
    error_type = "internal_server_error"


def error_body(message: str, error_type: str, param: str | None = None, code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_response(exc: GenscoreError) -> JSONResponse:
    """The HTTP answer for a domain error; also used by the ASGI middlewares, which sit outside the handlers."""
    return JSONResponse(error_body(exc.message, exc.error_type, exc.param, exc.code), status_code=exc.status_code,
                        headers=exc.headers)


def edge_error_responses(with_api_key: bool) -> dict:
    """Error statuses any route can answer (from the middlewares and the batcher), for the OpenAPI schema."""
    statuses = [413, 503, 504] + ([401] if with_api_key else [])
    return {status: {"model": ErrorResponse} for status in statuses}


def _field_name(loc: tuple) -> str | None:
    """('body', 'items', 2, 0) -> 'items[2][0]'; the leading 'body' and pydantic's union branch tags are dropped."""
    name = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            name += f"[{part}]"
        elif isinstance(part, str) and ("[" in part or part in {"str", "int", "list"} or "function-" in part):
            continue  # union branch labels such as 'list[int]'
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
