"""The lifecycle shared by the batcher and the generation loop: one asyncio task running `_loop()`, stoppable, watched."""

from __future__ import annotations

import asyncio


class ConsumerLoop:
    """Runs `self._loop()` as one task named `task_name`; `self._on_loop_exit(task)` hears however it ends."""

    task_name = "genscore-loop"
    _task: asyncio.Task | None = None

    async def _loop(self) -> None:
        raise NotImplementedError

    def _on_loop_exit(self, task: asyncio.Task) -> None:
        raise NotImplementedError

    def start(self) -> None:
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
        return self._task is not None and not self._task.done()
