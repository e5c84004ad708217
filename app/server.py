"""The uvicorn server genscore runs: uvicorn's own signal handling and graceful shutdown, with readiness turned off first."""

from __future__ import annotations

import logging
import signal
from types import FrameType

import uvicorn

log = logging.getLogger("genscore")


class DrainingServer(uvicorn.Server):
    """On SIGTERM/SIGINT, mark the app draining (/ready answers 503 from that instant), then let uvicorn shut down.

    uvicorn's shutdown closes the listening socket, closes idle keep-alive connections,
    waits up to `timeout_graceful_shutdown` for every request already received (queued in
    the batcher or in a forward pass) to be answered, and only then runs the lifespan
    shutdown that stops the batcher. A second SIGINT forces the exit, as in uvicorn.
    """

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        lifecycle = getattr(getattr(self.config.app, "state", None), "lifecycle", None)
        if lifecycle is not None and not lifecycle.draining:
            lifecycle.start_draining()
            # A Python signal handler runs in the main thread between bytecodes; logging's handler lock is
            # re-entrant, so logging here cannot deadlock even if the interrupted code was logging.
            log.info("received %s: readiness is now 503; finishing the requests already received (up to %s s)",
                     signal.Signals(sig).name, self.config.timeout_graceful_shutdown or "unlimited",
                     extra={"request_id": None})  # the handler runs inside whatever request was interrupted
        super().handle_exit(sig, frame)
