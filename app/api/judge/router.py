"""POST /v1/judge/pairwise: order-debiased pairwise judgments with a label set."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from app.api.common import FastJSONResponse, ready_front
from app.api.errors import ROUTE_ERRORS
from app.api.front import Front
from app.api.judge.protocol import PairwiseRequest, PairwiseResponse
from app.api.judge.serving import judge_pairwise

router = APIRouter()


@router.post("/v1/judge/pairwise", response_model=PairwiseResponse, responses=ROUTE_ERRORS,
             response_class=FastJSONResponse)
async def pairwise(request: PairwiseRequest, http_request: Request, front: Front = Depends(ready_front)):
    body = await judge_pairwise(front, request)
    http_request.app.state.metrics.observe_usage(body["usage"])
    return FastJSONResponse(body)
