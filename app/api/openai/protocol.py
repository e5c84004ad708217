"""Request and response models of the OpenAI-compatible routes (/v1/completions, /v1/chat/completions) and the
vLLM-shaped tokenizer routes (/tokenize, /detokenize, /tokenizer_info).

Requests reject unknown fields; OpenAI fields genscore does not implement are declared so that the routes can
answer them with a clear 400 naming the field, instead of "unknown field".
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from app.api.protocol import Flag, Number, StrictModel, TokenId
from sampler import LogprobsMode

Count = TokenId  # a strict int: a JSON `true` is not a count


class StreamOptions(StrictModel):
    include_usage: Flag = Field(default=False, description="Send a last chunk with `usage` (and `usage: null` before).")


class GenerationFields(StrictModel):
    """What /v1/completions and /v1/chat/completions share."""

    model: str | None = Field(default=None, description="Must match the served model name when given.")
    temperature: Number | None = Field(default=None, ge=0, description="0 = greedy; default 1.")
    top_p: Number | None = Field(default=None, gt=0, le=1, description="Nucleus sampling mass.")
    n: Count = Field(default=1, ge=1, description="Choices per prompt.")
    stream: Flag = Field(default=False, description="Server-sent events: `data: {chunk}` lines, then `data: [DONE]`.")
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = Field(default=None, description="Stop strings; the stop text is not returned.")
    seed: Count | None = Field(default=None, description="Makes sampling reproducible.")
    presence_penalty: Number = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: Number = Field(default=0.0, ge=-2, le=2)
    logit_bias: dict[str, Number] | None = Field(default=None, description="Token id (string key) -> bias.")
    user: str | None = Field(default=None, description="Accepted and ignored.")
    # extensions
    top_k: Count | None = Field(default=None, ge=-1, description="Keep the k most likely tokens (0 or -1: off).")
    min_p: Number | None = Field(default=None, ge=0, le=1, description="Drop tokens below min_p x the top probability.")
    logprobs_mode: LogprobsMode | None = Field(default=None, description="Which numbers logprobs hold; default: the server's.")


class CompletionRequest(GenerationFields):
    """POST /v1/completions (OpenAI's legacy Completions API)."""

    prompt: str | list[str] | list[TokenId] | list[list[TokenId]] = Field(
        description="A string, a list of strings, a list of token ids, or a list of token-id lists.")
    max_tokens: Count | None = Field(default=16, ge=0, description="Tokens to generate per choice; 0 = none (echo only).")
    logprobs: Count | None = Field(default=None, ge=0, description="Return the top N tokens' logprobs (capped).")
    echo: Flag = Field(default=False, description="Return the prompt (and its logprobs) before the completion.")
    logprob_token_ids: list[TokenId] | None = Field(
        default=None, description="Extension: also return these token ids' logprobs at every returned position.")
    # OpenAI fields genscore answers with a 400
    suffix: str | None = Field(default=None, description="Not supported.")
    best_of: Count | None = Field(default=None, description="Only best_of = n is supported.")


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message; only text content is supported. Extra keys (e.g. tool_calls) are rejected."""

    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart | dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(GenerationFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(description="The conversation, rendered with the model's chat template.")
    max_tokens: Count | None = Field(default=None, ge=0, description="Deprecated alias of max_completion_tokens.")
    max_completion_tokens: Count | None = Field(default=None, ge=0, description="Default: up to the context length.")
    logprobs: Flag = Field(default=False, description="Return each generated token's logprob.")
    top_logprobs: Count | None = Field(default=None, ge=0, description="And the top N alternatives (needs logprobs).")
    # OpenAI fields genscore answers with a 400 unless they ask for plain text
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    parallel_tool_calls: Any = None
    response_format: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None


# --- responses (documentation of the shapes the routes return) -------------------------------------------------

class CompletionUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]
    token_id_logprobs: list[dict[str, float] | None] | None = Field(
        default=None, description="Extension, only with logprob_token_ids: {token id: logprob} at each position.")


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["length", "stop"] | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: CompletionUsage


class TopLogprobEntry(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprobEntry(TopLogprobEntry):
    top_logprobs: list[TopLogprobEntry]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprobEntry] | None
    refusal: None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str
    refusal: None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None
    finish_reason: Literal["length", "stop"]


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: CompletionUsage


# --- tokenizer routes (vLLM's shapes) --------------------------------------------------------------------------

class TokenizeCompletionRequest(StrictModel):
    model: str | None = None
    prompt: str
    add_special_tokens: Flag = Field(default=True, description="Add the tokenizer's special tokens (e.g. BOS).")
    return_token_strs: Flag = Field(default=False, description="Also return each token as a string.")


class TokenizeChatRequest(StrictModel):
    model: str | None = None
    messages: list[ChatMessage]
    add_generation_prompt: Flag = Field(default=True, description="End with the assistant turn's opening.")
    continue_final_message: Flag = Field(default=False, description="Leave the last message open (no end token).")
    add_special_tokens: Flag = Field(default=False, description="Special tokens on top of the template's own.")
    return_token_strs: Flag = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerInfoResponse(BaseModel):
    """The tokenizer's configuration (tokenizer_config.json) with its class name and chat template."""

    model_config = ConfigDict(extra="allow")
    tokenizer_class: str
