"""POST /score: candidate-token logprobs for a query, optionally with items."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from app.api.common import FastJSONResponse, ready_front
from app.api.errors import ROUTE_ERRORS
from app.api.front import Front
from app.api.score import serving
from app.api.score.protocol import ScoreRequest, ScoreResponse

router = APIRouter()


@router.post("/score", response_model=ScoreResponse, responses=ROUTE_ERRORS, response_class=FastJSONResponse)
async def score(request: ScoreRequest, http_request: Request, front: Front = Depends(ready_front)):
    body = await serving.score(front, request)
    http_request.app.state.metrics.observe_usage(body["usage"])
    return FastJSONResponse(body)
