"""POST /score: candidate-token logprobs for a query, optionally with items."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from app.engine import Engine
from app.routes.common import FastJSONResponse, ready_engine
from app.schemas import ErrorResponse, ScoreRequest, ScoreResponse

router = APIRouter()

_ERRORS = {code: {"model": ErrorResponse} for code in (400, 404, 500, 503)}


@router.post("/score", response_model=ScoreResponse, responses=_ERRORS, response_class=FastJSONResponse)
async def score(request: ScoreRequest, http_request: Request, engine: Engine = Depends(ready_engine)):
    body = await engine.score(request)
    http_request.app.state.metrics.observe_usage(body["usage"])
    return FastJSONResponse(body)
