"""The composition root: create_app wires settings, the model, the engine core, the API routes and the edge
stack; its lifespan loads the model off the event loop, starts and warms the engine, and drains and stops it."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI

from app.api.compat import sglang, vllm
from app.api.errors import edge_error_responses, install_error_handlers
from app.api.front import Front
from app.api.health import router as health
from app.api.judge import router as judge
from app.api.openai import router as openai
from app.api.rerank import router as rerank
from app.api.rerank.formats import RerankFormatError, RerankPrompts, resolve_format
from app.api.score import router as score
from app.api.tokenize import router as tokenize
from app.edge.auth import install_access_control
from app.edge.limits import RequestGuard
from app.edge.metrics import Metrics
from app.edge.observability import ObservabilityMiddleware
from app.engine.core import Engine, set_torch_threads
from app.engine.device import DEVICE_THREAD, device_thread
from app.settings import Settings
from models import LoadedModel, load_model

log = logging.getLogger("genscore")

__all__ = ["DEVICE_THREAD", "Lifecycle", "create_app"]


@dataclass
class Lifecycle:
    """Where the server is in its life; the probes read this and nothing else."""

    engine: Engine | None = None
    front: Front | None = None  # the API layer's hold on the engine (checks, tokenizer thread); set with it
    ready: bool = False
    warmed: bool = False  # stays True while draining: requests received before SIGTERM are still served
    draining: bool = False
    load_error: str | None = None
    started_at: int = field(default_factory=lambda: int(time.time()))

    def failure(self) -> str | None:
        """Why this process can never serve again (liveness fails), or None."""
        if self.load_error is not None:
            return self.load_error
        if self.engine is not None and not self.engine.alive and not self.draining:
            return "the engine loop (scoring batcher and generation) died"
        return None

    @property
    def generator(self):
        """The engine's generator (tests and the probes' callers reach it through here)."""
        return self.engine.generator if self.engine is not None else None

    def start_draining(self) -> None:
        """SIGTERM (app/server.py) or shutdown: readiness fails from now on; work already received goes on."""
        self.draining = True
        self.ready = False

    def not_ready_reason(self) -> str:
        failure = self.failure()
        if failure:
            return failure
        if self.draining:
            return "the server is shutting down"
        if self.engine is None:
            return "the model is loading"
        return "the model is warming up"


def create_app(
    settings: Settings,
    loaded: LoadedModel | None = None,
    on_fatal: Callable[[str], None] | None = None,
) -> FastAPI:
    """Build the app. `loaded` skips loading (tests share one model); `on_fatal` is told when loading fails."""
    state = Lifecycle()
    metrics_registry = Metrics(
        queue_counts=lambda: (state.engine.batcher.waiting, state.engine.batcher.running) if state.engine else None,
        prefix_cache_stats=lambda: state.engine.prefix_cache.stats if state.engine else None,
        generation_counts=lambda: (state.generator.waiting, state.generator.running) if state.engine else None,
        engine_counts=lambda: state.engine.work_counts if state.engine else None,
    )
    # the engine (with its Front) while it warms up, so shutdown stops it even before it is ready
    starting: list[Front] = []

    async def bring_up(device: ThreadPoolExecutor) -> None:
        try:
            set_torch_threads(settings)
            model = loaded
            if model is None:
                log.info("loading model %s (device=%s, dtype=%s)", settings.model, settings.device, settings.dtype)
                model = await asyncio.get_running_loop().run_in_executor(device, functools.partial(
                    load_model, settings.model, settings.device, settings.dtype, settings.cache_dir,
                    batch_invariant=settings.batch_invariant, compile=settings.compile,
                ))
            dtype_name = str(model.dtype).removeprefix("torch.")
            log.info("loaded %s on %s as %s in %.1f s (vocab %d, max length %d)", settings.model, model.device,
                     dtype_name, model.load_seconds, model.vocab_size, model.max_length)
            metrics_registry.set_model(settings.model_name, str(model.device), dtype_name, model.load_seconds)
            engine = Engine(model, settings, on_batch=metrics_registry.observe_batch,
                            on_tokens=metrics_registry.observe_generation, device=device)
            front = Front(engine)
            starting.append(front)
            try:
                app.state.rerank = RerankPrompts.bind(resolve_format(settings.rerank_format, model.tokenizer),
                                                      model.tokenizer)
            except RerankFormatError as exc:  # the other routes serve on; the rerank routes say why they cannot
                app.state.rerank = str(exc)
                log.warning("reranking unavailable: %s", exc)
            started = time.perf_counter()
            engine.start()
            await engine.warm_up()
            state.engine, state.front = engine, front
            state.warmed = True
            state.ready = not state.draining
            log.info("ready (warm-up %.2f s)", time.perf_counter() - started)
        except Exception as exc:  # noqa: BLE001 - a failed load must be reported, not swallowed by the task
            state.load_error = f"model load failed: {exc}"
            log.error("%s", state.load_error, exc_info=not isinstance(exc, OSError))
            if on_fatal is not None:
                on_fatal(state.load_error)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        # The model loads on the thread that then serves it (app/engine/device.py says why).
        device = device_thread()
        bring_up_task = asyncio.create_task(bring_up(device), name="genscore-bring-up")
        try:
            yield
        finally:
            state.start_draining()
            bring_up_task.cancel()
            for front in starting:
                await front.engine.stop()
                front.close()
            device.shutdown(wait=False)  # a load still running finishes on its own; nothing waits for it

    app = FastAPI(
        title="genscore",
        version="0.1.0",
        description="Generative scoring: the logprob of candidate tokens after a prompt, from a causal LM.",
        lifespan=lifespan,
        responses=edge_error_responses(with_api_key=settings.api_key is not None),
    )
    app.state.lifecycle = state
    app.state.rerank = "the model is loading"  # RerankPrompts once loaded, or why reranking is unavailable
    app.state.settings = settings
    app.state.metrics = metrics_registry
    install_error_handlers(app)
    # Body cap, deadline and disconnect handling innermost, then the API key, then CORS.
    app.add_middleware(RequestGuard, settings=settings)
    install_access_control(app, settings)
    # Outermost (added last): every response, errors included, gets its request id and is counted and logged.
    app.add_middleware(ObservabilityMiddleware, metrics=metrics_registry, access_log_enabled=settings.access_log)
    for routes in (health, score, openai, tokenize, sglang, vllm, rerank, judge):
        app.include_router(routes.router)
    return app
