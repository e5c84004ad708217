"""`genscore run-batch`: an OpenAI Batch JSONL file through the app in-process (the same routes, validation, batching
and engine as the server, over an in-memory ASGI transport instead of sockets), streamed, resumable and sharded."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
import uuid
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
from tqdm import tqdm

from app.settings import Settings
from models import LoadedModel

log = logging.getLogger("genscore.batch")

URLS = ("/v1/completions", "/v1/chat/completions", "/score", "/v1/rerank", "/v1/judge/pairwise")
FLUSH_EVERY_S = 1.0
LOG_EVERY_S = 10.0


class BatchInputError(RuntimeError):
    """The run cannot start: unreadable input, or an output that --resume cannot continue."""


@dataclass(frozen=True)
class BatchOptions:
    """What to read, where to write, which lines are this process's, how many requests may be in flight."""

    input: Path
    output: Path
    resume: bool = False
    shard: int = 0
    shards: int = 1
    concurrency: int = 64


def parse_shard(value: str) -> tuple[int, int]:
    """`i/N` -> (i, N) with 0 <= i < N."""
    try:
        index, count = (int(part) for part in value.split("/"))
    except ValueError:
        raise ValueError(f"--shard must look like i/N (e.g. 0/4), got {value!r}") from None
    if not 0 <= index < count:
        raise ValueError(f"--shard {value}: need 0 <= i < N")
    return index, count


def _shard_lines(options: BatchOptions) -> Iterator[str]:
    """This shard's input lines (every N-th, blank lines included so numbering is stable), read as they are needed."""
    with options.input.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines):
            if number % options.shards == options.shard:
                yield line


def _done_lines(options: BatchOptions) -> int:
    """With --resume: how many complete lines the output holds; a torn last line (a kill mid-write) is cut off."""
    if not options.output.exists() or options.output.stat().st_size == 0:
        return 0
    if not options.resume:
        raise BatchInputError(f"{options.output} already exists: pass --resume to continue it, or remove it")
    lines, end = 0, 0  # complete lines, and the offset just past the last one
    with options.output.open("r+b") as out:
        offset = 0
        while chunk := out.read(1 << 20):  # in pieces: the output may be larger than memory
            lines += chunk.count(b"\n")
            if (last := chunk.rfind(b"\n")) >= 0:
                end = offset + last + 1
            offset += len(chunk)
        if end != offset:
            out.truncate(end)
    return lines


def _check_resumable(options: BatchOptions, done: int) -> None:
    """The output's last line must answer this shard's line number `done`: else it belongs to another input."""
    if done == 0:
        return
    with options.output.open(encoding="utf-8") as out:
        last = deque(out, maxlen=1)[0]
    expected = next((line for i, line in enumerate(_shard_lines(options)) if i == done - 1), None)
    try:
        want = json.loads(expected).get("custom_id") if expected else None
    except ValueError:
        want = None
    got = json.loads(last).get("custom_id")
    if expected is None or got != want:
        raise BatchInputError(f"{options.output} does not continue {options.input} (shard {options.shard}/"
                              f"{options.shards}): its line {done} is custom_id {got!r}, the input's is {want!r}")


def _error_line(custom_id, code: str, message: str) -> dict:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}


async def _answer(client: httpx.AsyncClient, number: int, line: str) -> dict:
    """One input line -> its output line: the route's answer, or an error line saying what is wrong with it."""
    try:
        request = json.loads(line)
        if not isinstance(request, dict):
            raise ValueError("a line must be a JSON object")
    except ValueError as exc:
        return _error_line(None, "invalid_json", f"input line {number + 1}: {exc}")
    custom_id = request.get("custom_id")
    if request.get("method", "POST") != "POST":
        return _error_line(custom_id, "invalid_method", f"method must be POST, got {request.get('method')!r}")
    if request.get("url") not in URLS:
        return _error_line(custom_id, "invalid_url", f"url must be one of {list(URLS)}, got {request.get('url')!r}")
    if not isinstance(request.get("body"), dict):
        return _error_line(custom_id, "invalid_request", "body must be a JSON object")
    if request["body"].get("stream"):
        return _error_line(custom_id, "invalid_request", "stream is not available in a batch")
    response = await client.post(request["url"], json=request["body"])
    try:
        body = response.json()
    except ValueError:
        body = {"error": {"message": response.text, "type": "server_error", "param": None, "code": None}}
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
            "response": {"status_code": response.status_code, "request_id": response.headers.get("x-request-id"),
                         "body": body},
            "error": None}


class _Progress:
    """done/total, rows/s and ETA: a tqdm bar on a terminal, a log line every LOG_EVERY_S otherwise."""

    def __init__(self, total: int, done: int):
        self.total, self.done, self.started, self.logged = total, done, time.monotonic(), time.monotonic()
        self.first = done
        self.bar = tqdm(total=total, initial=done, unit="row", file=sys.stderr) if sys.stderr.isatty() else None

    def step(self) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update()
            return
        now = time.monotonic()
        if now - self.logged >= LOG_EVERY_S or self.done == self.total:
            self.logged = now
            rate = (self.done - self.first) / max(now - self.started, 1e-9)
            eta = (self.total - self.done) / rate if rate else float("inf")
            log.info("run-batch: %d/%d rows, %.1f rows/s, ETA %.0f s", self.done, self.total, rate, eta)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


async def _wait_ready(app) -> None:
    state = app.state.lifecycle
    while not state.ready:
        if state.load_error is not None:
            raise RuntimeError(state.load_error)
        await asyncio.sleep(0.05)


async def run_batch(settings: Settings, options: BatchOptions, loaded: LoadedModel | None = None) -> dict:
    """Answer every line of this shard not yet in the output, in input order; returns counts of what was written.

    At most `concurrency` requests are in flight (they batch in the engine as concurrent callers do), and
    answers are written in input order as soon as the oldest is done, so memory stays bounded by the window
    whatever the file size, and the output's line k always answers the shard's input line k (what --resume
    relies on). Each line is one write; the file is flushed at least every FLUSH_EVERY_S.
    """
    from app.main import create_app

    if not options.input.is_file():
        raise BatchInputError(f"input file not found: {options.input}")
    total = sum(1 for _ in _shard_lines(options))
    done = _done_lines(options)
    _check_resumable(options, done)
    if done:
        log.info("resuming: %d of %d rows of this shard are already in %s", done, total, options.output)
    app = create_app(settings, loaded=loaded)
    counts = {"written": 0, "skipped": done, "errors": 0}
    async with app.router.lifespan_context(app):
        await _wait_ready(app)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://genscore", timeout=None) as client:
            progress = _Progress(total, done)
            in_flight: deque[asyncio.Task] = deque()
            flushed = time.monotonic()
            with options.output.open("a", encoding="utf-8") as out:

                async def write_oldest() -> None:
                    nonlocal flushed
                    answer = await in_flight.popleft()
                    out.write(json.dumps(answer, ensure_ascii=False) + "\n")
                    counts["written"] += 1
                    status = (answer["response"] or {}).get("status_code", 0)
                    counts["errors"] += answer["error"] is not None or status >= 400
                    progress.step()
                    if time.monotonic() - flushed >= FLUSH_EVERY_S:
                        out.flush()
                        flushed = time.monotonic()

                try:
                    for number, line in enumerate(_shard_lines(options)):
                        if number < done:
                            continue
                        in_flight.append(asyncio.create_task(_answer(client, number, line)))
                        while len(in_flight) >= options.concurrency or (in_flight and in_flight[0].done()):
                            await write_oldest()
                    while in_flight:
                        await write_oldest()
                finally:
                    for task in in_flight:
                        task.cancel()
                    out.flush()
                    progress.close()
    return counts
