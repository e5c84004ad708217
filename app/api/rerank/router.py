"""POST /v1/rerank, /rerank (Jina/vLLM shape, or Text Embeddings Inference's when the body has `texts`) and /v2/rerank
(Cohere v2 shape): generative reranking, each document scored as p(yes) / (p(yes) + p(no)) after the configured
prompt, the documents (and the windows of long ones) batched over their shared prefix."""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Depends, Request

from app.api.common import FastJSONResponse, ready_front
from app.api.errors import ROUTE_ERRORS
from app.api.front import Front
from app.api.rerank.formats import RerankPrompts
from app.api.rerank.protocol import (
    AnyRerankRequest,
    CohereRerankResponse,
    JinaRerankResponse,
    RerankRequest,
    TeiRank,
    TeiRerankRequest,
)
from app.api.rerank.serving import RerankJob, rank, window_fields
from app.errors import InvalidRequestError

router = APIRouter()


def _prompts(http_request: Request) -> RerankPrompts:
    prompts = http_request.app.state.rerank
    if isinstance(prompts, str):  # the configured format cannot be used with this model: say why
        raise InvalidRequestError(f"reranking is not available on this server: {prompts}")
    return prompts


async def rerank(request: RerankRequest, http_request: Request, front: Front) -> tuple[list[dict], dict]:
    """Ranked results (best first, cut to top_n) and the usage of one Cohere/Jina-shaped request."""
    if request.top_n is not None and request.top_n < 1:
        raise InvalidRequestError(f"top_n must be at least 1, got {request.top_n}", "top_n")
    texts = [doc if isinstance(doc, str) else doc.text for doc in request.documents]
    job = RerankJob(request.model, request.query, texts, "documents", request.instruction, request.max_tokens_per_doc,
                    request.truncate, False, request)
    scores, counts = await rank(front, _prompts(http_request), job)
    results = []
    for score in scores[: request.top_n]:
        result = {"index": score.index, "relevance_score": score.relevance}
        if request.return_documents:
            result["document"] = {"text": texts[score.index]}
        results.append({**result, **window_fields(score)})
    http_request.app.state.metrics.observe_usage(counts)
    return results, counts


async def rerank_tei(request: TeiRerankRequest, http_request: Request, front: Front) -> list[dict]:
    """Text Embeddings Inference's answer: [{index, score, text}], best first."""
    keep_end = request.truncation_direction.lower() == "left"
    job = RerankJob(None, request.query, request.texts, "texts", None, request.max_tokens_per_doc,
                    bool(request.truncate), keep_end, request)
    scores, counts = await rank(front, _prompts(http_request), job)
    http_request.app.state.metrics.observe_usage(counts)
    ranks = []
    for score in scores:
        entry = {"index": score.index, "score": score.raw if request.raw_scores else score.relevance}
        if request.return_text:
            entry["text"] = request.texts[score.index]
        ranks.append({**entry, **window_fields(score)})
    if request.raw_scores:  # a mean of raw scores can order documents unlike the mean of their probabilities
        ranks.sort(key=lambda r: -r["score"])
    return ranks


@router.post("/v1/rerank", response_model=JinaRerankResponse, responses=ROUTE_ERRORS, response_class=FastJSONResponse)
async def rerank_v1(request: RerankRequest, http_request: Request, front: Front = Depends(ready_front)):
    results, usage = await rerank(request, http_request, front)
    return FastJSONResponse({"id": f"rerank-{uuid.uuid4().hex}", "model": front.engine.model_name, "usage": usage,
                             "results": results})


@router.post("/rerank", response_model=JinaRerankResponse | list[TeiRank], responses=ROUTE_ERRORS,
             response_class=FastJSONResponse)
async def rerank_plain(request: AnyRerankRequest, http_request: Request, front: Front = Depends(ready_front)):
    """The Jina/vLLM shape (`documents`), or Text Embeddings Inference's (`texts`), told apart by their fields."""
    if isinstance(request, TeiRerankRequest):
        return FastJSONResponse(await rerank_tei(request, http_request, front))
    return await rerank_v1(request, http_request, front)


@router.post("/v2/rerank", response_model=CohereRerankResponse, responses=ROUTE_ERRORS, response_class=FastJSONResponse)
async def rerank_v2(request: RerankRequest, http_request: Request, front: Front = Depends(ready_front)):
    if "return_documents" not in request.model_fields_set:
        request.return_documents = False  # Cohere v2 returns indices and scores only, unless asked
    results, usage = await rerank(request, http_request, front)
    meta = {"api_version": {"version": "2"}, "billed_units": {"search_units": 1},
            "tokens": {"input_tokens": usage["prompt_tokens"], "output_tokens": 0},
            "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"], "created": int(time.time())}
    return FastJSONResponse({"id": f"rerank-{uuid.uuid4().hex}", "results": results, "meta": meta})
