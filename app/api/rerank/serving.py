"""Rerank serving, for every shape: each document (or each window of a long one) as a prompt over the shared query
prefix, scored by the format's yes/no words or a two-label set, the windows aggregated back into one score."""

from __future__ import annotations

import math
from dataclasses import dataclass

from app.api.common import softmax_over, usage
from app.api.front import Front
from app.api.inputs import check_list_size
from app.api.judge.label_requests import RequestLabels, logprobs_mode_of, request_labels
from app.api.judge.label_scores import label_scores
from app.api.rerank.formats import RerankPrompts
from app.api.rerank.protocol import RerankScoringFields
from app.api.rerank.windows import DocumentPieces, LongDocumentPolicy, document_pieces
from app.engine.core import Engine
from app.engine.work import ScoreQuery
from app.errors import InvalidRequestError
from sampler import SamplingParams


@dataclass(frozen=True)
class RerankJob:
    """A rerank request of any shape, as the serving sees it."""

    model: str | None
    query: str
    texts: list[str]
    documents_param: str  # the request's name for the list: `documents` or `texts`
    instruction: str | None
    max_tokens_per_doc: int | None
    truncate: bool
    keep_end: bool  # truncation keeps a document's end (TEI's truncation_direction Left)
    fields: RerankScoringFields  # window_size, window_stride, aggregate, labels


@dataclass(frozen=True)
class DocumentScore:
    """One document's score: p(relevant) normalized over the two labels, and log p(relevant) - log p(not)."""

    index: int
    relevance: float
    raw: float
    windows: int | None  # how many windows it was scored in; None when it was one prompt
    span: tuple[int, int] | None  # the characters of its best window


def check_texts(job: RerankJob, engine: Engine) -> None:
    check_list_size(job.texts, engine.settings.max_items, job.documents_param, "document")
    for i, text in enumerate(job.texts):
        if not text.strip():
            raise InvalidRequestError("the document is empty", f"{job.documents_param}[{i}]")


def _pieces(prompts: RerankPrompts, job: RerankJob, limit: int, max_windows: int
            ) -> tuple[list[int], list[int], list[DocumentPieces]]:
    """The shared head, the tail and every document's pieces (runs on the tokenizer thread)."""
    head, tail = prompts.head(job.query, job.instruction), prompts.tail()
    fields = job.fields
    policy = LongDocumentPolicy.of(limit - len(head) - len(tail), job.max_tokens_per_doc, fields.window_size,
                                   fields.window_stride, job.truncate, job.keep_end)
    documents = [document_pieces(*prompts.document(text), policy) for text in job.texts]
    total = sum(len(d.pieces) for d in documents)
    if total > max_windows:
        raise InvalidRequestError(f"the documents make {total} prompts (windows included), more than the limit of "
                                  f"{max_windows} (--max-rerank-windows); send fewer or larger windows",
                                  job.documents_param)
    return head, tail, documents


async def _two_labels(front: Front, spec) -> RequestLabels:
    labels = await request_labels(front, spec, logprobs_mode_of(front.engine, "raw_logprobs"), False)
    if len(labels.bound.label_set.labels) != 2:
        raise InvalidRequestError("a rerank label set has exactly two labels: relevant first, then not relevant",
                                  "labels")
    return labels


def _aggregate(values: list[float], how: str) -> float:
    return max(values) if how == "max" else math.fsum(values) / len(values)


async def rank(front: Front, prompts: RerankPrompts, job: RerankJob) -> tuple[list[DocumentScore], dict]:
    """Every document's score, best first (equal scores keep the input order), and the usage."""
    front.checks.model(job.model)
    engine = front.engine
    check_texts(job, engine)
    labels = await _two_labels(front, job.fields.labels) if job.fields.labels is not None else None
    head, tail, documents = await front.on_tokenizer_thread(
        _pieces, prompts, job, front.max_prompt_tokens, engine.settings.max_rerank_windows)
    token_ids = [head + piece + tail for document in documents for piece in document.pieces]
    if labels is None:
        yes_no = SamplingParams(label_token_ids=(prompts.yes_id, prompts.no_id))
        outcomes = (await engine.score(ScoreQuery(token_ids, yes_no, param=job.documents_param))).outcomes
        pairs = [o.labels.label_values for o in outcomes]  # raw logprobs of yes and no
    else:
        query = ScoreQuery(token_ids, SamplingParams(), labels.bound.candidates, job.documents_param)
        outcomes = (await engine.score(query)).outcomes
        pairs = [label_scores(labels.bound, o.candidate_values).logprobs for o in outcomes]
    scores, at = [], 0
    for index, document in enumerate(documents):
        window_pairs = pairs[at : at + len(document.pieces)]
        at += len(document.pieces)
        relevance = [softmax_over(pair)[0] for pair in window_pairs]  # p(yes) / (p(yes) + p(no))
        raw = [pair[0] - pair[1] for pair in window_pairs]
        best = max(range(len(relevance)), key=relevance.__getitem__)  # first on a tie
        how = job.fields.aggregate
        scores.append(DocumentScore(index, _aggregate(relevance, how), _aggregate(raw, how),
                                    len(document.pieces) if document.windowed else None,
                                    document.spans[best] if document.windowed else None))
    scores.sort(key=lambda s: -s.relevance)  # stable
    return scores, usage(sum(len(ids) for ids in token_ids), sum(o.reused_tokens for o in outcomes))


def window_fields(score: DocumentScore) -> dict:
    """`windows` and `span` of a windowed document's result; nothing for one scored whole."""
    if score.windows is None:
        return {}
    fields = {"windows": score.windows}
    if score.span is not None:
        fields["span"] = {"start": score.span[0], "end": score.span[1]}
    return fields
