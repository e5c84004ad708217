"""GET /metrics: the app's Prometheus metrics in the text exposition format."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from app.metrics import CONTENT_TYPE_LATEST

router = APIRouter()


@router.get("/metrics", response_class=Response, responses={200: {
    "content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}},
    "description": "Prometheus text exposition format"}})
async def metrics(request: Request) -> Response:
    """Prometheus scrape endpoint (genscore_* metrics plus process_* and python_info)."""
    return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE_LATEST)
