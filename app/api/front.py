"""Front: the API layer's hold on the served model: the engine it submits work to, the input checks and the one
tokenizer thread."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from app.api.inputs import InputChecks
from app.engine.core import Engine


class Front:
    """What the serving code needs beside the engine: every request is checked and tokenized here, then handed to
    `engine` as token ids. Built once per engine by the composition root (app/main.py), closed at shutdown."""

    def __init__(self, engine: Engine):
        self.engine = engine
        loaded, settings = engine.loaded, engine.settings
        self.checks = InputChecks(settings.model_name, loaded.vocab_size, loaded.max_length, settings)
        self.max_prompt_tokens = self.checks.max_prompt_tokens
        # Tokenizing a long text takes seconds; off the event loop so probes and other callers go on.
        # One thread: a fast tokenizer shared by threads can fail with "Already borrowed".
        self._tokenizer_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="genscore-tokenize")

    async def on_tokenizer_thread(self, fn, *args):
        """Run fn(*args) on the one tokenizer thread: long texts stall no one, and the tokenizer is never shared."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, fn, *args)

    def close(self) -> None:
        """Wait for the tokenization in hand, then let the thread go."""
        self._tokenizer_thread.shutdown(wait=True)
