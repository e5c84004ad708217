"""/score's serving: a ScoreRequest -> token ids in the engine's ScoreQuery -> ScoredPrompts -> the response body."""

from __future__ import annotations

import math
import time
import uuid

from app.api.common import finite, softmax_over, usage
from app.api.front import Front
from app.api.judge.label_requests import label_fields, logprobs_mode_of, request_labels
from app.api.judge.label_scores import label_scores
from app.api.score.prompts import ScorePrompts
from app.api.score.protocol import ScoreRequest
from app.engine.core import Engine
from app.engine.results import ScoredPrompts, ScoreOutcome
from app.engine.token_strings import TokenStrings
from app.engine.work import ScoreQuery
from app.errors import InvalidRequestError
from sampler import SamplingParams


def score_query(front: Front, request: ScoreRequest, candidates: list[tuple[int, ...]] | None = None) -> ScoreQuery:
    """The request as the engine's token ids, every input checked; `candidates` (a label set's forms as token ids)
    stand in for the request's own. Tokenizes: runs on the front's tokenizer thread."""
    render = ScorePrompts(front.engine.loaded.tokenizer, front.checks)
    candidates = request.candidates if candidates is None else candidates
    params = render.sampling_params(
        request.label_token_ids, candidates, request.top_logprobs, request.logprobs_mode, request.logit_bias,
        temperature=request.temperature, top_k=request.top_k, top_p=request.top_p, min_p=request.min_p)
    prompts = render.prompts(request.query, request.items, item_first=request.item_first,
                             add_special_tokens=request.add_special_tokens,
                             truncate_prompt_tokens=request.truncate_prompt_tokens)
    param = "query" if request.items is None else "items"
    return ScoreQuery(prompts, params, render.candidates(candidates, prompts, param), param)


async def score(front: Front, request: ScoreRequest) -> dict:
    """The /score response body of one request."""
    if request.labels is not None:
        return await score_labels(front, request)
    if request.calibrated:
        raise InvalidRequestError("calibrated applies to a named label set (`labels`)", "calibrated")
    front.checks.model(request.model)
    query = await front.on_tokenizer_thread(score_query, front, request)
    return score_body(front.engine, request.apply_softmax, await front.engine.score(query))


async def score_labels(front: Front, request: ScoreRequest) -> dict:
    """A label-set request: every surface form scored as a candidate, then combined per label."""
    for other in ("label_token_ids", "candidates"):
        if getattr(request, other) is not None:
            raise InvalidRequestError(f"give labels or {other}, not both", other)
    front.checks.model(request.model)
    engine = front.engine
    mode = logprobs_mode_of(engine, request.logprobs_mode)
    labels = await request_labels(front, request.labels, mode, request.calibrated)
    query = await front.on_tokenizer_thread(score_query, front, request, list(labels.bound.candidates))
    result = await engine.score(query)
    data = [{"index": i, **label_fields(labels, label_scores(labels.bound, o.candidate_values))}
            for i, o in enumerate(result.outcomes)]
    return _body(engine, result, data)


def scores(values: list[float], apply_softmax: bool, params: SamplingParams) -> list[float] | None:
    """Probabilities to report: softmax over the values, or their exp under a logprobs mode (None for logits)."""
    if apply_softmax:
        return softmax_over(values)
    if params.logprobs_mode.is_logprobs:
        return [math.exp(v) for v in values]
    return None


def score_body(engine: Engine, apply_softmax: bool, result: ScoredPrompts) -> dict:
    params = result.params
    if result.candidates:
        data = [_candidate_entry(i, o, apply_softmax, params) for i, o in enumerate(result.outcomes)]
    else:
        data = [_label_entry(i, o, apply_softmax, params, engine.token_strings) for i, o in enumerate(result.outcomes)]
    return _body(engine, result, data)


def _body(engine: Engine, result: ScoredPrompts, data: list[dict]) -> dict:
    params = result.params
    return {
        "id": f"score-{uuid.uuid4().hex}",
        "object": "score",
        "created": int(time.time()),
        "model": engine.model_name,
        "logprobs_mode": params.logprobs_mode.value,
        "data": data,
        "usage": usage(result.prompt_tokens, result.cached_tokens),
    }


def _label_entry(index: int, outcome: ScoreOutcome, apply_softmax: bool, params: SamplingParams,
                 token_strings: TokenStrings) -> dict:
    row = outcome.labels
    top = None
    if params.top_logprobs:
        top = [{"token_id": t, "token": token_strings.text(t), "logprob": finite(v)}
               for t, v in zip(row.top_ids, row.top_values)]
    return {
        "index": index,
        "label_logprobs": [finite(v) for v in row.label_values],
        "scores": scores(row.label_values, apply_softmax, params),
        "label_ranks": row.label_ranks,
        "top_logprobs": top,
    }


def _candidate_entry(index: int, outcome: ScoreOutcome, apply_softmax: bool, params: SamplingParams) -> dict:
    totals = [math.fsum(values) for values in outcome.candidate_values]  # a filtered (-inf) token gives -inf
    return {
        "index": index,
        "candidate_logprobs": [finite(v) for v in totals],
        "scores": scores(totals, apply_softmax, params),
        "candidate_token_logprobs": [[finite(v) for v in values] for values in outcome.candidate_values],
        "candidate_num_tokens": [len(values) for values in outcome.candidate_values],
    }
