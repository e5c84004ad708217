"""The one memory budget, in bytes: what the engine's work may take on top of what the process holds once the model
is loaded and warm, and the checks that keep every scoring batch and generation step inside it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from app.engine.admission import most_that_fit
from models.memory import MemoryModel

# Rows of logits projected through lm_head and read by the sampler at a time (candidates, prompt logprobs): bounds
# the [rows, V] float32 tensors and their sampler copies, whatever the request.
LOGIT_ROWS_PER_CHUNK = 256
# Padded tokens of the scoring batch that decode rows always leave room for: a stream of ordinary /score requests
# never waits for a generation to finish; a larger batch waits until the rows it needs are free.
SCORING_RESERVE_TOKENS = 1024


class MemoryBudgetTooSmall(ValueError):
    """The budget does not cover what the loaded model already holds: the server cannot start."""


@dataclass(frozen=True)
class MemoryBudget:
    """Bytes for work: the budget minus the process at ready (weights, libraries, warm-up), the prefix cache and
    room to build the largest response the request limits allow.

    Scoring batches and generation steps run one after the other on the device thread, so their transients never
    meet; what stays between them is the decode cache. A scoring batch gets the work bytes the cache leaves; decode
    rows and prefills get the work bytes minus a reserve for one ordinary scoring batch. Each piece of work is
    admitted by its worst-case bytes (models/memory.py), so memory is bounded by construction.
    """

    memory: MemoryModel
    total_bytes: int
    baseline_bytes: int  # resident when ready
    prefix_cache_bytes: int
    response_bytes: int
    work_bytes: int
    scoring_reserve_bytes: int

    @classmethod
    def of(cls, memory: MemoryModel, total_bytes: int, baseline_bytes: int, prefix_cache_bytes: int,
           largest_response_values: int, max_batch_tokens: int) -> MemoryBudget:
        response = memory.response_bytes(largest_response_values)
        work = total_bytes - baseline_bytes - prefix_cache_bytes - response
        reserve = scoring_batch_bytes(memory, min(max_batch_tokens, SCORING_RESERVE_TOKENS))
        if work <= reserve:
            gib = 2**30
            raise MemoryBudgetTooSmall(
                f"the memory budget ({total_bytes / gib:.2f} GiB, --memory-budget) does not cover what the loaded "
                f"model already holds ({baseline_bytes / gib:.2f} GiB resident), the prefix cache "
                f"({prefix_cache_bytes / gib:.2f} GiB, --prefix-cache-mb), the largest response the request limits "
                f"allow ({response / gib:.2f} GiB) and one scoring batch ({reserve / gib:.2f} GiB)")
        return cls(memory, total_bytes, baseline_bytes, prefix_cache_bytes, response, work, reserve)

    # --- scoring ---------------------------------------------------------------------
    def scoring_tokens(self, cache_rows: int, cache_final: int, max_batch_tokens: int) -> int:
        """The most padded tokens a scoring batch may hold beside a decode cache of rows x final (at least 1)."""
        room = self.work_bytes - (self.memory.cache_bytes(cache_rows, cache_final) if cache_rows else 0)
        return most_that_fit(1, max_batch_tokens, lambda tokens: scoring_batch_bytes(self.memory, tokens) <= room)

    def scoring_unit_fits(self, prompt_len: int, candidates: tuple[tuple[int, ...], ...]) -> bool:
        """Whether one prompt (with its candidate rows) fits the work bytes alone. Its rows run in chunks of
        LOGIT_ROWS_PER_CHUNK kept positions, so its own cost in padded tokens can exceed any batch's."""
        longest_candidate = max((len(c) for c in candidates), default=0)
        width = prompt_len + longest_candidate
        rows = min(max(1, len(candidates)), max(1, LOGIT_ROWS_PER_CHUNK // max(1, longest_candidate)))
        kept = min(rows * max(1, longest_candidate), LOGIT_ROWS_PER_CHUNK)
        return self.memory.forward_bytes(rows, rows * width, kept, longest=width) <= self.work_bytes

    # --- generation ------------------------------------------------------------------
    def step_bytes(self, rows: int, final: int, prefill_rows: int, prefill_width: int) -> int:
        """Worst case of one generation step: the cache of `rows` rows grown to `final`, and on top of it the larger
        of the decode step and the prefill of `prefill_rows` prompts of `prefill_width` tokens (they run one after
        the other; the prefill's states are counted in the cache they join)."""
        m = self.memory
        prefill = 0
        if prefill_rows:  # the last position of every prompt, and prompt logprobs a chunk at a time
            kept = prefill_rows + min(prefill_width, LOGIT_ROWS_PER_CHUNK)
            prefill = m.forward_bytes(prefill_rows, prefill_rows * prefill_width, kept, longest=prefill_width)
        cache = m.cache_bytes(rows, final) if rows else 0
        return cache + max(m.decode_step_bytes(rows, final) if rows else 0, prefill)

    def generation_fits(self, rows: int, final: int, prefill_rows: int, prefill_width: int) -> bool:
        return self.step_bytes(rows, final, prefill_rows, prefill_width) <= self.work_bytes - self.scoring_reserve_bytes


def baseline_bytes(device: torch.device) -> int:
    """What the loaded model holds where its work runs: the tensors torch has allocated on a GPU (weights and
    warm-up leftovers), the process's resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    return resident_bytes()


def resident_bytes() -> int:
    """This process's resident set size now (VmRSS)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("VmRSS missing from /proc/self/status")


def scoring_batch_bytes(memory: MemoryModel, tokens: int) -> int:
    """Worst case of a scoring batch of `tokens` padded tokens: one sequence (the widest attention mask), logits of
    up to one chunk of kept positions, and the key/value states of one call that computes shared queries (a query
    runs with its items, models/prefix.py: the call's states live until the query's are copied out of them)."""
    call = min(tokens, memory.pack_tokens) if memory.pack_tokens else tokens
    states = 2 * call * memory.kv_bytes_per_token  # the call's states and the copy taken of them
    return memory.forward_bytes(1, tokens, min(tokens, LOGIT_ROWS_PER_CHUNK)) + states
