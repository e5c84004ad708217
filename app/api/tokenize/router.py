"""Tokenizer routes in vLLM's shapes, as evaluation clients (lm-eval's remote tokenizer) call them:
POST /tokenize, POST /detokenize, GET /tokenizer_info."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from app.api.common import FastJSONResponse, loaded_front
from app.api.errors import ROUTE_ERRORS
from app.api.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    TokenizerInfoResponse,
)
from app.api.openai.router import openai_serving
from app.api.openai.serving import OpenAIServing
from app.errors import InvalidRequestError

router = APIRouter()

# tokenizer_config.json keys that name files or places on this server, not properties of the tokenizer
_LOCAL_KEYS = ("vocab_file", "merges_file", "tokenizer_file", "name_or_path", "is_local", "local_files_only")


async def tokenizer_serving(request: Request) -> OpenAIServing:
    """The OpenAI serving logic (chat rendering, the tokenizer) once the model is loaded; the engine's loop need
    not be alive, since these routes never reach the device."""
    return openai_serving(request, await loaded_front(request))


@router.post("/tokenize", response_model=TokenizeResponse, responses=ROUTE_ERRORS, response_class=FastJSONResponse)
async def tokenize(request: TokenizeCompletionRequest | TokenizeChatRequest,
                   serving: OpenAIServing = Depends(tokenizer_serving)):
    serving.checks.model(request.model)
    return FastJSONResponse(await serving.front.on_tokenizer_thread(_tokenized, serving, request))


def _tokenized(serving: OpenAIServing, request: TokenizeCompletionRequest | TokenizeChatRequest) -> dict:
    tokenizer = serving.loaded.tokenizer
    if isinstance(request, TokenizeChatRequest):
        if request.continue_final_message and request.add_generation_prompt:
            raise InvalidRequestError("continue_final_message and add_generation_prompt cannot both be true",
                                      "continue_final_message")
        text = serving.render_chat(request.messages, request.add_generation_prompt, request.continue_final_message)
    else:
        text = request.prompt
    ids = tokenizer(text, add_special_tokens=request.add_special_tokens)["input_ids"]
    return {
        "count": len(ids),
        "max_model_len": serving.loaded.max_length,
        "tokens": ids,
        "token_strs": tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None,
    }


@router.post("/detokenize", response_model=DetokenizeResponse, responses=ROUTE_ERRORS, response_class=FastJSONResponse)
async def detokenize(request: DetokenizeRequest, serving: OpenAIServing = Depends(tokenizer_serving)):
    serving.checks.model(request.model)
    serving.checks.token_ids(request.tokens, "tokens")
    text = await serving.front.on_tokenizer_thread(serving.loaded.tokenizer.decode, request.tokens)
    return FastJSONResponse({"prompt": text})


def _jsonable(value):
    """AddedToken -> its text; containers recursively; anything else exotic -> its str()."""
    if hasattr(value, "content"):
        return value.content
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


@router.get("/tokenizer_info", response_model=TokenizerInfoResponse, responses=ROUTE_ERRORS)
async def tokenizer_info(serving: OpenAIServing = Depends(tokenizer_serving)):
    tokenizer = serving.loaded.tokenizer
    info = {k: v for k, v in (getattr(tokenizer, "init_kwargs", None) or {}).items() if k not in _LOCAL_KEYS}
    info = _jsonable(info)
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):  # clients read these; always present
        info[name] = getattr(tokenizer, name, None)
    info["tokenizer_class"] = type(tokenizer).__name__
    if getattr(tokenizer, "chat_template", None):
        info["chat_template"] = tokenizer.chat_template
    # stdlib JSON: model_max_length is often 1e30, too big for orjson's 64-bit integers
    return JSONResponse(info)
