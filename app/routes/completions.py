"""POST /v1/completions (OpenAI's legacy Completions API), and the dependency every OpenAI-style route shares."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from app.errors import ServiceUnavailableError
from app.openai_schemas import CompletionRequest, CompletionResponse
from app.openai_serving import OpenAIServing
from app.routes.common import FastJSONResponse, ready_engine
from app.schemas import ErrorResponse

router = APIRouter()

ERRORS = {code: {"model": ErrorResponse} for code in (400, 404, 500, 503)}
STREAM = {"content": {"text/event-stream": {}}, "description": "With `stream: true`: `data: {chunk}` events."}


def ready_openai(request: Request) -> OpenAIServing:
    """The serving logic over the ready engine and generation loop, or 503; built once per engine."""
    engine = ready_engine(request)
    generator = request.app.state.lifecycle.generator
    if generator is None or not generator.alive:
        raise ServiceUnavailableError("the generation loop is not running")
    serving = getattr(request.app.state, "openai_serving", None)
    if serving is None or serving.engine is not engine:
        serving = request.app.state.openai_serving = OpenAIServing(engine, generator)
    return serving


@router.post("/v1/completions", response_model=CompletionResponse, responses={**ERRORS, 200: STREAM},
             response_class=FastJSONResponse)
async def completions(request: CompletionRequest, serving: OpenAIServing = Depends(ready_openai)):
    result = await serving.completion(request)
    return result if not isinstance(result, dict) else FastJSONResponse(result)
