"""The HTTP answer for a client-visible error, used by the ASGI middlewares (outside the routes) and the API's handlers."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from app.errors import GenscoreError, error_body


def error_response(exc: GenscoreError) -> JSONResponse:
    return JSONResponse(error_body(exc.message, exc.error_type, exc.param, exc.code), status_code=exc.status_code,
                        headers=exc.headers)
