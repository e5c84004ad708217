"""Request and response models of POST /score."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from app.api.protocol import Flag, ProcessorFields, TokenId
from sampler import LogprobsMode


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
    labels: str | dict[str, list[str | list[TokenId]]] | None = Field(
        default=None,
        description="A label set: the name of one in the server's --label-sets file, or {label: [surface form, ...]} "
        "(a form is text, tokenized alone without special tokens, or token ids; one or several tokens). Each label's "
        "logprob is the log-sum-exp of its forms' values. Instead of `label_token_ids` and `candidates`.")
    calibrated: Flag = Field(default=False, description="With a named label set: report probabilities through the "
                             "server's calibration of that set (--calibration).")
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


class LabelResult(BaseModel):
    """One label of a label set at one prompt."""

    label: str
    logprob: float = Field(description="log-sum-exp of its forms' logprobs (-9999.0 when every form is -inf).")
    probability: float = Field(description="exp(logprob) normalized over the labels.")
    calibrated_probability: float | None = Field(default=None, description="With `calibrated`: after calibration.")
    form_logprobs: list[float] = Field(description="Per surface form: the sum of its tokens' logprobs.")


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
    labels: list[LabelResult] | None = Field(default=None, description="With `labels`: per label, in order.")
    prediction: str | None = Field(default=None, description="With `labels`: the most probable label.")
    margin: float | None = Field(default=None, description="With `labels`: its probability minus the runner-up's.")
    entropy: float | None = Field(default=None, description="With `labels`: of the distribution over labels, in nats.")
    expected_value: float | None = Field(
        default=None, description="With `labels` that are all numbers: sum of probability x label.")
    calibrated: bool | None = Field(default=None, description="With `labels`: whether `scores` went through the "
                                    "label set's calibration.")


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
