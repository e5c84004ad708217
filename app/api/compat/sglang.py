"""POST /v1/score: SGLang's scoring API, request and response as SGLang defines them, served by the genscore engine."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, Field

from app.api.common import FastJSONResponse, ready_front, usage
from app.api.errors import ROUTE_ERRORS
from app.api.front import Front
from app.api.protocol import Flag, PromptUsage, StrictModel, TokenId
from app.api.score.prompts import ScorePrompts
from app.api.score.serving import scores
from app.engine.work import ScoreQuery
from app.errors import InvalidRequestError
from sampler import LogprobsMode

router = APIRouter()


class SGLangScoringRequest(StrictModel):
    """SGLang's ScoringRequest. Text query and items are joined as text and tokenized together, as SGLang does."""

    model: str | None = Field(default=None, description="Must match the served model name when given.")
    query: str | list[TokenId] = Field(description="Query text, or its token ids.")
    items: str | list[str] | list[list[TokenId]] = Field(
        description="One item, or a list of item texts, or of token-id lists (the same kind as the query)."
    )
    label_token_ids: list[TokenId] = Field(description="Token ids whose next-token probability is returned.")
    apply_softmax: Flag = Field(default=False, description="Softmax over the labels instead of model probabilities.")
    item_first: Flag = Field(default=False, description="Put each item before the query.")


class SGLangScoringResponse(BaseModel):
    scores: list[list[float]] = Field(description="Per item, one probability per label, in label order.")
    model: str
    usage: PromptUsage | None = None
    object: Literal["scoring"] = "scoring"


def score_query(front: Front, request: SGLangScoringRequest, items: list[str] | list[list[int]]) -> ScoreQuery:
    """The same prompts SGLang builds, as token ids in raw_logprobs mode. Tokenizes: runs on the tokenizer thread."""
    render = ScorePrompts(front.engine.loaded.tokenizer, front.checks)
    params = render.sampling_params(request.label_token_ids, None, logprobs_mode=LogprobsMode.RAW_LOGPROBS)
    if isinstance(request.query, str):
        # SGLang concatenates the texts and tokenizes each whole prompt with the tokenizer's special tokens
        prompts = render.whole_prompts([item + request.query if request.item_first else request.query + item
                                        for item in items])
    else:
        prompts = render.prompts(request.query, items, item_first=request.item_first)
    return ScoreQuery(prompts, params)


@router.post("/v1/score", response_model=SGLangScoringResponse, responses=ROUTE_ERRORS, response_class=FastJSONResponse)
async def sglang_score(request: SGLangScoringRequest, http_request: Request,
                       front: Front = Depends(ready_front)):
    front.checks.model(request.model)
    engine = front.engine
    if not request.items:  # SGLang answers an empty item list with no scores
        scored, counts = [], {"prompt_tokens": 0, "total_tokens": 0}
    else:
        items = [request.items] if isinstance(request.items, str) else request.items
        if isinstance(request.query, str) != isinstance(items[0], str):
            raise InvalidRequestError("query and items must both be text or both be token ids", "items")
        result = await engine.score(await front.on_tokenizer_thread(score_query, front, request, items))
        scored = [scores(o.labels.label_values, request.apply_softmax, result.params) for o in result.outcomes]
        counts = usage(result.prompt_tokens, result.cached_tokens)
        http_request.app.state.metrics.observe_usage(counts)
    return FastJSONResponse({
        "scores": scored,
        "model": engine.model_name,
        "usage": {"prompt_tokens": counts["prompt_tokens"], "total_tokens": counts["total_tokens"],
                  "completion_tokens": 0, "prompt_tokens_details": counts.get("prompt_tokens_details")},
        "object": "scoring",
    })
