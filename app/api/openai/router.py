"""POST /v1/completions (OpenAI's legacy Completions API) and /v1/chat/completions, and the dependency they share."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from app.api.common import FastJSONResponse, ready_front
from app.api.errors import ROUTE_ERRORS
from app.api.front import Front
from app.api.openai.protocol import ChatCompletionRequest, ChatCompletionResponse, CompletionRequest, CompletionResponse
from app.api.openai.serving import OpenAIServing

router = APIRouter()

STREAM = {"content": {"text/event-stream": {}}, "description": "With `stream: true`: `data: {chunk}` events."}


async def ready_openai(request: Request) -> OpenAIServing:
    """The serving logic over the ready Front, or 503; built once per Front."""
    return openai_serving(request, await ready_front(request))


def openai_serving(request: Request, front: Front) -> OpenAIServing:
    serving = getattr(request.app.state, "openai_serving", None)
    if serving is None or serving.front is not front:
        serving = request.app.state.openai_serving = OpenAIServing(front)
    return serving


@router.post("/v1/completions", response_model=CompletionResponse, responses={**ROUTE_ERRORS, 200: STREAM},
             response_class=FastJSONResponse)
async def completions(request: CompletionRequest, serving: OpenAIServing = Depends(ready_openai)):
    result = await serving.completion(request)
    return result if not isinstance(result, dict) else FastJSONResponse(result)


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses={**ROUTE_ERRORS, 200: STREAM},
             response_class=FastJSONResponse)
async def chat_completions(request: ChatCompletionRequest, serving: OpenAIServing = Depends(ready_openai)):
    result = await serving.chat(request)
    return result if not isinstance(result, dict) else FastJSONResponse(result)
