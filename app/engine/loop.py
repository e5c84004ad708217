"""The lifecycle of a consumer loop (the scoring batcher, the decode loop, the engine core that drives both): one
asyncio task, stoppable, watched; a loop driven by another is alive exactly while its driver is."""

from __future__ import annotations

import asyncio


class ConsumerLoop:
    """Runs `self._loop()` as one task named `task_name`; `self._on_loop_exit(task)` hears however it ends.

    `drive_by(other)` hands the scheduling to `other` (the engine core), which then calls this loop's steps itself;
    this loop's own task is never started."""

    task_name = "genscore-loop"
    _task: asyncio.Task | None = None
    _driver: ConsumerLoop | None = None

    async def _loop(self) -> None:
        raise NotImplementedError

    def _on_loop_exit(self, task: asyncio.Task) -> None:
        raise NotImplementedError

    def drive_by(self, driver: ConsumerLoop) -> None:
        self._driver = driver

    def start(self) -> None:
        if self._driver is not None:
            raise RuntimeError(f"{self.task_name} is driven by {self._driver.task_name}; start that instead")
        self._task = asyncio.get_running_loop().create_task(self._loop(), name=self.task_name)
        self._task.add_done_callback(self._on_loop_exit)

    async def stop(self) -> None:
        # A loop that already died was reported by _on_loop_exit; stopping it must not raise its error again.
        if self._task is not None and not self._task.done():
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    @property
    def alive(self) -> bool:
        if self._driver is not None:
            return self._driver.alive
        return self._task is not None and not self._task.done()
