"""POST /generative_scoring: vLLM's generative scoring API, request and response as vLLM defines them."""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, Field, Strict

from app.api.common import FastJSONResponse, ready_front, usage
from app.api.errors import ROUTE_ERRORS
from app.api.front import Front
from app.api.protocol import Flag, PromptUsage, StrictModel, TokenId
from app.api.score.prompts import ScorePrompts
from app.api.score.serving import scores
from app.engine.work import ScoreQuery
from sampler import LogprobsMode

router = APIRouter()


class GenerativeScoringRequest(StrictModel):
    """vLLM's GenerativeScoringRequest. Query and items are tokenized apart and their ids joined, as vLLM does."""

    model: str | None = Field(default=None, description="Must match the served model name when given.")
    query: str | list[TokenId] = Field(description="Query text, or its token ids.")
    items: list[str] | list[list[TokenId]] = Field(description="Item texts, or token-id lists.")
    label_token_ids: list[TokenId] = Field(description="Token ids to score; `score` is the first one's probability.")
    apply_softmax: Flag = Field(default=True, description="Normalize over the labels (true) or use model probabilities.")
    item_first: Flag = Field(default=False, description="Put each item before the query.")
    add_special_tokens: Flag = Field(default=True, description="Add the tokenizer's special tokens to a text query.")
    priority: Annotated[int, Strict()] = Field(default=0, description="Accepted for compatibility; genscore serves one queue in order.")
    request_id: str | None = Field(default=None, description="Used in the response id (an X-Request-Id header wins).")


class GenerativeScoringItemResult(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class GenerativeScoringResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[GenerativeScoringItemResult]
    usage: PromptUsage


def score_query(front: Front, request: GenerativeScoringRequest) -> ScoreQuery:
    """Query and items tokenized apart and joined, in raw_logprobs mode. Tokenizes: runs on the tokenizer thread."""
    render = ScorePrompts(front.engine.loaded.tokenizer, front.checks)
    params = render.sampling_params(request.label_token_ids, None, logprobs_mode=LogprobsMode.RAW_LOGPROBS)
    prompts = render.prompts(request.query, request.items, item_first=request.item_first,
                             add_special_tokens=request.add_special_tokens)
    return ScoreQuery(prompts, params)


@router.post("/generative_scoring", response_model=GenerativeScoringResponse, responses=ROUTE_ERRORS,
             response_class=FastJSONResponse)
async def generative_scoring(request: GenerativeScoringRequest, raw: Request, front: Front = Depends(ready_front)):
    front.checks.model(request.model)
    engine = front.engine
    result = await engine.score(await front.on_tokenizer_thread(score_query, front, request))
    base_id = raw.headers.get("X-Request-Id") or request.request_id or uuid.uuid4().hex
    counts = usage(result.prompt_tokens, result.cached_tokens)
    raw.app.state.metrics.observe_usage(counts)
    # vLLM's score: the first label's probability (softmax over the labels by default)
    data = [{"index": i, "object": "score", "score": scores(o.labels.label_values, request.apply_softmax,
                                                            result.params)[0]}
            for i, o in enumerate(result.outcomes)]
    return FastJSONResponse({
        "id": f"generative-scoring-{base_id}",
        "object": "list",
        "created": int(time.time()),
        "model": engine.model_name,
        "data": data,
        "usage": {"prompt_tokens": counts["prompt_tokens"], "total_tokens": counts["total_tokens"],
                  "completion_tokens": 0, "prompt_tokens_details": counts["prompt_tokens_details"]},
    })
