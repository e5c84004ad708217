"""Logging set-up for the server: one stderr handler for genscore and uvicorn, plain text or one JSON object per line, with the request id."""

from __future__ import annotations

import json
import logging
import sys
import time

from app.edge.observability import request_id_var

_TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# Attributes every LogRecord has; anything else on a record came from `extra=` and goes into the JSON object.
_RECORD_ATTRIBUTES = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}
_DROPPED_EXTRAS = frozenset({"color_message"})  # uvicorn's ANSI-coloured copy of the message


class RequestIdFilter(logging.Filter):
    """Stamp each record with the id of the HTTP request being handled (None outside a request)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):  # `extra={"request_id": None}` says "not about a request"
            record.request_id = request_id_var.get()
        return True


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        request_id = getattr(record, "request_id", None)
        return f"{line} [request_id={request_id}]" if request_id else line


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time (UTC, ISO 8601), level, logger, message, request_id, and `extra=` fields."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _RECORD_ATTRIBUTES and key not in _DROPPED_EXTRAS and key not in entry and value is not None:
                entry[key] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str, ensure_ascii=False)


def configure_logging(level: str, log_format: str = "text") -> None:
    """Route the root logger (genscore.*, uvicorn.*, libraries) to stderr in `log_format` ('text' or 'json')."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter(_TEXT_FORMAT))
    handler.addFilter(RequestIdFilter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    # uvicorn's own logging config (if one was applied in this process) gives its loggers their own
    # handlers; send them through ours instead, so every line has the same format.
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True
        logger.setLevel(logging.NOTSET)  # the root's level, until uvicorn.Config(log_level=...) sets the same one
    # transformers' progress bars and advisory warnings would drown the start-up lines
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
