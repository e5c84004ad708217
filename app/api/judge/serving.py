"""POST /v1/judge/pairwise's serving: every pair of answers in both orders through the engine in one submission (the
template's text before the first answer is their shared prefix), the verdicts combined, and a Bradley-Terry
ranking."""

from __future__ import annotations

import time
import uuid

from app.api.common import finite, usage
from app.api.front import Front
from app.api.judge.bradley_terry import bradley_terry
from app.api.judge.label_requests import logprobs_mode_of, request_labels
from app.api.judge.label_scores import LabelScores, label_scores
from app.api.judge.pairwise import PairVerdict, check_template, pairs_of, prompt_ids
from app.api.judge.protocol import PairwiseRequest
from app.engine.work import ScoreQuery
from app.errors import InvalidRequestError


def _check_lengths(front: Front, prompts: list[list[int]], pairs: list[tuple[int, int]], longest_form: int) -> None:
    """Each prompt with its longest verdict form must fit the model."""
    limit = front.max_prompt_tokens
    for k, ids in enumerate(prompts):
        if len(ids) + longest_form > limit:
            a, b = pairs[k // 2]
            raise InvalidRequestError(f"the judging prompt of answers {a} and {b} has {len(ids)} tokens; with the "
                                      f"longest verdict form ({longest_form}) it exceeds the maximum of {limit}",
                                      "answers")


async def judge_pairwise(front: Front, request: PairwiseRequest) -> dict:
    front.checks.model(request.model)
    engine = front.engine
    check_template(request)
    pairs = pairs_of(len(request.answers), engine.settings.max_judge_pairs)
    mode = logprobs_mode_of(engine, request.logprobs_mode)
    labels = await request_labels(front, request.labels, mode, request.calibrated)
    names = labels.bound.label_set.labels
    if len(names) != 2:
        raise InvalidRequestError("a pairwise label set has exactly two labels: the verdict for the answer shown "
                                  "first, then for the one shown second", "labels")
    params = front.checks.sampling(mode, request.logit_bias, temperature=request.temperature, top_k=request.top_k,
                                   top_p=request.top_p, min_p=request.min_p)
    prompts = await front.on_tokenizer_thread(prompt_ids, request, pairs, engine.loaded.tokenizer)
    _check_lengths(front, prompts, pairs, max(len(c) for c in labels.bound.candidates))
    outcomes = (await engine.score(ScoreQuery(prompts, params, labels.bound.candidates, "answers"))).outcomes
    scored = [label_scores(labels.bound, o.candidate_values) for o in outcomes]

    def probabilities(scores: LabelScores) -> list[float]:
        if labels.calibration is not None:
            return labels.calibration.probabilities(scores.logprobs)
        return scores.distribution.probabilities

    comparisons, wins = [], {}
    for k, (a, b) in enumerate(pairs):
        a_first, b_first = scored[2 * k], scored[2 * k + 1]
        verdict = PairVerdict(a, b, probabilities(a_first)[0], probabilities(b_first)[1])
        wins[(a, b)] = verdict.win_probability
        orders = []
        for (first, second), scores, p_a in (((a, b), a_first, verdict.a_first), ((b, a), b_first, verdict.a_second)):
            orders.append({"first": first, "second": second, "win_probability": p_a,
                           "labels": [{"label": name, "logprob": finite(lp), "probability": p}
                                      for name, lp, p in zip(names, scores.logprobs, probabilities(scores))]})
        comparisons.append({"a": a, "b": b, "win_probability": verdict.win_probability, "orders": orders,
                            "flips": verdict.flips, "winner": verdict.winner})
    strengths = bradley_terry(len(request.answers), wins)
    order = sorted(range(len(strengths)), key=lambda i: -strengths[i])
    ranking = [{"index": i, "rank": r + 1, "strength": strengths[i]} for r, i in enumerate(order)]
    prompt_tokens = sum(len(p) for p in prompts) + len(prompts) * sum(len(c) for c in labels.bound.candidates)
    return {"id": f"judge-{uuid.uuid4().hex}", "object": "judge.pairwise", "created": int(time.time()),
            "model": engine.model_name, "logprobs_mode": mode.value, "comparisons": comparisons, "ranking": ranking,
            "usage": usage(prompt_tokens, sum(o.reused_tokens for o in outcomes))}
