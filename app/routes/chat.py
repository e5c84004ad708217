"""POST /v1/chat/completions: messages through the model's chat template, then generation."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from app.openai_schemas import ChatCompletionRequest, ChatCompletionResponse
from app.openai_serving import OpenAIServing
from app.routes.common import FastJSONResponse
from app.routes.completions import ERRORS, STREAM, ready_openai

router = APIRouter()


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses={**ERRORS, 200: STREAM},
             response_class=FastJSONResponse)
async def chat_completions(request: ChatCompletionRequest, serving: OpenAIServing = Depends(ready_openai)):
    result = await serving.chat(request)
    return result if not isinstance(result, dict) else FastJSONResponse(result)
