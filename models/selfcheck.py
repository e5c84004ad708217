"""The load-time self-check: every fast path against the plain transformers forward of the same weights, on a few
sequences longer than the model's smallest attention window; a path that disagrees is switched off, loudly."""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn
from transformers import PreTrainedModel

from models import cuda_graphs
from models.attention_cpu import CPU_VARLEN, build_error, model_cpu_varlen_refusal
from models.attention_cuda import VARLEN, VARLEN_PATH, model_varlen_refusal, runs_varlen_on
from models.body import find_body, returned_cache
from models.cache_reuse import stateful_layers
from models.cascade import CASCADE, CASCADE_PATH, NEEDS_PACKED_SUFFIXES, model_refusal
from models.compiled import compile_layers, uncompile_layers
from models.cuda_graphs import GRAPHS_PATH
from models.decoding import decode_step, prefill
from models.forward import forward_logits
from models.fused_linears import find_groups, fuse_linears, restore_members
from models.head import build_head, head_logits
from models.invariant import make_batch_invariant
from models.packed import use_packed_attention
from models.plan import ForwardPlan, PathCheck
from models.prefix import (
    SuffixRow,
    can_pack_suffixes,
    forward_suffixes,
    prefill_prefixes,
    prefill_with_suffixes,
    supports_prefix_reuse,
)
from models.prepack import (
    AMX_PRESENT,
    NO_AVX512,
    NO_AVX512_BF16,
    PrepackedLinear,
    cpu_refusal,
    kernel_refusal,
    prepack_linears,
    prepacked_head,
    restore_linears,
)
from models.probe import TOLERANCE, Probe, check_path, logprob_error, make_probe, plain_logits

log = logging.getLogger("genscore.models")

# Why shared-prefix reuse does not apply: sliding-window or recurrent caches drop or transform states.
NOT_PLAIN_ATTENTION = "the model's cache is not plain full attention"
# Shared-prefix reuse through a copy of the model's whole cache, where key/value reuse does not apply.
WHOLE_CACHE_PREFIX = "whole_cache_prefix"
# Why an attention-only model whose cache is not plain full attention (sliding windows, chunks) reuses no prefix:
# its items run from scratch in the batch's packed or padded calls, which beats one copy of the cache per item
# unless the shared query is long.
RUNS_FROM_SCRATCH = "no layer carries state: items run from scratch with the rest of the batch"
# Why suffixes over a shared prefix run one padded row each instead of packed (models/prefix.py).
UNPACKED_WHEN_INVARIANT = "batch-invariant: suffixes run in fixed-width rows of their own"
NO_BOOLEAN_MASK = "the model's attention is not SDPA, which reads the packed suffixes' boolean mask"
SHARED_PREFIX_OFF = "shared-prefix reuse is off"
# Why packed attention keeps its per-segment loop on a batch-invariant model.
VARLEN_WHEN_INVARIANT = "batch-invariant: its splits of long rows are not proven to keep a row's bits"
GRAPHS_NEED_VARLEN = "the packed attention runs the per-segment loop, whose boundaries a graph would fix at capture"
# Decode steps' attention through the CPU decode kernel (models/attention_cpu.py decode_attention_cpu).
DECODE_KERNEL_PATH = "cpu_decode_attention"
DECODE_NEEDS_BATCHED = "decode steps do not run batched in a key/value cache through genscore's packed attention"
# Linears that read one input run as one wider GEMM (models/fused_linears.py).
FUSED_LINEARS = "fused_linears"
FUSED_WHEN_INVARIANT = "batch-invariant: each linear runs in fixed row tiles of its own"
NO_SHARED_INPUTS = "no two linears read the same input"
# Pre-packed linears through genscore's own kernel (models/csrc/linear.cpp) instead of oneDNN's.
LINEAR_KERNEL = "cpu_linear_kernel"
NO_SHAPE_FITS = "no linear's shape fits its blocks of 32 outputs (and, in bfloat16, pairs of inputs)"
# The verdict on batch invariance is reported as one more path, so /v1/models says whether numbers can move.
BATCH_INVARIANT = "batch_invariant"
NOT_REQUESTED = "not requested (--batch-invariant): a row's numbers may move by rounding with its batch"
# The compiled decoder layers (models/compiled.py): off unless asked for, since compiling costs seconds at start.
COMPILED_LAYERS = "compiled_layers"
COMPILE_NOT_REQUESTED = "not requested (--compile)"
NOT_COMPILED_WHEN_INVARIANT = "batch-invariant: compiled kernels are not proven to keep a row's bits"
COMPILE_NEEDS_PACKING = "compiled layers run packed calls, and this model's calls are not packed"
COMPILE_CPU_ONLY = "compiled layers are measured on CPU only"
# Why packing and batched decoding are off for a model whose layers carry state from one position to the next
# (recurrent, convolution, linear attention): packed sequences would run into each other, and those states cannot
# be re-laid out in a shared key/value cache.
CARRIES_STATE = "layers carry state across positions"
# Why whole-cache reuse and cached decoding are off for a model whose forward hands back no cache object.
NO_CACHE_OBJECT = "the model keeps its state inside its modules and hands back no cache"
# Reasons a path is not used that are not a disagreement (logged at info, not as a warning).
_NOT_USED = (NOT_PLAIN_ATTENTION, NOT_REQUESTED, UNPACKED_WHEN_INVARIANT, SHARED_PREFIX_OFF, COMPILE_NOT_REQUESTED,
             NOT_COMPILED_WHEN_INVARIANT, CARRIES_STATE, NO_CACHE_OBJECT, RUNS_FROM_SCRATCH, VARLEN_WHEN_INVARIANT,
             GRAPHS_NEED_VARLEN, NEEDS_PACKED_SUFFIXES, DECODE_NEEDS_BATCHED, FUSED_WHEN_INVARIANT,
             NO_SHARED_INPUTS, NO_AVX512, NO_AVX512_BF16, AMX_PRESENT, NO_SHAPE_FITS)
# Lengths of the neighbours the invariance check batches the probe sequences with; the last is longer than any
# attention kernel's segment bound (models/attention_cpu.py MAX_SEGMENT), so a kernel that switched a whole row to
# another path for one long prompt would be caught.
_NEIGHBOUR_LENGTHS = (3, 17, 33, 400)


class PlainForwardError(RuntimeError):
    """The model's own forward fails on a plain sequence: nothing can serve it."""


def _failed(name: str, stage: str, exc: Exception) -> PathCheck:
    """A path whose installing or probing raised: off, with the error."""
    return PathCheck(name, False, None, f"{stage} raised {type(exc).__name__}: {exc}")


class _Checker:
    """The self-check's state: the probe, the plain forward's numbers on it, and the plan as it grows."""

    def __init__(self, model: PreTrainedModel, plan: ForwardPlan, probe: Probe, reference: torch.Tensor,
                 plain_hidden: torch.Tensor, tolerance: float, pad_token_id: int):
        self.model, self.plan, self.probe = model, plan, probe
        self.reference, self.plain_hidden = reference, plain_hidden
        self.tolerance, self.pad = tolerance, pad_token_id
        self.checks: list[PathCheck] = []

    def error(self, logits: torch.Tensor) -> float:
        return logprob_error(logits, self.reference, self.model.dtype)

    def body_error(self) -> float:
        """The model's own forward, each probe sequence alone, through its body's modules as they are now."""
        return self.error(plain_logits(self.model, self.plan.body, self.probe.sequences, self.probe.keep)[0])

    def forward_error(self, plan: ForwardPlan) -> float:
        """The scoring forward of `plan` (packed, padded or compiled, whichever it says)."""
        return self.error(forward_logits(self.model, plan, self.probe.sequences, self.pad, self.probe.keep))

    def prefix_error(self, plan: ForwardPlan) -> float:
        """The prefixes prefilled first, their suffixes then over the states."""
        probe, model = self.probe, self.model
        distinct = [probe.long_prefix, probe.short_prefix]
        states = dict(zip(map(tuple, distinct), prefill_prefixes(model, plan, distinct, self.pad)))
        rows = [SuffixRow(states[tuple(p)], tuple(s), k) for p, s, k in zip(probe.prefixes, probe.suffixes, probe.keep)]
        return self.error(head_logits(plan, forward_suffixes(model, plan, rows, self.pad)))

    def packed_suffixes_error(self, plan: ForwardPlan) -> float:
        """And the prefixes run in the same call as their suffixes."""
        probe = self.probe
        distinct = [probe.long_prefix, probe.short_prefix]
        rows = [(distinct.index(p), s, k) for p, s, k in zip(probe.prefixes, probe.suffixes, probe.keep)]
        _, hidden = prefill_with_suffixes(self.model, plan, distinct, rows, self.pad)
        return max(self.prefix_error(plan), self.error(head_logits(plan, hidden)))

    def decoding_error(self, plan: ForwardPlan, steps: int = 3) -> float:
        """Two probe sequences prefilled without their last `steps` tokens, then fed them one decode step at a time:
        the logits of the last steps + 1 positions of each against the plain forward's."""
        model, probe = self.model, self.probe
        sequences = probe.sequences[:2]
        hidden, batch = prefill(model, plan, [seq[:-steps] for seq in sequences], self.pad)
        got = [head_logits(plan, hidden[:, -1, :])]  # [2, V] per step
        for step in range(steps):
            tokens = torch.tensor([seq[len(seq) - steps + step] for seq in sequences], dtype=torch.long)
            got.append(decode_step(model, plan, batch, tokens))
        stacked = torch.stack(got, dim=1)  # [2, steps + 1, V]
        ends = torch.tensor(probe.keep).cumsum(0).tolist()
        reference = torch.cat([self.reference[end - steps - 1 : end] for end in ends[:2]])  # [2 * (steps + 1), V]
        return logprob_error(stacked.reshape(-1, stacked.shape[-1]), reference, model.dtype)

    def record(self, check: PathCheck) -> bool:
        self.checks.append(check)
        return check.enabled

    def attempt(self, name: str, candidate: ForwardPlan, measure) -> bool:
        """Keep `candidate` as the plan when `measure(candidate)` agrees with the plain forward."""
        if self.record(check_path(name, self.tolerance, lambda: measure(candidate))):
            self.plan = candidate
            return True
        return False


def _prepacked(checker: _Checker, batch_invariant: bool, cache_dir: Path | None) -> None:
    """Pre-packed linear weights in the body and (unless batch-invariant) a pre-packed copy of lm_head, for genscore's
    linear where it serves them (built or loaded from cache_dir first), else for oneDNN's; then those that read one
    input fused (_fused, from the original weights, dropped after it)."""
    model, plan = checker.model, checker.plan
    swaps = []
    try:
        on_cpu = model.device.type == "cpu"
        if on_cpu and cpu_refusal(model.dtype) is None:
            build_error(cache_dir)  # the linear lives in the library of genscore's CPU kernels
        swaps = prepack_linears(model, plan.body)
        if not swaps:
            return
        # A batch-invariant head runs the plain lm_head in row tiles (models/head.py), so no packed copy is held.
        held = None if batch_invariant else prepacked_head(model)
        candidate = replace(plan, head=build_head(model, plan.body, held) if held is not None else plan.head,
                            held_head=held)

        def prepacked_error(candidate: ForwardPlan) -> float:  # the body's packed linears, then the packed head
            return max(checker.body_error(), checker.error(head_logits(candidate, checker.plain_hidden)))

        if not checker.attempt("prepacked_linears", candidate, prepacked_error):
            restore_linears(swaps)
            return
        if on_cpu:
            checker.record(_linear_kernel_check(checker))
        if batch_invariant:
            checker.record(PathCheck(FUSED_LINEARS, False, None, FUSED_WHEN_INVARIANT))
        else:
            _fused(checker, {id(getattr(parent, name)): linear for parent, name, linear in swaps})
    except Exception as exc:  # noqa: BLE001 - installing the path failed: the plain linears serve
        restore_linears(swaps)
        checker.record(_failed("prepacked_linears", "installing", exc))
    finally:
        swaps.clear()  # drop the original weights: nothing may restore them now


def _linear_kernel_check(checker: _Checker) -> PathCheck:
    """Whether the proven pre-packed linears run genscore's linear (their weights in its blocks)."""
    blocked = [m for m in checker.model.modules() if isinstance(m, PrepackedLinear) and m.packed_weight.dim() == 4]
    if blocked:
        return PathCheck(LINEAR_KERNEL, True, checker.checks[-1].difference, "")  # the prepacked linears' check
    return PathCheck(LINEAR_KERNEL, False, None, kernel_refusal(checker.model.dtype) or NO_SHAPE_FITS)


def _fused(checker: _Checker, originals: dict[int, nn.Linear]) -> None:
    """Pre-packed linears that one forward of the body calls on the same input, each group run as one GEMM
    (models/fused_linears.py), kept if the body's forward still agrees with the plain one."""
    model, probe, body = checker.model, checker.probe, checker.plan.body
    swaps = []
    try:
        groups = find_groups(body, lambda: plain_logits(model, body, probe.sequences[:1], probe.keep[:1]))
        if not groups:
            checker.record(PathCheck(FUSED_LINEARS, False, None, NO_SHARED_INPUTS))
            return
        swaps = fuse_linears(groups, originals)
        if not checker.attempt(FUSED_LINEARS, checker.plan, lambda _: checker.body_error()):
            restore_members(swaps)
    except Exception as exc:  # noqa: BLE001 - installing the path failed: each linear runs alone
        restore_members(swaps)
        checker.record(_failed(FUSED_LINEARS, "installing", exc))


def _layout(checker: _Checker) -> None:
    """Packed sequences where attention is SDPA and no layer carries state across positions, else padded
    micro-batches, else each sequence alone (the plain path)."""
    model, plan = checker.model, checker.plan
    original_attention = model.config._attn_implementation
    if plan.stateful_layers:
        checker.record(PathCheck("packed_batches", False, None, f"{CARRIES_STATE}: {', '.join(plan.stateful_layers)}"))
    else:
        try:
            if use_packed_attention(model):
                if not checker.attempt("packed_batches", replace(plan, layout="packed"), checker.forward_error):
                    model.set_attn_implementation(original_attention)
        except Exception as exc:  # noqa: BLE001 - installing packed attention failed: padded batches instead
            model.set_attn_implementation(original_attention)
            checker.record(_failed("packed_batches", "installing", exc))
    if checker.plan.layout != "packed":
        checker.attempt("padded_batches", replace(checker.plan, layout="padded"), checker.forward_error)


def _varlen(checker: _Checker, batch_invariant: bool, cache_dir: Path | None) -> None:
    """Packed attention through one kernel call per layer instead of one SDPA call per segment, where the model runs
    packed: flash attention's varlen kernel on CUDA (models/attention_cuda.py), genscore's own kernel on CPU
    (models/attention_cpu.py, built here or loaded from cache_dir); kept only if the scoring forward with it agrees
    with the plain one."""
    model, plan = checker.model, checker.plan
    if plan.layout != "packed":
        return
    if runs_varlen_on(model.device):
        kernel = VARLEN
        reason = VARLEN_WHEN_INVARIANT if batch_invariant else model_varlen_refusal(model)
    elif model.device.type == "cpu":
        kernel = CPU_VARLEN
        # a segment takes the kernel or the loop by its own length, so batch invariance holds (proven later)
        reason = model_cpu_varlen_refusal(model) or build_error(cache_dir)
    else:
        return
    if reason is not None:
        checker.record(PathCheck(VARLEN_PATH, False, None, reason))
        return
    checker.attempt(VARLEN_PATH, replace(plan, attention_kernel=kernel), checker.forward_error)


def _prefix_reuse(checker: _Checker, batch_invariant: bool) -> None:
    """Key/value reuse (packed suffixes where SDPA reads their mask) over plain attention caches; else, for a model
    whose layers carry state, a copy of its whole cache at the prefix boundary; else off."""
    model, plan = checker.model, checker.plan
    if plan.stateful_layers or not supports_prefix_reuse(model):
        checker.record(PathCheck("shared_prefix", False, None, NOT_PLAIN_ATTENTION))
        checker.record(PathCheck("packed_suffixes", False, None, NOT_PLAIN_ATTENTION))
    elif checker.attempt("shared_prefix", replace(plan, prefix_reuse="key_values"), checker.prefix_error):
        if batch_invariant:
            checker.record(PathCheck("packed_suffixes", False, None, UNPACKED_WHEN_INVARIANT))
        elif not can_pack_suffixes(model):
            checker.record(PathCheck("packed_suffixes", False, None, NO_BOOLEAN_MASK))
        else:
            checker.attempt("packed_suffixes", replace(checker.plan, packed_suffixes=True),
                            checker.packed_suffixes_error)
        return
    else:
        checker.record(PathCheck("packed_suffixes", False, None, SHARED_PREFIX_OFF))
    if not plan.stateful_layers:
        checker.record(PathCheck(WHOLE_CACHE_PREFIX, False, None, RUNS_FROM_SCRATCH))
        return
    if not _returns_cache(checker.plan, model.device):
        checker.record(PathCheck(WHOLE_CACHE_PREFIX, False, None, NO_CACHE_OBJECT))
        return
    checker.attempt(WHOLE_CACHE_PREFIX, replace(checker.plan, prefix_reuse="whole_cache"), checker.prefix_error)


def _cascade(checker: _Checker) -> None:
    """Packed suffixes attend to their prefix by cascade attention (models/cascade.py) instead of SDPA under a mask
    built for the row; kept only if both packed-suffix calls (over prefilled states, and prefixes with their
    suffixes) agree with the plain forward. A layer it cannot honour (a sliding window, dropout) raises, which
    switches it off. Not tried where suffixes do not run packed (among others, under --batch-invariant)."""
    model, plan = checker.model, checker.plan
    reason = NEEDS_PACKED_SUFFIXES if not plan.packed_suffixes or plan.layout != "packed" else model_refusal(
        model.device, plan.attention_kernel, model.dtype)
    if reason is not None:
        checker.record(PathCheck(CASCADE_PATH, False, None, reason))
        return
    checker.attempt(CASCADE_PATH, replace(plan, prefix_attention=CASCADE), checker.packed_suffixes_error)


def _decoding(checker: _Checker) -> None:
    """Rows batched in one key/value cache where every cache layer is attention; else each row alone with the
    model's own cache; else each token recomputed from the whole sequence (the plain forward)."""
    plan = checker.plan
    if plan.stateful_layers:
        checker.record(PathCheck("batched_decoding", False, None, f"{CARRIES_STATE}: {', '.join(plan.stateful_layers)}"))
    elif checker.attempt("batched_decoding", replace(plan, decoding="batched"), checker.decoding_error):
        return
    if not _returns_cache(checker.plan, checker.model.device):
        checker.record(PathCheck("cached_decoding", False, None, NO_CACHE_OBJECT))
        return
    checker.attempt("cached_decoding", replace(checker.plan, decoding="per_request"), checker.decoding_error)


def _decode_kernel(checker: _Checker, cache_dir: Path | None) -> None:
    """Decode steps' attention through the CPU decode kernel (each row's query against its own keys, one call per
    layer) instead of SDPA over the padded cache, where rows decode batched through genscore's attention function;
    kept only if decoding with it agrees with the plain forward."""
    model, plan = checker.model, checker.plan
    if model.device.type != "cpu":
        return
    if plan.decoding != "batched" or plan.layout != "packed":
        checker.record(PathCheck(DECODE_KERNEL_PATH, False, None, DECODE_NEEDS_BATCHED))
        return
    reason = model_cpu_varlen_refusal(model) or build_error(cache_dir)
    if reason is not None:
        checker.record(PathCheck(DECODE_KERNEL_PATH, False, None, reason))
        return
    checker.attempt(DECODE_KERNEL_PATH, replace(plan, decode_kernel=True), checker.decoding_error)


def _batch_difference(checker: _Checker, plan: ForwardPlan, neighbours: list[list[int]]
                      ) -> tuple[float, float | None]:
    """Largest |logit difference| of each probe sequence alone against the same sequence batched with neighbours
    (0.0 when bit-identical): through forward_logits, and (key/value prefix reuse) over prefilled prefixes."""
    model, probe, pad = checker.model, checker.probe, checker.pad
    sequences, keep = probe.sequences, probe.keep
    alone = torch.cat([forward_logits(model, plan, [seq], pad, [k]) for seq, k in zip(sequences, keep)])
    mixed = [neighbours[0], sequences[0], neighbours[1], sequences[1], neighbours[2], sequences[2], neighbours[3]]
    mixed_keep = [1, keep[0], 2, keep[1], 1, keep[2], 3]
    rows = forward_logits(model, plan, mixed, pad, mixed_keep).split(mixed_keep)
    batched = torch.cat([rows[1], rows[3], rows[5]])
    forward = (alone - batched).abs().max().item()
    if plan.prefix_reuse != "key_values":
        return forward, None

    def suffix_logits(prefixes: list[list[int]], pairs: list[tuple[list[int], list[int], int]]) -> torch.Tensor:
        states = dict(zip(map(tuple, prefixes), prefill_prefixes(model, plan, prefixes, pad)))
        return head_logits(plan, forward_suffixes(
            model, plan, [SuffixRow(states[tuple(p)], tuple(s), k) for p, s, k in pairs], pad))

    short, suffixes = probe.short_prefix, probe.suffixes
    alone = torch.cat([suffix_logits([short], [(short, suffixes[i], keep[i])]) for i in (1, 2)])
    other = neighbours[1][:5]
    rows = suffix_logits([probe.long_prefix, other, short], [
        (probe.long_prefix, suffixes[0], keep[0]), (short, suffixes[1], keep[1]), (other, neighbours[2], 2),
        (short, suffixes[2], keep[2]), (short, neighbours[3][:3], 1)]).split([keep[0], keep[1], 2, keep[2], 1])
    return forward, (alone - torch.cat([rows[1], rows[3]])).abs().max().item()


def _off(checks: list[PathCheck], name: str, difference: float, reason: str) -> list[PathCheck]:
    return [PathCheck(c.name, False, difference, reason) if c.name == name else c for c in checks]


def _make_invariant(checker: _Checker, vocab_size: int, max_length: int, original_attention: str) -> PathCheck:
    """Make the model batch-invariant and prove it on the probe; a path that still moves a row is switched off."""
    model = checker.model
    generator = torch.Generator().manual_seed(1)
    neighbours = [torch.randint(0, vocab_size, (min(n, max_length),), generator=generator).tolist()
                  for n in _NEIGHBOUR_LENGTHS]
    try:
        tiled = make_batch_invariant(model, checker.plan.body)
        plan = replace(checker.plan, batch_invariant=True, held_head=None,
                       head=build_head(model, checker.plan.body, tiled))
        forward, prefix = _batch_difference(checker, plan, neighbours)
        if forward != 0.0 and plan.layout == "packed":
            # one sequence per call is the same call alone and in a batch
            log.warning("packed batches move a row by %.3g on this model; running one sequence at a time", forward)
            model.set_attn_implementation(original_attention)
            plan = replace(plan, layout="one_at_a_time", compiled=False)
            checker.checks[:] = _off(checker.checks, "packed_batches", forward,
                                     f"not batch-invariant (moved a row by {forward:.3g})")
            forward, prefix = _batch_difference(checker, plan, neighbours)
    except Exception as exc:  # noqa: BLE001 - a path that cannot run at all cannot be proven invariant
        return PathCheck(BATCH_INVARIANT, False, None, f"{type(exc).__name__}: {exc}")
    if prefix is not None and prefix != 0.0:
        checker.checks[:] = _off(checker.checks, "shared_prefix", prefix,
                                 f"not batch-invariant (moved a row by {prefix:.3g})")
        plan = replace(plan, prefix_reuse="off", packed_suffixes=False)
    checker.plan = replace(plan, batch_invariant=forward == 0.0)
    if forward != 0.0:
        return PathCheck(BATCH_INVARIANT, False, forward, f"a batch moved a row by {forward:.3g}")
    return PathCheck(BATCH_INVARIANT, True, 0.0)


def _compile_check(checker: _Checker, compile: bool, cache_dir: Path | None, batch_invariant: bool) -> PathCheck:
    """Compile the decoder layers for packed calls (if asked to) and keep them if they agree with the plain forward."""
    model, plan = checker.model, checker.plan
    if not compile:
        return PathCheck(COMPILED_LAYERS, False, None, COMPILE_NOT_REQUESTED)
    if batch_invariant:
        return PathCheck(COMPILED_LAYERS, False, None, NOT_COMPILED_WHEN_INVARIANT)
    if model.device.type != "cpu":
        return PathCheck(COMPILED_LAYERS, False, None, COMPILE_CPU_ONLY)
    if plan.layout != "packed":
        return PathCheck(COMPILED_LAYERS, False, None, COMPILE_NEEDS_PACKING)
    try:
        if not compile_layers(model, cache_dir):
            return PathCheck(COMPILED_LAYERS, False, None, "no decoder layers the compiled path can call")
    except Exception as exc:  # noqa: BLE001 - installing failed: eager layers serve
        uncompile_layers(model)
        return _failed(COMPILED_LAYERS, "installing", exc)
    candidate = replace(plan, compiled=True)
    check = check_path(COMPILED_LAYERS, checker.tolerance, lambda: checker.forward_error(candidate))  # first call compiles
    if check.enabled:
        checker.plan = candidate
    else:
        uncompile_layers(model)
    return check


def _cuda_graphs(checker: _Checker, batch_invariant: bool) -> None:
    """Packed calls replayed from CUDA graphs, one per bucket of packed lengths (models/cuda_graphs.py), where the
    packed row goes through the varlen kernel (it reads the boundaries from the device); kept only if every bucket,
    replaying the probe sequences that fit it, agrees with the plain forward. Not reported off CUDA."""
    model, plan = checker.model, checker.plan
    if plan.layout != "packed" or model.device.type not in cuda_graphs.DEVICE_TYPES:
        return
    if batch_invariant:
        checker.record(PathCheck(GRAPHS_PATH, False, None, VARLEN_WHEN_INVARIANT))
        return
    if plan.attention_kernel != VARLEN:
        checker.record(PathCheck(GRAPHS_PATH, False, None, GRAPHS_NEED_VARLEN))
        return
    graphs = cuda_graphs.PackedGraphs(plan.body, plan.attention_kernel, model.device)
    sequences, keep = checker.probe.sequences, checker.probe.keep
    starts = [0, *torch.tensor(keep).cumsum(0).tolist()]  # each sequence's rows in the reference
    fits: dict[int, list[int]] = {}  # per bucket, the probe sequences it holds, shortest first
    for tokens in graphs.bucket_tokens:
        fits[tokens] = []
        for i in sorted(range(len(sequences)), key=lambda i: len(sequences[i])):
            if graphs.only(tokens).bucket_for([len(sequences[j]) for j in fits[tokens]] + [len(sequences[i])]) is None:
                break
            fits[tokens].append(i)
    graphs.buckets = [bucket for bucket in graphs.buckets if fits[bucket.tokens]]  # a bucket is used only if proven
    if not graphs.buckets:
        checker.record(PathCheck(GRAPHS_PATH, False, None, "no bucket holds a probe sequence"))
        return

    def graphs_error(candidate: ForwardPlan) -> float:
        errors = []
        for tokens in graphs.bucket_tokens:
            held = fits[tokens]
            one = replace(candidate, graphs=graphs.only(tokens))
            logits = forward_logits(checker.model, one, [sequences[i] for i in held], checker.pad, [keep[i] for i in held])
            reference = torch.cat([checker.reference[starts[i] : starts[i + 1]] for i in held])
            errors.append(logprob_error(logits, reference, checker.model.dtype))
        return max(errors)

    checker.attempt(GRAPHS_PATH, replace(plan, graphs=graphs), graphs_error)


def _guarded(checker: _Checker, name: str, step, *args) -> None:
    """Run one step of the check; anything it raises unexpectedly puts the plan back as it was before the step and
    switches off every path the step had turned on, instead of failing the load."""
    plan, recorded = checker.plan, len(checker.checks)
    try:
        step(checker, *args)
    except Exception as exc:  # noqa: BLE001 - a fast path can never stop a model from loading
        checker.plan = plan
        reason = f"the self-check raised {type(exc).__name__}: {exc}"
        checker.checks[recorded:] = [PathCheck(c.name, False, c.difference, reason) if c.enabled else c
                                     for c in checker.checks[recorded:] if c.name != name]
        checker.record(_failed(name, "the self-check", exc))


def plain_plan(model: PreTrainedModel) -> ForwardPlan:
    """The plan of a model served exactly as transformers runs it: each sequence alone through its own forward,
    each row decoding alone with its own cache (recomputing where it keeps none), no prefix reuse."""
    body = find_body(model)
    plan = ForwardPlan(body=body, head=build_head(model, body), stateful_layers=stateful_layers(model))
    return replace(plan, decoding="per_request" if _returns_cache(plan, model.device) else "recompute")


@torch.inference_mode()
def _returns_cache(plan: ForwardPlan, device: torch.device) -> bool:
    """Whether the body hands back a cache object (some models keep their state inside their modules)."""
    output = plan.body(input_ids=torch.zeros((1, 2), dtype=torch.long, device=device), use_cache=True)
    return returned_cache(output) is not None


@torch.inference_mode()
def install_fast_paths(model: PreTrainedModel, vocab_size: int, max_length: int, pad_token_id: int,
                       batch_invariant: bool = False, compile: bool = False,
                       cache_dir: Path | None = None) -> ForwardPlan:
    """Install each fast path on `model`, keep the ones that give the plain forward's numbers, and return the plan.

    Compared with the unmodified model's own forward on the same probe sequences (one of them longer
    than the smallest attention window): the output head genscore reads logits through (must agree,
    or the load fails), pre-packed linear weights (CPU) and the groups of them that read one input fused,
    packed sequences or else padded micro-batches (else one sequence at a time), shared-prefix reuse (key/value
    states, or the model's whole cache), which the prefix cache and multi-token candidates read as well, and
    batched decoding (else each row alone). Installing, probing or checking a path that raises switches that path
    off with a warning; the load fails only when the model's own plain forward does.
    batch_invariant: then make every path batch-invariant (models/invariant.py) and prove it, bit for bit,
    on the probe sequences batched with others; a path that still moves a row is switched off.
    compile: compile the decoder layers for packed calls (models/compiled.py; CPU, not with batch_invariant),
    keeping inductor's cache and the CPU attention kernel's build under cache_dir (None: their defaults).
    """
    started = time.perf_counter()
    tolerance = TOLERANCE.get(model.dtype, 0.1)
    probe = make_probe(model, vocab_size, max_length)
    try:
        body = find_body(model)
        logits, plain_hidden = plain_logits(model, body, probe.sequences, probe.keep)  # [N, V], [N, H]
    except Exception as exc:
        raise PlainForwardError(f"the model's own transformers forward fails on a plain {len(probe.sequences[0])}-"
                                f"token sequence, so it cannot be served: {type(exc).__name__}: {exc}") from exc
    reference = logits.float().log_softmax(-1)  # [N, V]
    plan = ForwardPlan(body=body, head=build_head(model, body), stateful_layers=stateful_layers(model),
                       tolerance=tolerance)
    checker = _Checker(model, plan, probe, reference, plain_hidden, tolerance, pad_token_id)
    head = check_path("output_head", tolerance, lambda: checker.error(head_logits(plan, plain_hidden)))
    if not head.enabled:
        raise RuntimeError(f"genscore cannot read this model's logits the way its own forward does: {head.reason}")
    checker.record(head)

    _guarded(checker, "prepacked_linears", _prepacked, batch_invariant, cache_dir)
    original_attention = model.config._attn_implementation
    _guarded(checker, "packed_batches", _layout)
    _guarded(checker, VARLEN_PATH, _varlen, batch_invariant, cache_dir)
    _guarded(checker, GRAPHS_PATH, _cuda_graphs, batch_invariant)
    checker.record(_compile_check(checker, compile, cache_dir, batch_invariant))
    _guarded(checker, "shared_prefix", _prefix_reuse, batch_invariant)
    _guarded(checker, CASCADE_PATH, _cascade)
    _guarded(checker, "batched_decoding", _decoding)
    _guarded(checker, DECODE_KERNEL_PATH, _decode_kernel, cache_dir)
    if batch_invariant:
        checker.record(_make_invariant(checker, vocab_size, max_length, original_attention))
    else:
        checker.record(PathCheck(BATCH_INVARIANT, False, None, NOT_REQUESTED))

    report = replace(checker.plan, checks=tuple(checker.checks), seconds=time.perf_counter() - started)
    for check in report.checks:
        if check.enabled:
            log.info("fast path %s: on (difference %.2g from the plain forward)", check.name, check.difference)
        elif check.difference is None and check.reason.startswith(_NOT_USED):
            log.info("fast path %s: not used, %s", check.name, check.reason)
        else:
            log.warning("fast path %s: OFF, %s", check.name, check.reason)
    log.info("self-check took %.2f s (tolerance %g): layout %s, prefix reuse %s, decoding %s", report.seconds,
             tolerance, report.layout, report.prefix_reuse, report.decoding)
    return report
