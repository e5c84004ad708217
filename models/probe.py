"""The self-check's probe: a few sequences longer than the model's smallest attention window, the plain forward's
numbers on them, and how far a fast path's numbers may move from those."""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedModel

from models.plan import PathCheck

# How far a fast path may move the numbers from the plain forward's. A path that drops part of the model's math
# (a window, a logit scale) moves them by whole nats (0.3 to 17 on the conformance zoo); a path that only
# reorders sums moves them by rounding, and the tolerance sits well above that and far below the former.
# float32: the largest |logprob difference| over every token. Rounding alone reaches 1.3e-4 on Gemma-3-270M
# (logits near 50 over a 262k vocabulary), where the plain forward itself moves by 8e-5 between asking for
# the last few positions' logits and asking for all of them; so 1e-3 here, while the tests hold what a request
# returns to 1e-4. Half precision rounds every intermediate result and moves single logprobs by up to ~0.5
# nats (SmolLM2-135M in bfloat16): there the measure is the expected |logprob difference| under the plain
# forward's distribution at the worst position (0.07 on SmolLM2-135M's correct paths).
TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 0.25, torch.float16: 0.1}
# Extra tokens past the smallest attention window in the long probe, and its length when there is no window.
_PAST_WINDOW = 24
_NO_WINDOW_LENGTH = 40
# Cap on the long probe: a model with a 4096-token window would otherwise need minutes of CPU per check. Windows
# up to ~1000 tokens are crossed by the probe; past that the check runs the paths without crossing one.
_MAX_PROBE_LENGTH = 1024

def smallest_window(model: PreTrainedModel) -> int | None:
    """The shortest span any attention layer sees (sliding window or attention chunk), if the config sets one."""
    config = model.config.get_text_config()
    spans = [getattr(config, name, None) for name in ("sliding_window", "attention_chunk_size", "window_size")]
    spans = [span for span in spans if isinstance(span, int) and span > 0]
    return min(spans) if spans else None


@dataclass(frozen=True)
class Probe:
    """Three sequences of mixed lengths as two prefixes with suffixes: long_prefix + a runs past the smallest
    window, and two suffixes share short_prefix (the prefix cache's case: one prefix, several suffixes)."""

    long_prefix: list[int]
    short_prefix: list[int]
    suffixes: tuple[list[int], list[int], list[int]]  # the first follows long_prefix, the others short_prefix

    @property
    def sequences(self) -> list[list[int]]:
        return [prefix + suffix for prefix, suffix in zip(self.prefixes, self.suffixes)]

    @property
    def prefixes(self) -> list[list[int]]:
        return [self.long_prefix, self.short_prefix, self.short_prefix]

    @property
    def keep(self) -> list[int]:
        """Positions compared per sequence: the one before each suffix token, and the last."""
        return [len(s) + 1 for s in self.suffixes]


def make_probe(model: PreTrainedModel, vocab_size: int, max_length: int) -> Probe:
    window = smallest_window(model)
    longest = min(max_length, _MAX_PROBE_LENGTH, window + _PAST_WINDOW if window else _NO_WINDOW_LENGTH)
    generator = torch.Generator().manual_seed(0)

    def tokens(n: int) -> list[int]:
        return torch.randint(0, vocab_size, (n,), generator=generator).tolist()  # any id the embedding holds

    long_prefix = tokens(max(1, longest - 9))
    return Probe(long_prefix, tokens(6), (tokens(4), tokens(9), tokens(5)))



def plain_logits(model: PreTrainedModel, body: nn.Module, sequences: list[list[int]], keep: list[int]):
    """The model's own forward, one unpadded sequence at a time: the logits of each one's last k positions
    [sum k, V], and the body's final hidden states at those positions [sum k, H] (seen by a hook, not rerun)."""
    takes_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
    seen: list[torch.Tensor] = []
    hook = body.register_forward_hook(lambda _m, _a, out: seen.append(out.last_hidden_state[0]))
    rows, hidden = [], []
    try:
        for seq, k in zip(sequences, keep):
            extra = {"logits_to_keep": k} if takes_keep else {}  # [k, V] instead of [len, V] at a 262k vocabulary
            rows.append(model(torch.tensor([seq], device=model.device), use_cache=False, **extra).logits[0, -k:])
            hidden.append(seen.pop()[-k:])
    finally:
        hook.remove()
    return torch.cat(rows), torch.cat(hidden)


def logprob_error(got: torch.Tensor, reference: torch.Tensor, dtype: torch.dtype) -> float:
    """got: logits [N, V]; reference: float32 logprobs [N, V]; the difference measure of TOLERANCE's comment."""
    diff = (got.float().log_softmax(-1) - reference).abs()  # [N, V]
    if dtype == torch.float32:
        return diff.max().item()
    return (diff * reference.exp()).sum(-1).max().item()


def check_path(name: str, tolerance: float, run) -> PathCheck:
    try:
        error = run()
    except Exception as exc:  # noqa: BLE001 - a path that cannot run at all is a path to switch off
        return PathCheck(name, False, None, f"{type(exc).__name__}: {exc}")
    if error != error or error > tolerance:  # NaN counts as disagreement
        return PathCheck(name, False, error, f"differs from the plain forward by {error:.3g} (tolerance {tolerance:g})")
    return PathCheck(name, True, error)
