"""POST /v1/rerank, /rerank (Jina/vLLM shape) and /v2/rerank (Cohere v2 shape): generative reranking, each document
scored as p(yes) / (p(yes) + p(no)) after the configured prompt, the documents batched over their shared prefix."""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field

from app.api.common import FastJSONResponse, ready_engine, softmax_over, usage
from app.api.protocol import ErrorResponse, Flag
from app.api.rerank.formats import RerankPrompts
from app.engine.core import Engine
from app.engine.inputs import check_list_size
from app.errors import InvalidRequestError
from sampler import SamplingParams

router = APIRouter()

_ERRORS = {code: {"model": ErrorResponse} for code in (400, 404, 500, 503)}


class TextDocument(BaseModel):
    model_config = ConfigDict(extra="allow")  # Cohere v1 documents may carry other fields; only text is read

    text: str


class RerankRequest(BaseModel):
    """The fields Cohere v2, Jina and vLLM rerank clients send."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(default=None, description="Must match the served model name when given.")
    query: str = Field(description="The search query.")
    documents: list[str | TextDocument] = Field(description="Texts to rank, or {\"text\": ...} objects.")
    top_n: int | None = Field(default=None, description="Return only the best top_n documents (at least 1).")
    return_documents: Flag = Field(default=True, description="Include each document's text in its result.")
    instruction: str | None = Field(default=None, description="Task instruction in the prompt (default: the "
                                    "format's, a web-search retrieval task).")
    max_tokens_per_doc: int | None = Field(default=None, description="Keep each document's first N tokens.")


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None


class JinaRerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


class CohereRerankResponse(BaseModel):
    id: str
    results: list[RerankResult]
    meta: dict


def _texts(request: RerankRequest, engine: Engine) -> list[str]:
    check_list_size(request.documents, engine.settings.max_items, "documents", "document")
    texts = [doc if isinstance(doc, str) else doc.text for doc in request.documents]
    for i, text in enumerate(texts):
        if not text.strip():
            raise InvalidRequestError("the document is empty", f"documents[{i}]")
    if request.top_n is not None and request.top_n < 1:
        raise InvalidRequestError(f"top_n must be at least 1, got {request.top_n}", "top_n")
    if request.max_tokens_per_doc is not None and request.max_tokens_per_doc < 1:
        raise InvalidRequestError(f"max_tokens_per_doc must be at least 1, got {request.max_tokens_per_doc}",
                                  "max_tokens_per_doc")
    return texts


def _prompts(prompts: RerankPrompts, request: RerankRequest, texts: list[str], limit: int) -> list[list[int]]:
    """Token ids of every document's prompt: one shared head, then the document, then the format's tail."""
    head, tail = prompts.head(request.query, request.instruction), prompts.tail()
    out = []
    for i, text in enumerate(texts):
        ids = head + prompts.document(text, request.max_tokens_per_doc) + tail
        if len(ids) > limit:
            raise InvalidRequestError(f"the prompt of this document has {len(ids)} tokens, more than the maximum of "
                                      f"{limit}; shorten it or set max_tokens_per_doc", f"documents[{i}]")
        out.append(ids)
    return out


async def rerank(request: RerankRequest, http_request: Request, engine: Engine) -> tuple[list[dict], dict]:
    """Ranked results (best first, cut to top_n) and the usage of one rerank request."""
    engine.checks.model(request.model)
    prompts = http_request.app.state.rerank
    if isinstance(prompts, str):  # the configured format cannot be used with this model: say why
        raise InvalidRequestError(f"reranking is not available on this server: {prompts}")
    texts = _texts(request, engine)
    token_ids = await engine.on_tokenizer_thread(_prompts, prompts, request, texts, engine.max_prompt_tokens)
    params = SamplingParams(label_token_ids=(prompts.yes_id, prompts.no_id))
    outcomes = await engine.run_prompts(token_ids, params)
    results = []
    for index, outcome in enumerate(outcomes):
        p_yes, _ = softmax_over(outcome.labels.label_values)  # raw logprobs of yes and no -> p(yes) / (p(yes)+p(no))
        result = {"index": index, "relevance_score": p_yes}
        if request.return_documents:
            result["document"] = {"text": texts[index]}
        results.append(result)
    results.sort(key=lambda r: -r["relevance_score"])  # stable: equal scores keep the input order
    counts = usage(sum(len(ids) for ids in token_ids), sum(o.reused_tokens for o in outcomes))
    http_request.app.state.metrics.observe_usage(counts)
    return results[: request.top_n], counts


@router.post("/v1/rerank", response_model=JinaRerankResponse, responses=_ERRORS, response_class=FastJSONResponse)
async def rerank_v1(request: RerankRequest, http_request: Request, engine: Engine = Depends(ready_engine)):
    results, usage = await rerank(request, http_request, engine)
    return FastJSONResponse({"id": f"rerank-{uuid.uuid4().hex}", "model": engine.model_name, "usage": usage,
                             "results": results})


@router.post("/rerank", response_model=JinaRerankResponse, responses=_ERRORS, response_class=FastJSONResponse)
async def rerank_plain(request: RerankRequest, http_request: Request, engine: Engine = Depends(ready_engine)):
    return await rerank_v1(request, http_request, engine)


@router.post("/v2/rerank", response_model=CohereRerankResponse, responses=_ERRORS, response_class=FastJSONResponse)
async def rerank_v2(request: RerankRequest, http_request: Request, engine: Engine = Depends(ready_engine)):
    if "return_documents" not in request.model_fields_set:
        request.return_documents = False  # Cohere v2 returns indices and scores only, unless asked
    results, usage = await rerank(request, http_request, engine)
    meta = {"api_version": {"version": "2"}, "billed_units": {"search_units": 1},
            "tokens": {"input_tokens": usage["prompt_tokens"], "output_tokens": 0},
            "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"], "created": int(time.time())}
    return FastJSONResponse({"id": f"rerank-{uuid.uuid4().hex}", "results": results, "meta": meta})
