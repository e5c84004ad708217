"""The load-time self-check: every fast path against the plain transformers forward of the same weights, on a few
sequences longer than the model's smallest attention window; a path that disagrees is switched off, loudly."""

from __future__ import annotations

import inspect
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import PreTrainedModel

from models.attention_cuda import VARLEN_PATH, install_varlen
from models.compiled import compile_layers, uncompile_layers
from models.forward import forward_logits, run_one_at_a_time
from models.head import head_logits, set_head_linear
from models.invariant import make_batch_invariant
from models.packed import supports_packing, use_packed_attention
from models.prefix import (
    SuffixRow,
    can_pack_suffixes,
    forward_suffixes,
    prefill_prefixes,
    prefill_with_suffixes,
    supports_prefix_reuse,
    use_packed_suffixes,
)
from models.prepack import prepack_linears, prepacked_head, restore_linears

log = logging.getLogger("genscore.models")

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
# Why shared-prefix reuse does not apply: sliding-window or recurrent caches drop or transform states.
NOT_PLAIN_ATTENTION = "the model's cache is not plain full attention"
# Why suffixes over a shared prefix run one padded row each instead of packed (models/prefix.py).
UNPACKED_WHEN_INVARIANT = "batch-invariant: suffixes run in fixed-width rows of their own"
NO_BOOLEAN_MASK = "the model's attention is not SDPA, which reads the packed suffixes' boolean mask"
SHARED_PREFIX_OFF = "shared-prefix reuse is off"
# The verdict on batch invariance is reported as one more path, so /v1/models says whether numbers can move.
BATCH_INVARIANT = "batch_invariant"
NOT_REQUESTED = "not requested (--batch-invariant): a row's numbers may move by rounding with its batch"
# The compiled decoder layers (models/compiled.py): off unless asked for, since compiling costs seconds at start.
COMPILED_LAYERS = "compiled_layers"
COMPILE_NOT_REQUESTED = "not requested (--compile)"
NOT_COMPILED_WHEN_INVARIANT = "batch-invariant: compiled kernels are not proven to keep a row's bits"
COMPILE_NEEDS_PACKING = "compiled layers run packed calls, and this model's calls are not packed"
COMPILE_CPU_ONLY = "compiled layers are measured on CPU only"
# Reasons a path is not used that are not a disagreement (logged at info, not as a warning).
_NOT_USED = (NOT_PLAIN_ATTENTION, NOT_REQUESTED, UNPACKED_WHEN_INVARIANT, SHARED_PREFIX_OFF, COMPILE_NOT_REQUESTED,
             NOT_COMPILED_WHEN_INVARIANT)
# Lengths of the neighbours the invariance check batches the probe sequences with.
_NEIGHBOUR_LENGTHS = (3, 17, 33, 50)


@dataclass(frozen=True)
class PathCheck:
    """One fast path's verdict: on or off, its largest difference from the plain forward, and why it is off."""

    name: str
    enabled: bool
    difference: float | None
    reason: str = ""


@dataclass(frozen=True)
class FastPaths:
    """What the self-check decided for a model: each path's verdict, the tolerance it was held to, its cost."""

    checks: tuple[PathCheck, ...] = ()
    tolerance: float | None = None
    seconds: float = 0.0

    def enabled(self, name: str) -> bool:
        return any(check.name == name and check.enabled for check in self.checks)

    @property
    def batch_invariant(self) -> bool:
        """Whether every scoring path gives a row the same bits alone as in any batch (checked at load)."""
        return self.enabled(BATCH_INVARIANT)

    def as_dict(self) -> dict:
        return {"tolerance": self.tolerance, "seconds": round(self.seconds, 3),
                "paths": [asdict(check) for check in self.checks]}


def smallest_window(model: PreTrainedModel) -> int | None:
    """The shortest span any attention layer sees (sliding window or attention chunk), if the config sets one."""
    config = model.config.get_text_config()
    spans = [getattr(config, name, None) for name in ("sliding_window", "attention_chunk_size", "window_size")]
    spans = [span for span in spans if isinstance(span, int) and span > 0]
    return min(spans) if spans else None


@dataclass(frozen=True)
class _Probe:
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


def _make_probe(model: PreTrainedModel, vocab_size: int, max_length: int) -> _Probe:
    window = smallest_window(model)
    longest = min(max_length, _MAX_PROBE_LENGTH, window + _PAST_WINDOW if window else _NO_WINDOW_LENGTH)
    generator = torch.Generator().manual_seed(0)

    def tokens(n: int) -> list[int]:
        return torch.randint(0, vocab_size, (n,), generator=generator).tolist()  # any id the embedding holds

    long_prefix = tokens(max(1, longest - 9))
    return _Probe(long_prefix, tokens(6), (tokens(4), tokens(9), tokens(5)))


def _plain_logits(model: PreTrainedModel, sequences: list[list[int]], keep: list[int]):
    """The model's own forward, one unpadded sequence at a time: the logits of each one's last k positions
    [sum k, V], and the body's final hidden states at those positions [sum k, H] (seen by a hook, not rerun)."""
    takes_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
    seen: list[torch.Tensor] = []
    hook = model.base_model.register_forward_hook(lambda _m, _a, out: seen.append(out.last_hidden_state[0]))
    rows, hidden = [], []
    try:
        for seq, k in zip(sequences, keep):
            extra = {"logits_to_keep": k} if takes_keep else {}  # [k, V] instead of [len, V] at a 262k vocabulary
            rows.append(model(torch.tensor([seq], device=model.device), use_cache=False, **extra).logits[0, -k:])
            hidden.append(seen.pop()[-k:])
    finally:
        hook.remove()
    return torch.cat(rows), torch.cat(hidden)


def _error(got: torch.Tensor, reference: torch.Tensor, dtype: torch.dtype) -> float:
    """got: logits [N, V]; reference: float32 logprobs [N, V]; the difference measure of TOLERANCE's comment."""
    diff = (got.float().log_softmax(-1) - reference).abs()  # [N, V]
    if dtype == torch.float32:
        return diff.max().item()
    return (diff * reference.exp()).sum(-1).max().item()


def _check(name: str, tolerance: float, run) -> PathCheck:
    try:
        error = run()
    except Exception as exc:  # noqa: BLE001 - a path that cannot run at all is a path to switch off
        return PathCheck(name, False, None, f"{type(exc).__name__}: {exc}")
    if error != error or error > tolerance:  # NaN counts as disagreement
        return PathCheck(name, False, error, f"differs from the plain forward by {error:.3g} (tolerance {tolerance:g})")
    return PathCheck(name, True, error)


def _batch_difference(model: PreTrainedModel, probe: _Probe, neighbours: list[list[int]], pad_token_id: int,
                      prefix_reuse: bool) -> tuple[float, float | None]:
    """Largest |logit difference| of each probe sequence alone against the same sequence batched with neighbours
    (0.0 when bit-identical): through forward_logits, and (prefix_reuse) over prefilled prefixes."""
    sequences, keep = probe.sequences, probe.keep
    alone = torch.cat([forward_logits(model, [seq], pad_token_id, [k]) for seq, k in zip(sequences, keep)])
    mixed = [neighbours[0], sequences[0], neighbours[1], sequences[1], neighbours[2], sequences[2], neighbours[3]]
    mixed_keep = [1, keep[0], 2, keep[1], 1, keep[2], 3]
    rows = forward_logits(model, mixed, pad_token_id, mixed_keep).split(mixed_keep)
    batched = torch.cat([rows[1], rows[3], rows[5]])
    forward = (alone - batched).abs().max().item()
    if not prefix_reuse:
        return forward, None

    def suffix_logits(prefixes: list[list[int]], pairs: list[tuple[list[int], list[int], int]]) -> torch.Tensor:
        states = dict(zip(map(tuple, prefixes), prefill_prefixes(model, prefixes, pad_token_id)))
        return head_logits(model, forward_suffixes(
            model, [SuffixRow(states[tuple(p)], tuple(s), k) for p, s, k in pairs], pad_token_id))

    short, suffixes = probe.short_prefix, probe.suffixes
    alone = torch.cat([suffix_logits([short], [(short, suffixes[i], keep[i])]) for i in (1, 2)])
    other = neighbours[1][:5]
    rows = suffix_logits([probe.long_prefix, other, short], [
        (probe.long_prefix, suffixes[0], keep[0]), (short, suffixes[1], keep[1]), (other, neighbours[2], 2),
        (short, suffixes[2], keep[2]), (short, neighbours[3][:3], 1)]).split([keep[0], keep[1], 2, keep[2], 1])
    return forward, (alone - torch.cat([rows[1], rows[3]])).abs().max().item()


def _make_invariant(model: PreTrainedModel, probe: _Probe, vocab_size: int, max_length: int, pad_token_id: int,
                    checks: list[PathCheck], original_attention: str) -> PathCheck:
    """Make `model` batch-invariant and prove it on the probe; a path that still moves a row is switched off."""
    generator = torch.Generator().manual_seed(1)
    neighbours = [torch.randint(0, vocab_size, (min(n, max_length),), generator=generator).tolist()
                  for n in _NEIGHBOUR_LENGTHS]
    make_batch_invariant(model)
    reuse = any(c.name == "shared_prefix" and c.enabled for c in checks)
    try:
        forward, prefix = _batch_difference(model, probe, neighbours, pad_token_id, reuse)
        if forward != 0.0 and supports_packing(model):
            # one sequence per call is the same call alone and in a batch
            log.warning("packed batches move a row by %.3g on this model; running one sequence at a time", forward)
            model.set_attn_implementation(original_attention)
            run_one_at_a_time(model)
            checks[:] = [PathCheck(c.name, False, c.difference, f"not batch-invariant (moved a row by {forward:.3g})")
                         if c.name == "packed_batches" else c for c in checks]
            forward, prefix = _batch_difference(model, probe, neighbours, pad_token_id, reuse)
    except Exception as exc:  # noqa: BLE001 - a path that cannot run at all cannot be proven invariant
        return PathCheck(BATCH_INVARIANT, False, None, f"{type(exc).__name__}: {exc}")
    if prefix is not None and prefix != 0.0:
        checks[:] = [PathCheck(c.name, False, prefix, f"not batch-invariant (moved a row by {prefix:.3g})")
                     if c.name == "shared_prefix" else c for c in checks]
    if forward != 0.0:
        return PathCheck(BATCH_INVARIANT, False, forward, f"a batch moved a row by {forward:.3g}")
    return PathCheck(BATCH_INVARIANT, True, 0.0)


def _compile_check(model: PreTrainedModel, compile: bool, cache_dir: Path | None, batch_invariant: bool,
                   tolerance: float, error) -> PathCheck:
    """Compile the decoder layers for packed calls (if asked to) and keep them if they agree with the plain forward."""
    if not compile:
        return PathCheck(COMPILED_LAYERS, False, None, COMPILE_NOT_REQUESTED)
    if batch_invariant:
        return PathCheck(COMPILED_LAYERS, False, None, NOT_COMPILED_WHEN_INVARIANT)
    if model.device.type != "cpu":
        return PathCheck(COMPILED_LAYERS, False, None, COMPILE_CPU_ONLY)
    if not supports_packing(model):
        return PathCheck(COMPILED_LAYERS, False, None, COMPILE_NEEDS_PACKING)
    if not compile_layers(model, cache_dir):
        return PathCheck(COMPILED_LAYERS, False, None, "no decoder layers the compiled path can call")
    check = _check(COMPILED_LAYERS, tolerance, error)  # the first packed call compiles
    if not check.enabled:
        uncompile_layers(model)
    return check


@torch.inference_mode()
def install_fast_paths(model: PreTrainedModel, vocab_size: int, max_length: int, pad_token_id: int,
                       batch_invariant: bool = False, compile: bool = False,
                       cache_dir: Path | None = None) -> FastPaths:
    """Install each fast path on `model` and keep the ones that give the plain forward's numbers.

    Compared with the unmodified model's own forward on the same probe sequences (one of them longer
    than the smallest attention window): the output head genscore reads logits through (must agree,
    or the load fails), pre-packed linear weights (CPU), packed sequences or else padded micro-batches
    (else one sequence at a time), and shared-prefix key/value reuse, which the prefix cache and
    multi-token candidates read as well. A path that disagrees or raises is left off and logged.
    batch_invariant: then make every path batch-invariant (models/invariant.py) and prove it, bit for bit,
    on the probe sequences batched with others; a path that still moves a row is switched off.
    compile: compile the decoder layers for packed calls (models/compiled.py; CPU, not with batch_invariant),
    keeping inductor's cache under cache_dir (None: inductor's default).
    """
    started = time.perf_counter()
    tolerance = TOLERANCE.get(model.dtype, 0.1)
    probe = _make_probe(model, vocab_size, max_length)
    sequences, keep = probe.sequences, probe.keep
    plain_logits, plain_hidden = _plain_logits(model, sequences, keep)  # [N, V], [N, H]
    reference = plain_logits.float().log_softmax(-1)  # [N, V]
    checks = []
    head = _check("output_head", tolerance, lambda: _error(head_logits(model, plain_hidden), reference, model.dtype))
    if not head.enabled:
        raise RuntimeError(f"genscore cannot read this model's logits the way its own forward does: {head.reason}")
    checks.append(head)

    swaps = prepack_linears(model)
    if swaps:
        # A batch-invariant head runs the plain lm_head in row tiles (models/head.py), so no packed copy is held.
        set_head_linear(model, None if batch_invariant else prepacked_head(model))

        def prepacked_error() -> float:  # the body's packed linears, then the head view's packed lm_head
            body = _error(_plain_logits(model, sequences, keep)[0], reference, model.dtype)
            return max(body, _error(head_logits(model, plain_hidden), reference, model.dtype))

        prepacked = _check("prepacked_linears", tolerance, prepacked_error)
        if not prepacked.enabled:
            restore_linears(swaps)
            set_head_linear(model, None)
        checks.append(prepacked)
    swaps.clear()  # drop the original weights: nothing may restore them now

    def forward_error() -> float:  # the scoring forward (packed, padded or compiled, whichever is on)
        return _error(forward_logits(model, sequences, pad_token_id, keep), reference, model.dtype)

    original_attention = model.config._attn_implementation
    if use_packed_attention(model):
        packed = _check("packed_batches", tolerance, forward_error)
        if not packed.enabled:
            model.set_attn_implementation(original_attention)
        checks.append(packed)
    if not any(c.name == "packed_batches" and c.enabled for c in checks):
        padded = _check("padded_batches", tolerance, forward_error)
        if not padded.enabled:
            run_one_at_a_time(model)
        checks.append(padded)
    if supports_packing(model) and model.device.type == "cuda":  # one attention call per layer (flash attention)
        checks.append(install_varlen(model, batch_invariant, lambda: _check(VARLEN_PATH, tolerance, forward_error)))

    checks.append(_compile_check(model, compile, cache_dir, batch_invariant, tolerance, forward_error))

    if supports_prefix_reuse(model):
        distinct = [probe.long_prefix, probe.short_prefix]  # prefilled together (packed, or left-padded)

        def prefix_error() -> float:  # the prefixes prefilled first, their suffixes then over the states
            states = dict(zip(map(tuple, distinct), prefill_prefixes(model, distinct, pad_token_id)))
            rows = [SuffixRow(states[tuple(p)], tuple(s), k) for p, s, k in zip(probe.prefixes, probe.suffixes, keep)]
            return _error(head_logits(model, forward_suffixes(model, rows, pad_token_id)), reference, model.dtype)

        def packed_suffixes_error() -> float:  # and the prefixes run in the same call as their suffixes
            rows = [(distinct.index(p), s, k) for p, s, k in zip(probe.prefixes, probe.suffixes, keep)]
            _, hidden = prefill_with_suffixes(model, distinct, rows, pad_token_id)
            return max(prefix_error(), _error(head_logits(model, hidden), reference, model.dtype))

        checks.append(_check("shared_prefix", tolerance, prefix_error))
        if not checks[-1].enabled:
            checks.append(PathCheck("packed_suffixes", False, None, SHARED_PREFIX_OFF))
        elif batch_invariant:
            checks.append(PathCheck("packed_suffixes", False, None, UNPACKED_WHEN_INVARIANT))
        elif not can_pack_suffixes(model):
            checks.append(PathCheck("packed_suffixes", False, None, NO_BOOLEAN_MASK))
        else:
            use_packed_suffixes(model)
            checks.append(_check("packed_suffixes", tolerance, packed_suffixes_error))
            if not checks[-1].enabled:
                use_packed_suffixes(model, False)
    else:
        checks.append(PathCheck("shared_prefix", False, None, NOT_PLAIN_ATTENTION))
        checks.append(PathCheck("packed_suffixes", False, None, NOT_PLAIN_ATTENTION))

    if batch_invariant:
        checks.append(_make_invariant(model, probe, vocab_size, max_length, pad_token_id, checks, original_attention))
    else:
        checks.append(PathCheck(BATCH_INVARIANT, False, None, NOT_REQUESTED))

    report = FastPaths(tuple(checks), tolerance, time.perf_counter() - started)
    for check in checks:
        if check.enabled:
            log.info("fast path %s: on (difference %.2g from the plain forward)", check.name, check.difference)
        elif check.difference is None and check.reason in _NOT_USED:
            log.info("fast path %s: not used, %s", check.name, check.reason)
        else:
            log.warning("fast path %s: OFF, %s", check.name, check.reason)
    log.info("self-check of the fast paths took %.2f s (tolerance %g)", report.seconds, tolerance)
    return report

