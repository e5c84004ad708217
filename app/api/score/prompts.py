"""Scoring requests rendered as token ids: prompts from a query and items, candidates and label SamplingParams, every
input checked on the way (call it on the API layer's tokenizer thread, Front.on_tokenizer_thread: it tokenizes)."""

from __future__ import annotations

from collections.abc import Sequence

from app.api.inputs import InputChecks, check_list_size
from app.engine.work import prompt_param
from app.errors import InvalidRequestError
from sampler import LogprobsMode, SamplingParams

_HINT = "; shorten it or set truncate_prompt_tokens"


class ScorePrompts:
    """Builds what a scoring request puts through the model, for /score and the drop-in scoring routes alike."""

    def __init__(self, tokenizer, checks: InputChecks):
        self.tokenizer = tokenizer
        self.checks = checks
        self.settings = checks.settings

    def _encode(self, text_or_ids: str | Sequence[int], add_special_tokens: bool, param: str) -> list[int]:
        if isinstance(text_or_ids, str):
            return self.tokenizer(text_or_ids, add_special_tokens=add_special_tokens)["input_ids"]
        self.checks.token_ids(text_or_ids, param)
        return list(text_or_ids)

    def sampling_params(self, label_token_ids: list[int] | None, candidates: Sequence | None, top_logprobs: int = 0,
                        logprobs_mode: LogprobsMode | str | None = None, logit_bias: dict[str, float] | None = None,
                        **processors) -> SamplingParams:
        """Validate the per-request options against this model and server, once, before any batching."""
        if candidates is not None:
            if label_token_ids is not None:
                raise InvalidRequestError("give either label_token_ids or candidates, not both", "candidates")
            if top_logprobs:
                raise InvalidRequestError("top_logprobs applies to label_token_ids; it is not available with candidates",
                                          "top_logprobs")
        elif label_token_ids is None:
            raise InvalidRequestError("label_token_ids (or candidates) is required", "label_token_ids")
        else:
            if not label_token_ids:
                raise InvalidRequestError("label_token_ids must not be empty", "label_token_ids")
            self.checks.label_ids(label_token_ids, "label_token_ids")
        self.checks.top_logprobs(top_logprobs, "top_logprobs")
        return self.checks.sampling(logprobs_mode, logit_bias, label_token_ids=tuple(label_token_ids or ()),
                                    top_logprobs=top_logprobs, **processors)

    def prompts(self, query: str | list[int], items: list[str] | list[list[int]] | None, *, item_first: bool = False,
                add_special_tokens: bool = True, truncate_prompt_tokens: int | None = None) -> list[list[int]]:
        """Token sequences to score: the query alone, or query + each item (item + query with item_first). Items
        never get special tokens: they continue the query."""
        query_ids = self._encode(query, add_special_tokens, "query")
        if items is None:
            return self._checked([query_ids], "query", truncate_prompt_tokens)
        check_list_size(items, self.settings.max_items, "items", "item")
        prompts = []
        for i, item in enumerate(items):
            item_ids = self._encode(item, False, f"items[{i}]")
            prompts.append(item_ids + query_ids if item_first else query_ids + item_ids)
        return self._checked(prompts, "items", truncate_prompt_tokens)

    def whole_prompts(self, texts: list[str]) -> list[list[int]]:
        """Prompts given whole as `items` texts, each tokenized with the tokenizer's special tokens."""
        check_list_size(texts, self.settings.max_items, "items", "item")
        return self._checked([self._encode(text, True, f"items[{i}]") for i, text in enumerate(texts)], "items", None)

    def _checked(self, prompts: list[list[int]], param: str, truncate_prompt_tokens: int | None) -> list[list[int]]:
        limit = self.checks.max_prompt_tokens
        for i, ids in enumerate(prompts):
            if ids and truncate_prompt_tokens is not None:
                if truncate_prompt_tokens > limit:
                    raise InvalidRequestError(
                        f"truncate_prompt_tokens = {truncate_prompt_tokens} exceeds the maximum prompt length "
                        f"{limit}", "truncate_prompt_tokens")
                prompts[i] = ids = ids[-truncate_prompt_tokens:]
            self.checks.prompt(ids, prompt_param(param, i), _HINT)
        return prompts

    def candidates(self, candidates: Sequence[str | Sequence[int]] | None, prompts: list[list[int]], param: str
                   ) -> tuple[tuple[int, ...], ...]:
        """The candidates as token ids (text tokenized alone, without special tokens); () for a label request.
        `param` names the field the prompts came from, for a prompt that a candidate makes too long."""
        if candidates is None:
            return ()
        check_list_size(candidates, self.settings.max_candidates, "candidates", "candidate")
        token_ids = []
        for i, candidate in enumerate(candidates):
            ids = self._encode(candidate, False, f"candidates[{i}]")
            if not ids:
                raise InvalidRequestError("the candidate is empty (no tokens to score)", f"candidates[{i}]")
            token_ids.append(tuple(ids))
        longest = max(len(c) for c in token_ids)
        limit = self.checks.max_prompt_tokens
        for i, prompt in enumerate(prompts):
            if len(prompt) + longest > limit:
                raise InvalidRequestError(
                    f"the prompt ({len(prompt)} tokens) plus the longest candidate ({longest}) exceed the maximum of "
                    f"{limit} tokens", prompt_param(param, i))
        return tuple(token_ids)
