"""Kubernetes probes, the model list and the metrics scrape: /health (liveness), /ready (readiness), /v1/models, /metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from app.api.protocol import ModelList
from app.edge.metrics import CONTENT_TYPE_LATEST
from app.errors import error_body

router = APIRouter()


@router.get("/health")
async def health(request: Request):
    """Liveness: the process answers and the engine loop has not died. Cheap: no model call."""
    state = request.app.state.lifecycle
    failure = state.failure()
    if failure is not None:
        return JSONResponse(error_body(failure, "service_unavailable_error"), status_code=503)
    return {"status": "ok"}


@router.get("/ready")
async def ready(request: Request):
    """Readiness: 200 once the model is loaded and warmed up; 503 before that and while draining."""
    state = request.app.state.lifecycle
    if not state.ready:
        return JSONResponse(error_body(state.not_ready_reason(), "service_unavailable_error"), status_code=503)
    return {"status": "ready"}


@router.get("/v1/models", response_model=ModelList)
async def models(request: Request):
    state = request.app.state.lifecycle
    cards = []
    if state.front is not None:
        front = state.front
        cards.append({"id": front.engine.model_name, "object": "model", "created": state.started_at,
                      "owned_by": "genscore", "max_model_len": front.max_prompt_tokens,
                      "fast_paths": front.engine.loaded.plan.as_dict()})
    return {"object": "list", "data": cards}


@router.get("/metrics", response_class=Response, responses={200: {
    "content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}},
    "description": "Prometheus text exposition format"}})
async def metrics(request: Request) -> Response:
    """Prometheus scrape endpoint (genscore_* metrics plus process_* and python_info)."""
    return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE_LATEST)
