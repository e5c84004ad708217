"""The one memory budget, in bytes: what the engine's work may take on top of what the process holds once the model
is loaded and warm, split between decode rows and scoring batches, with the checks that keep every step inside it."""

from __future__ import annotations

from dataclasses import dataclass

from models.memory import MemoryModel

# Rows of logits projected through lm_head and read by the sampler at a time (candidates, prompt logprobs): bounds
# the [rows, V] float32 tensors and their sampler copies, whatever the request.
LOGIT_ROWS_PER_CHUNK = 256


class MemoryBudgetTooSmall(ValueError):
    """The budget does not cover what the loaded model already holds: the server cannot start."""


@dataclass(frozen=True)
class MemoryBudget:
    """Bytes for work: the budget minus the process at ready (weights, libraries, warm-up), the prefix cache and
    room to build the largest response the request limits allow.

    Scoring keeps a slice of its own (room for one full batch of max_batch_tokens, at most half the work bytes), so
    a scoring request never waits for decode rows to finish; decode rows and prefills share the rest. Each piece of
    work is admitted by its worst-case bytes (models/memory.py), so memory is bounded by construction.
    """

    memory: MemoryModel
    total_bytes: int
    baseline_bytes: int  # resident when ready
    prefix_cache_bytes: int
    response_bytes: int
    scoring_bytes: int
    generation_bytes: int

    @classmethod
    def split(cls, memory: MemoryModel, total_bytes: int, baseline_bytes: int, prefix_cache_bytes: int,
              largest_response_values: int, max_batch_tokens: int) -> MemoryBudget:
        response = memory.response_bytes(largest_response_values)
        work = total_bytes - baseline_bytes - prefix_cache_bytes - response
        if work <= 0:
            gib = 2**30
            raise MemoryBudgetTooSmall(
                f"the memory budget ({total_bytes / gib:.2f} GiB, --memory-budget) is below what the loaded model "
                f"already holds ({baseline_bytes / gib:.2f} GiB resident) plus the prefix cache "
                f"({prefix_cache_bytes / gib:.2f} GiB, --prefix-cache-mb) and the largest response the request "
                f"limits allow ({response / gib:.2f} GiB)")
        scoring = min(_scoring_batch_bytes(memory, max_batch_tokens), work // 2)
        return cls(memory, total_bytes, baseline_bytes, prefix_cache_bytes, response, scoring, work - scoring)

    # --- scoring ---------------------------------------------------------------------
    def scoring_tokens(self, max_batch_tokens: int) -> int:
        """The most padded tokens one scoring batch may hold within the scoring slice (at least 1)."""
        low, high = 1, max_batch_tokens
        while low < high:
            mid = (low + high + 1) // 2
            if _scoring_batch_bytes(self.memory, mid) <= self.scoring_bytes:
                low = mid
            else:
                high = mid - 1
        return low

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
        return m.cache_bytes(rows, final) + max(m.decode_step_bytes(rows, final) if rows else 0, prefill)

    def generation_fits(self, rows: int, final: int, prefill_rows: int, prefill_width: int) -> bool:
        return self.step_bytes(rows, final, prefill_rows, prefill_width) <= self.generation_bytes

    def as_dict(self) -> dict:
        return {"total_bytes": self.total_bytes, "baseline_bytes": self.baseline_bytes,
                "prefix_cache_bytes": self.prefix_cache_bytes, "response_bytes": self.response_bytes,
                "scoring_bytes": self.scoring_bytes,
                "generation_bytes": self.generation_bytes}


def resident_bytes() -> int:
    """This process's resident set size now (VmRSS)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("VmRSS missing from /proc/self/status")


def _scoring_batch_bytes(memory: MemoryModel, tokens: int) -> int:
    """Worst case of a scoring batch of `tokens` padded tokens: one sequence (the widest attention mask), logits of
    up to one chunk of kept positions."""
    return memory.forward_bytes(1, tokens, min(tokens, LOGIT_ROWS_PER_CHUNK))
