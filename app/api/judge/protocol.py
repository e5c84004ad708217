"""Request and response models of POST /v1/judge/pairwise."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from app.api.protocol import Flag, ProcessorFields, StrictModel, TokenId
from sampler import LogprobsMode


class TemplateMessage(StrictModel):
    """One chat message of a judging template; placeholders may sit in any message's content."""

    role: Literal["system", "developer", "user", "assistant"]
    content: str


class PairwiseRequest(ProcessorFields):
    """Compare every pair of answers in both orders with a judging prompt; the label set names the verdicts."""

    model: str | None = Field(default=None, description="Must match the served model name when given.")
    template: str | list[TemplateMessage] = Field(
        description="The judging prompt with the placeholders {answer_a} and {answer_b} (and {question} when a "
        "question is given), MT-Bench's names: plain text, or chat messages rendered with the model's chat template "
        "(the assistant's turn opened after them).")
    question: str | None = Field(default=None, description="Fills {question}.")
    answers: list[str] = Field(description="Two or more candidate answers; every pair is compared.")
    labels: str | dict[str, list[str | list[TokenId]]] = Field(
        description="A label set of two labels: the verdict for the answer shown first ({answer_a}), then for the "
        "one shown second; a name from --label-sets or {label: [surface form, ...]}.")
    response_prefix: str = Field(default="", description="Text after the rendered template, before the verdict "
                                 "(e.g. \"[[\" for MT-Bench's \"[[A]]\").")
    calibrated: Flag = Field(default=False, description="Use the server's calibration of the named label set.")
    logprobs_mode: LogprobsMode | None = Field(default=None, description="A logprobs mode (default: the server's).")
    add_special_tokens: Flag = Field(default=True, description="Add the tokenizer's special tokens to a plain-text "
                                     "template (a chat template writes its own).")


class LabelProbability(BaseModel):
    label: str
    logprob: float
    probability: float


class PairOrder(BaseModel):
    first: int = Field(description="Index of the answer in {answer_a}.")
    second: int = Field(description="Index of the answer in {answer_b}.")
    win_probability: float = Field(description="In this order: the probability that the comparison's `a` wins.")
    labels: list[LabelProbability]


class Comparison(BaseModel):
    a: int
    b: int
    win_probability: float = Field(description="p(a beats b), averaged over both orders.")
    orders: list[PairOrder] = Field(description="a first, then b first.")
    flips: bool = Field(description="The two orders pick different winners.")
    winner: int | None = Field(description="a or b by the averaged probability; null on an exact tie.")


class Ranked(BaseModel):
    index: int
    rank: int
    strength: float = Field(description="Bradley-Terry log-strength (mean 0 over the answers).")


class PairwiseUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None


class PairwiseResponse(BaseModel):
    id: str
    object: Literal["judge.pairwise"] = "judge.pairwise"
    created: int
    model: str
    logprobs_mode: LogprobsMode
    comparisons: list[Comparison]
    ranking: list[Ranked]
    usage: PairwiseUsage
