"""Request and response models of the HTTP API (pydantic); unknown fields are rejected and numbers are strict (a JSON `true` is not a token id)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AllowInfNan, BaseModel, ConfigDict, Field, Strict

from sampler import LogprobsMode

TokenId = Annotated[int, Strict()]
# ints are accepted as numbers, bools and strings are not; nor NaN/Infinity, which Python's JSON parser lets through
Number = Annotated[float, Strict(), AllowInfNan(False)]
Flag = Annotated[bool, Strict()]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ProcessorFields(_Strict):
    """Per-request logit processors; they shape the `processed_*` logprobs modes only."""

    # a temperature below 0.01 (vLLM's floor too) or a bias beyond OpenAI's +-100 overflows float32
    # logits into inf/NaN, which has no logprob; they are refused as 400 instead of failing in the batch.
    temperature: Number | None = Field(default=None, ge=0.01, description="Divide logits by this (>= 0.01).")
    top_k: TokenId | None = Field(default=None, ge=-1, description="Keep the k most likely tokens (0 or -1: off).")
    top_p: Number | None = Field(default=None, gt=0, le=1, description="Keep the smallest set with this much mass.")
    min_p: Number | None = Field(default=None, ge=0, le=1, description="Drop tokens below min_p x the top probability.")
    logit_bias: dict[str, Annotated[Number, Field(ge=-100, le=100)]] | None = Field(
        default=None, description="Token id (as a string key, like OpenAI) -> bias in [-100, 100] added to its logit."
    )


class ScoreRequest(ProcessorFields):
    """POST /score: the logprob of each label token as the next token after the prompt (query + item)."""

    model: str | None = Field(default=None, description="Must match the served model name when given.")
    query: str | list[TokenId] = Field(description="Prompt text, or its token ids.")
    items: list[str] | list[list[TokenId]] | None = Field(
        default=None, description="Each item is appended to the query (or put before it with item_first)."
    )
    label_token_ids: list[TokenId] | None = Field(
        default=None, description="Candidate next-token ids, each in [0, vocab). Give this or `candidates`."
    )
    candidates: list[str] | list[list[TokenId]] | None = Field(
        default=None,
        description="Multi-token continuations (text, tokenized without special tokens, or token ids); each is "
        "scored by the sum of its tokens' conditional values after the prompt. Give this or `label_token_ids`.",
    )
    apply_softmax: Flag = Field(default=False, description="Normalize `scores` over the labels.")
    item_first: Flag = Field(default=False, description="Put each item before the query instead of after it.")
    logprobs_mode: LogprobsMode | None = Field(default=None, description="Default: the server's.")
    top_logprobs: TokenId = Field(default=0, ge=0, description="Also return this many top tokens (capped).")
    add_special_tokens: Flag = Field(default=True, description="Add the tokenizer's special tokens to the query.")
    truncate_prompt_tokens: TokenId | None = Field(default=None, ge=1, description="Keep only the last N prompt tokens.")


class TopLogprob(BaseModel):
    token_id: int
    token: str
    logprob: float


class ScoreData(BaseModel):
    """One prompt's result: label fields with `label_token_ids`, candidate fields with `candidates`."""

    index: int
    scores: list[float] | None
    label_logprobs: list[float] | None = None
    label_ranks: list[int] | None = None
    top_logprobs: list[TopLogprob] | None = None
    candidate_logprobs: list[float] | None = Field(
        default=None, description="Per candidate: the sum of its tokens' values under the logprobs mode.")
    candidate_token_logprobs: list[list[float]] | None = Field(
        default=None, description="Per candidate: each token's value, conditioned on the prompt and the tokens before it.")
    candidate_num_tokens: list[int] | None = Field(default=None, description="Per candidate: its token count.")


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="Prompt tokens not recomputed: their key/value states were shared.")


class Usage(BaseModel):
    prompt_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class ScoreResponse(BaseModel):
    id: str
    object: Literal["score"] = "score"
    created: int
    model: str
    logprobs_mode: LogprobsMode
    data: list[ScoreData]
    usage: Usage


class FastPathCheck(BaseModel):
    """One fast path's load-time self-check: on or off, its difference from the plain forward, why it is off."""

    name: str
    enabled: bool
    difference: float | None
    reason: str


class FastPathReport(BaseModel):
    """The load-time self-check of the fast paths against the model's plain transformers forward."""

    tolerance: float | None
    seconds: float
    paths: list[FastPathCheck]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "genscore"
    max_model_len: int
    fast_paths: FastPathReport | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | int | None


class ErrorResponse(BaseModel):
    error: ErrorDetail
