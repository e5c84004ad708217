"""Gates a test controls, to set up a scenario by events instead of by timing: hold the scoring batcher's worker or
the generation loop's step, see when it is held, let it go, and record what each batch or step held."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

HOLD_TIMEOUT_S = 120.0  # a held gate opens by itself after this, so a broken test ends instead of hanging


def wait_until(condition: Callable[[], bool], timeout_s: float = 30.0, what: str = "condition") -> None:
    """Poll until `condition()` holds; a bound on waiting, never a measured time."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


async def async_wait_until(condition: Callable[[], bool], timeout_s: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


class _Gate:
    def __init__(self):
        self._open = threading.Event()
        self._open.set()
        self.entered = threading.Event()  # set when a call reached the gate (and may be waiting at it)

    def hold(self) -> None:
        """The next calls stop at the gate until release(); entered is cleared so the test sees the next one."""
        self.entered.clear()
        self._open.clear()

    def release(self) -> None:
        self._open.set()

    def _pass(self) -> None:
        self.entered.set()
        if not self._open.wait(HOLD_TIMEOUT_S):
            raise AssertionError("a gate was held for longer than the test allows")


class BatchGate(_Gate):
    """Wraps a scoring Batcher's handler (the forward pass of one batch, on the worker thread): records the size of
    every batch it is called with, and can hold a batch before it runs."""

    def __init__(self, batcher):
        super().__init__()
        self.sizes: list[int] = []
        self._batcher = batcher
        self._inner = batcher._handler
        batcher._handler = self

    def __call__(self, works):
        self._pass()
        self.sizes.append(len(works))
        return self._inner(works)

    def remove(self) -> None:
        self.release()
        self._batcher._handler = self._inner


@dataclass(frozen=True)
class Step:
    """One step of the generation loop: prompts admitted (prefilled) in it, and rows decoding when it began."""

    admitted: int
    running: int


class StepGate(_Gate):
    """Wraps the generation loop's step (prefill of the admitted prompts + one decode step, on its worker thread):
    records each step and can hold one before it runs."""

    def __init__(self, generator):
        super().__init__()
        self.steps: list[Step] = []
        self._generator = generator
        self._inner = generator._step
        generator._step = self

    def __call__(self, admitted):
        self._pass()
        self.steps.append(Step(len(admitted), self._generator.running))
        return self._inner(admitted)

    def remove(self) -> None:
        self.release()
        del self._generator._step  # back to the class's method


async def join_running_batch(client, generator, gate: StepGate, first: dict, others: list[dict]):
    """POST `first` to /v1/completions and hold the generation loop at its first step; queue `others` behind it;
    let go: they are admitted together while `first` decodes. Returns the task of `first` and the others' tasks."""
    gate.hold()
    head = asyncio.create_task(client.post("/v1/completions", json=first))
    await async_wait_until(gate.entered.is_set, what="the first step to reach the gate")
    rest = [asyncio.create_task(client.post("/v1/completions", json=body)) for body in others]
    await async_wait_until(lambda: generator.waiting == len(others), what="the others to queue")
    gate.release()
    return head, rest
