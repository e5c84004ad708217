"""The errors a client can see: one exception per kind, each with its HTTP status and OpenAI error type, and the error body."""

from __future__ import annotations


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
