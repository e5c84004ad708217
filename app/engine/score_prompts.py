"""A ScoreQuery -> its prompts and candidates as token ids and its SamplingParams, every input checked on the way."""

from __future__ import annotations

from app.engine.inputs import InputChecks, check_list_size
from app.engine.work import ScoreQuery
from app.errors import InvalidRequestError
from sampler import SamplingParams


class ScorePrompts:
    """Builds what a scoring query puts through the model; tokenizes (call it on the tokenizer thread)."""

    def __init__(self, tokenizer, checks: InputChecks):
        self.tokenizer = tokenizer
        self.checks = checks
        self.settings = checks.settings

    def _encode(self, text_or_ids: str | list[int], add_special_tokens: bool, param: str) -> list[int]:
        if isinstance(text_or_ids, str):
            return self.tokenizer(text_or_ids, add_special_tokens=add_special_tokens)["input_ids"]
        self.checks.token_ids(text_or_ids, param)
        return list(text_or_ids)

    def sampling_params(self, query: ScoreQuery) -> SamplingParams:
        """Validate the per-request options against this model and server, once, before any batching."""
        if query.candidates is not None:
            if query.label_token_ids is not None:
                raise InvalidRequestError("give either label_token_ids or candidates, not both", "candidates")
            if query.top_logprobs:
                raise InvalidRequestError("top_logprobs applies to label_token_ids; it is not available with candidates",
                                          "top_logprobs")
        elif query.label_token_ids is None:
            raise InvalidRequestError("label_token_ids (or candidates) is required", "label_token_ids")
        else:
            if not query.label_token_ids:
                raise InvalidRequestError("label_token_ids must not be empty", "label_token_ids")
            self.checks.label_ids(query.label_token_ids, "label_token_ids")
        self.checks.top_logprobs(query.top_logprobs, "top_logprobs")
        return self.checks.sampling(
            query.logprobs_mode, query.logit_bias, temperature=query.temperature, top_k=query.top_k,
            top_p=query.top_p, min_p=query.min_p, label_token_ids=tuple(query.label_token_ids or ()),
            top_logprobs=query.top_logprobs)

    def prompts(self, query: ScoreQuery) -> list[list[int]]:
        """Token sequences to score: the query alone, or query + each item (item + query with item_first)."""
        query_ids = self._encode(query.query, query.add_special_tokens, "query")
        if query.items is None:
            prompts = [query_ids]
        else:
            check_list_size(query.items, self.settings.max_items, "items", "item")
            prompts = []
            for i, item in enumerate(query.items):
                item_ids = self._encode(item, query.item_special_tokens, f"items[{i}]")
                prompts.append(item_ids + query_ids if query.item_first else query_ids + item_ids)
        limit = self.checks.max_prompt_tokens
        for i, ids in enumerate(prompts):
            param = "query" if query.items is None else f"items[{i}]"
            if ids and query.truncate_prompt_tokens is not None:
                if query.truncate_prompt_tokens > limit:
                    raise InvalidRequestError(
                        f"truncate_prompt_tokens = {query.truncate_prompt_tokens} exceeds the maximum prompt length "
                        f"{limit}", "truncate_prompt_tokens")
                prompts[i] = ids = ids[-query.truncate_prompt_tokens:]
            self.checks.prompt(ids, param, "; shorten it or set truncate_prompt_tokens")
        return prompts

    def candidates(self, query: ScoreQuery, prompts: list[list[int]]) -> tuple[tuple[int, ...], ...]:
        """The candidates as token ids (text tokenized alone, without special tokens); () for a label request."""
        if query.candidates is None:
            return ()
        check_list_size(query.candidates, self.settings.max_candidates, "candidates", "candidate")
        candidates = []
        for i, candidate in enumerate(query.candidates):
            ids = self._encode(candidate, False, f"candidates[{i}]")
            if not ids:
                raise InvalidRequestError("the candidate is empty (no tokens to score)", f"candidates[{i}]")
            candidates.append(tuple(ids))
        longest = max(len(c) for c in candidates)
        limit = self.checks.max_prompt_tokens
        for i, prompt in enumerate(prompts):
            if len(prompt) + longest > limit:
                raise InvalidRequestError(
                    f"the prompt ({len(prompt)} tokens) plus the longest candidate ({longest}) exceed the maximum of "
                    f"{limit} tokens", "query" if query.items is None else f"items[{i}]")
        return tuple(candidates)
