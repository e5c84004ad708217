"""Prometheus metrics (genscore_*): one registry per app, fed by the HTTP middleware, the batcher's on_batch hook and the routes' usage."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

__all__ = ["CONTENT_TYPE_LATEST", "Metrics", "UNMATCHED_ROUTE"]


class BatchFacts(Protocol):
    """What the metrics read of one forward pass (the engine's BatchStats has these fields)."""

    size: int
    padded_tokens: int
    queue_wait_s: float
    compute_s: float


UNMATCHED_ROUTE = "unmatched"  # route label of requests no route matched (404s): raw paths would be unbounded
_METHODS = frozenset({"GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"})

# Seconds: a tiny-model request takes ~1 ms, a large CPU batch tens of seconds.
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# The batcher's max_wait_ms is a few ms by default; long waits mean a backlog.
_QUEUE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
_BATCH_TOKEN_BUCKETS = (16, 64, 256, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


class _QueueCollector(Collector):
    """A queue's (waiting, running) counts as two gauges, read at scrape time: nothing to keep in step, and always
    the current engine's. One for the scoring batcher, one for the generation loop (the HPA can see either backlog)."""

    def __init__(self, read: Callable[[], tuple[int, int] | None], waiting: tuple[str, str], running: tuple[str, str]):
        self._read = read
        self._waiting, self._running = waiting, running  # (name, help) of each gauge

    def collect(self):
        counts = self._read()
        waiting, running = counts if counts is not None else (0, 0)
        yield GaugeMetricFamily(*self._waiting, value=waiting)
        yield GaugeMetricFamily(*self._running, value=running)


class _PrefixCacheCollector(Collector):
    """The shared-prefix cache's counters (models/prefix_cache.py PrefixCacheStats), read at scrape time."""

    def __init__(self, read: Callable[[], object | None]):
        self._read = read

    def collect(self):
        stats = self._read()
        hits, misses, evictions, entries, size = (
            (stats.hits, stats.misses, stats.evictions, stats.entries, stats.bytes) if stats is not None else (0,) * 5
        )
        yield CounterMetricFamily("genscore_prefix_cache_hits", "Shared prefixes found in the prefix cache.",
                                  value=hits)
        yield CounterMetricFamily("genscore_prefix_cache_misses", "Shared prefixes computed (not in the cache).",
                                  value=misses)
        yield CounterMetricFamily("genscore_prefix_cache_evictions", "Prefixes dropped to stay within the cache size.",
                                  value=evictions)
        yield GaugeMetricFamily("genscore_prefix_cache_entries", "Prefixes held in the prefix cache.", value=entries)
        yield GaugeMetricFamily("genscore_prefix_cache_bytes", "Bytes of key/value states held in the prefix cache.",
                                value=size)


class Metrics:
    """Every genscore metric, on its own registry so that several apps in one process (tests) never collide."""

    def __init__(self, queue_counts: Callable[[], tuple[int, int] | None] = lambda: None,
                 prefix_cache_stats: Callable[[], object | None] = lambda: None,
                 generation_counts: Callable[[], tuple[int, int] | None] = lambda: None,
                 engine_counts: Callable[[], tuple[int, int] | None] = lambda: None):
        """`queue_counts` returns (waiting, running) of the batcher, `prefix_cache_stats` the engine's
        PrefixCacheStats, `generation_counts` (waiting, running) of the generation loop, `engine_counts` the two
        together (what the engine's one loop has before it); each None before the engine exists."""
        # No `*_created` series: they double the output and no dashboard reads them (a process-wide switch).
        disable_created_metrics()
        self.registry = CollectorRegistry(auto_describe=True)
        registry = self.registry
        ProcessCollector(registry=registry)  # process_cpu_seconds_total, process_resident_memory_bytes, ...
        PlatformCollector(registry=registry)  # python_info
        self.http_requests = Counter(
            "genscore_http_requests", "HTTP requests answered, by route template, method and status code.",
            ["route", "method", "status"], registry=registry,
        )
        self.http_latency = Histogram(
            "genscore_http_request_duration_seconds",
            "End-to-end time from the request's arrival to the last byte of its response.",
            ["route", "method"], buckets=_LATENCY_BUCKETS, registry=registry,
        )
        self.http_in_progress = Gauge(
            "genscore_http_requests_in_progress",
            "HTTP requests received and not yet answered (a scrape counts itself; the route is not known yet on arrival).",
            registry=registry,
        )
        self.queue_wait = Histogram(
            "genscore_queue_wait_seconds",
            "Per batch: how long its longest-waiting sequence was queued before the forward pass started.",
            buckets=_QUEUE_BUCKETS, registry=registry,
        )
        self.forward_time = Histogram(
            "genscore_forward_seconds", "Per batch: time of the forward pass and the sampler.",
            buckets=_LATENCY_BUCKETS, registry=registry,
        )
        self.batch_size = Histogram(
            "genscore_batch_size", "Sequences per forward pass.", buckets=_BATCH_SIZE_BUCKETS, registry=registry,
        )
        self.batch_padded_tokens = Histogram(
            "genscore_batch_padded_tokens", "Tokens per forward pass, padding included (sequences x longest).",
            buckets=_BATCH_TOKEN_BUCKETS, registry=registry,
        )
        self.prompt_tokens = Counter(
            "genscore_prompt_tokens", "Prompt tokens run through the model for answered requests.", registry=registry,
        )
        self.generation_tokens = Counter(
            "genscore_generation_tokens", "Tokens generated for callers (completions and chat).", registry=registry,
        )
        self.model_info = Gauge(
            "genscore_model_info", "The served model (value 1 once loaded).",
            ["model", "device", "dtype"], registry=registry,
        )
        self.model_load_seconds = Gauge(
            "genscore_model_load_seconds", "How long loading the model took at start-up.", registry=registry,
        )
        self.cached_prompt_tokens = Counter(
            "genscore_prompt_tokens_cached",
            "Prompt tokens whose key/value states were reused from a shared prefix instead of computed.",
            registry=registry,
        )
        registry.register(_QueueCollector(
            queue_counts,
            ("genscore_requests_waiting",
             "Sequences (one per prompt: the query, or query + item) queued for a forward pass."),
            ("genscore_requests_running", "Sequences of the batch handed to the device thread: being computed, or next "
             "in line behind the device's current job.")))
        registry.register(_QueueCollector(
            generation_counts,
            ("genscore_generation_waiting", "Prompts waiting for a place in the generation loop's decode batch."),
            ("genscore_generation_running", "Choices decoding in the generation loop now.")))
        registry.register(_QueueCollector(
            engine_counts,
            ("genscore_engine_waiting", "Work waiting for the engine's one device thread: scoring sequences plus "
             "prompts waiting to generate (the autoscaler's backlog signal)."),
            ("genscore_engine_running", "Work on the device now: scoring sequences plus decoding choices.")))
        registry.register(_PrefixCacheCollector(prefix_cache_stats))

    # --- feeders -------------------------------------------------------------------
    def observe_batch(self, stats: BatchFacts) -> None:
        """The batcher's on_batch hook: one call per forward pass."""
        self.batch_size.observe(stats.size)
        self.batch_padded_tokens.observe(stats.padded_tokens)
        self.queue_wait.observe(stats.queue_wait_s)
        self.forward_time.observe(stats.compute_s)

    def observe_usage(self, usage: dict) -> None:
        """Count an answered request's OpenAI-shaped `usage` (prompt_tokens, and completion_tokens when generating)."""
        self.prompt_tokens.inc(usage.get("prompt_tokens") or 0)
        self.cached_prompt_tokens.inc((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        self.generation_tokens.inc(usage.get("completion_tokens") or 0)

    def observe_generation(self, prompt_tokens: int, generated_tokens: int) -> None:
        """The generation loop's hook: the tokens one step prefilled and generated for callers."""
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generated_tokens)

    def set_model(self, model: str, device: str, dtype: str, load_seconds: float) -> None:
        self.model_info.labels(model=model, device=device, dtype=dtype).set(1)
        self.model_load_seconds.set(load_seconds)

    @staticmethod
    def method_label(method: str) -> str:
        return method if method in _METHODS else "other"

    def render(self) -> bytes:
        return generate_latest(self.registry)
