"""Pairwise judging prompts and verdicts: the template filled for every ordered pair of answers, and each pair's two
orders combined into an order-averaged win probability and a flip flag."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations

from app.api.judge.protocol import PairwiseRequest
from app.errors import InvalidRequestError

QUESTION, ANSWER_A, ANSWER_B = "{question}", "{answer_a}", "{answer_b}"


def pairs_of(n: int, max_pairs: int) -> list[tuple[int, int]]:
    """Every unordered pair (a < b) of n answers; 400 when there are more than the server allows."""
    if n < 2:
        raise InvalidRequestError("answers must hold at least two answers to compare", "answers")
    count = n * (n - 1) // 2
    if count > max_pairs:
        raise InvalidRequestError(f"{n} answers make {count} pairs, more than the limit of {max_pairs} "
                                  "(--max-judge-pairs)", "answers")
    return list(combinations(range(n), 2))


def _template_texts(request: PairwiseRequest) -> list[str]:
    return [request.template] if isinstance(request.template, str) else [m.content for m in request.template]


def check_template(request: PairwiseRequest) -> None:
    """The template must hold {answer_a} and {answer_b}, and {question} exactly when a question is given."""
    text = "".join(_template_texts(request))
    for placeholder in (ANSWER_A, ANSWER_B):
        if placeholder not in text:
            raise InvalidRequestError(f"the template has no {placeholder} placeholder", "template")
    if request.question is not None and QUESTION not in text:
        raise InvalidRequestError(f"a question is given but the template has no {QUESTION} placeholder", "template")
    if request.question is None and QUESTION in text:
        raise InvalidRequestError(f"the template has a {QUESTION} placeholder but no question is given", "question")


def _fill(text: str, question: str | None, first: str, second: str) -> str:
    # one pass over the template, so that an answer holding "{answer_b}" is not filled in again
    out, i = [], 0
    values = {QUESTION: question or "", ANSWER_A: first, ANSWER_B: second}
    while i < len(text):
        for placeholder, value in values.items():
            if text.startswith(placeholder, i):
                out.append(value)
                i += len(placeholder)
                break
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def render(request: PairwiseRequest, first: str, second: str, tokenizer) -> str:
    """The judging prompt with `first` in {answer_a} and `second` in {answer_b}, as text."""
    if isinstance(request.template, str):
        return _fill(request.template, request.question, first, second) + request.response_prefix
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError("this model has no chat template; send the template as text", "template")
    messages = [{"role": m.role, "content": _fill(m.content, request.question, first, second)}
                for m in request.template]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return text + request.response_prefix


def prompt_ids(request: PairwiseRequest, pairs: list[tuple[int, int]], tokenizer) -> list[list[int]]:
    """Token ids of every pair in both orders: (a, b) then (b, a) for each pair. Each prompt is tokenized whole, as
    a client sending it to /score would; a chat template writes its own special tokens."""
    special = request.add_special_tokens and isinstance(request.template, str)
    prompts = []
    for a, b in pairs:
        for first, second in ((a, b), (b, a)):
            text = render(request, request.answers[first], request.answers[second], tokenizer)
            prompts.append(tokenizer(text, add_special_tokens=special)["input_ids"])
    return prompts


@dataclass(frozen=True)
class PairVerdict:
    """One pair's two orders: p(a wins) with a shown first and with a shown second, their mean, and the flip."""

    a: int
    b: int
    a_first: float  # p(first label) with a in {answer_a}
    a_second: float  # p(second label) with a in {answer_b}

    @property
    def win_probability(self) -> float:
        return (self.a_first + self.a_second) / 2

    @property
    def flips(self) -> bool:
        """The verdict of each order alone (a, b, or a tie at exactly 0.5) differs with the order."""
        return _verdict(self.a_first) != _verdict(self.a_second)

    @property
    def winner(self) -> int | None:
        p = self.win_probability
        return self.a if p > 0.5 else self.b if p < 0.5 else None


def _verdict(p_a: float) -> int:
    """+1: a wins, -1: b wins, 0: a tie."""
    return (p_a > 0.5) - (p_a < 0.5)
