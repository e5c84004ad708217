"""What every endpoint family's protocol shares: strict field types (a JSON `true` is not a token id, NaN is not a
number), the request base that rejects unknown fields, the processor fields, the drop-in routes' usage, the model list
and the error body."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AllowInfNan, BaseModel, ConfigDict, Field, Strict

TokenId = Annotated[int, Strict()]
# ints are accepted as numbers, bools and strings are not; nor NaN/Infinity, which Python's JSON parser lets through
Number = Annotated[float, Strict(), AllowInfNan(False)]
Flag = Annotated[bool, Strict()]
# A route that takes several request shapes tags each branch "<name>-shape"; error messages leave the tag out.
SHAPE_TAG_SUFFIX = "-shape"


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ProcessorFields(StrictModel):
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


class PromptUsage(BaseModel):
    """Token counts of a scoring request on the drop-in routes (SGLang's and vLLM's shape)."""

    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0
    prompt_tokens_details: dict[str, int] | None = None


class FastPathCheck(BaseModel):
    """One fast path's load-time self-check: on or off, its difference from the plain forward, why it is off."""

    name: str
    enabled: bool
    difference: float | None
    reason: str


class FastPathReport(BaseModel):
    """The model's forward plan: what each kind of call runs, and the load-time self-check of every fast path
    against the model's plain transformers forward (on or off, and why)."""

    tolerance: float | None
    seconds: float
    layout: Literal["packed", "padded", "one_at_a_time"] = Field(
        description="how scoring calls lay out sequences: packed in one row, padded micro-batches, or each alone")
    prefix_reuse: Literal["off", "key_values", "whole_cache"] = Field(
        description="how a shared prefix is reused: not at all, its key/value states, or a copy of the whole cache")
    decoding: Literal["batched", "per_request", "recompute"] = Field(
        description="how generation advances: rows in one key/value cache, each alone with the model's own cache, "
                    "or each token by a full forward")
    attention_kernel: str = Field(
        description="what runs packed attention: `loop` (one SDPA call per segment), or one kernel call per layer, "
                    "`cpu_varlen` (genscore's CPU kernel) or `varlen` (flash attention on CUDA)")
    decode_kernel: bool = Field(description="whether decode steps' attention runs through genscore's CPU decode kernel")
    prefix_attention: Literal["masked", "cascade"] = Field(
        description="how packed suffixes attend to their shared prefix: SDPA under a mask, or cascade attention")
    cuda_graph_buckets: list[int] = Field(
        description="packed lengths with a captured CUDA graph (empty: none, or not on a GPU)")
    batch_invariant: bool
    stateful_layers: list[str] = Field(description="cache layers that carry state across positions")
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
