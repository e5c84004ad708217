"""The device thread: the one thread of the process that runs torch work, from loading the model to the last batch."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

DEVICE_THREAD = "genscore-device"  # the name of the one thread that runs model calls


def device_thread() -> ThreadPoolExecutor:
    """A single-thread executor for every torch call: the model's load and self-check, warm-up, every batch and step.

    One thread, not just one at a time: torch's CPU kernels run on an OpenMP thread team of the thread that calls
    them, and GNU OpenMP (the libgomp of the PyPI CPU wheels) keeps a team's threads spinning between parallel
    regions only while it manages no more threads than there are CPUs. A second team (the model loaded on one
    thread and served from another) leaves it spinning ~100 times shorter, so each of a forward's hundreds of short
    kernels waits for its threads to wake: a forward took about twice as long (docs/history/performance.md, "One
    device thread for the whole process").
    """
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix=DEVICE_THREAD)
