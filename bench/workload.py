"""Deterministic benchmark workloads: single prompts with 2-10 labels (20-200 or 23-51 tokens), and queries with items."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

# Plain English words: prompts read like text, so the model's next-token distribution is realistic
# and the share of labels outside a peer's top-k means something.
_WORDS = (
    "the of and to in is was for on that with as by at from his her it an were are which this be "
    "has had one their not but who they also first new after been more its two there other all when "
    "time into year years would between during most some only over can such many about than these "
    "people while city world later used made both under where well may three then high known part "
    "state game team house water school music family river market story energy light small "
    "great little early long public local young power night morning garden letter doctor village "
    "country question answer reason moment money history science language nature window child road"
).split()
# Label words: common next tokens (single tokens in SmolLM2's vocabulary, checked at build time).
_LABEL_WORDS = [
    " " + word
    for word in (
        "yes no the a of and to in is was it he she they we you I not good bad true false one two three "
        "positive negative neutral A B C D this that for on with as by at from"
    ).split()
]


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload: a query, optional items, and the label token ids to score."""

    query: list[int]
    labels: list[int]
    items: list[list[int]] | None = None
    prompts: list[list[int]] = field(default_factory=list)  # the sequences actually scored, in order

    @property
    def tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    def score_body(self) -> dict:
        """The genscore /score body (token ids in, so every system sees the same tokens)."""
        body = {"query": self.query, "label_token_ids": self.labels}
        if self.items is not None:
            body["items"] = self.items
        return body


def _text_ids(tokenizer, rng: random.Random, n_tokens: int) -> list[int]:
    words = [rng.choice(_WORDS) for _ in range(n_tokens * 2)]
    words[0] = words[0].capitalize()
    ids = tokenizer(" ".join(words), add_special_tokens=False)["input_ids"]
    return ids[:n_tokens]


def label_pool(tokenizer) -> list[int]:
    """Token ids of the label words that are single tokens."""
    pool = []
    for word in _LABEL_WORDS:
        ids = tokenizer(word, add_special_tokens=False)["input_ids"]
        if len(ids) == 1 and ids[0] not in pool:
            pool.append(ids[0])
    return pool


def scoring_workload(tokenizer, n: int, seed: int = 0, min_tokens: int = 20, max_tokens: int = 200
                     ) -> list[BenchRequest]:
    """n prompts of min_tokens-max_tokens tokens, each with 2-10 labels."""
    rng = random.Random(seed)
    pool = label_pool(tokenizer)
    out = []
    for _ in range(n):
        query = _text_ids(tokenizer, rng, rng.randint(min_tokens, max_tokens))
        labels = rng.sample(pool, rng.randint(2, 10))
        out.append(BenchRequest(query=query, labels=labels, prompts=[query]))
    return out


def short_workload(tokenizer, n: int, seed: int = 2) -> list[BenchRequest]:
    """n classification-style prompts of 23-51 tokens, each with 2-10 labels: per-request overhead dominates."""
    return scoring_workload(tokenizer, n, seed=seed, min_tokens=23, max_tokens=51)


def items_workload(tokenizer, n: int, seed: int = 1) -> list[BenchRequest]:
    """n queries of 30-120 tokens, each with 3-8 items of 5-40 tokens and 2-5 labels."""
    rng = random.Random(seed)
    pool = label_pool(tokenizer)
    out = []
    for _ in range(n):
        query = _text_ids(tokenizer, rng, rng.randint(30, 120))
        items = [_text_ids(tokenizer, rng, rng.randint(5, 40)) for _ in range(rng.randint(3, 8))]
        labels = rng.sample(pool, rng.randint(2, 5))
        out.append(BenchRequest(query=query, labels=labels, items=items, prompts=[query + it for it in items]))
    return out


def yes_no_labels(tokenizer) -> list[int]:
    """The token ids of " Yes" and " No", the labels of a relevance judgement."""
    ids = [tokenizer(word, add_special_tokens=False)["input_ids"] for word in (" Yes", " No")]
    if any(len(i) != 1 for i in ids):
        raise ValueError(f'" Yes" / " No" are not single tokens in this vocabulary: {ids}')
    return [i[0] for i in ids]


def long_items_workload(tokenizer, n: int, seed: int = 3) -> list[BenchRequest]:
    """n queries of 150-400 tokens, each with 20-50 items of 8-30 tokens, labels " Yes" / " No" (reranking)."""
    rng = random.Random(seed)
    labels = yes_no_labels(tokenizer)
    out = []
    for _ in range(n):
        query = _text_ids(tokenizer, rng, rng.randint(150, 400))
        items = [_text_ids(tokenizer, rng, rng.randint(8, 30)) for _ in range(rng.randint(20, 50))]
        out.append(BenchRequest(query=query, labels=labels, items=items, prompts=[query + it for it in items]))
    return out


# name -> (builder, the bench option giving its request count, whether its prompts share a query)
WORKLOADS = {
    "scoring": (scoring_workload, "scoring_requests", False),
    "items": (items_workload, "items_requests", True),
    "short": (short_workload, "short_requests", False),
    "long-items": (long_items_workload, "long_items_requests", True),
}
