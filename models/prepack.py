"""CPU linear layers whose weights are packed once, instead of on every call: into genscore's blocks
(models/csrc/linear.cpp) where that kernel serves them, else into oneDNN's blocked layout."""

from __future__ import annotations

import functools
import logging

import torch
from torch import nn
from transformers import PreTrainedModel

from models.attention_cpu import cpu_target
from models.cpu_features import bfloat16_packing_missing, cpu_flags, cpu_vendor, describe_cpu

log = logging.getLogger("genscore.models")

# genscore's linear packs weights in blocks of this many output columns, and the inputs of a bfloat16 weight in
# pairs (models/csrc/linear.cpp): [out / BLOCK, in / step, BLOCK, step].
BLOCK = 32
_STEPS = {torch.float32: 1, torch.bfloat16: 2}
# Why genscore's linear leaves a CPU to oneDNN when that is not a fault (reported as "not used").
NO_AVX512 = "genscore's linear is built for AVX-512"
NO_AVX512_BF16 = "no avx512_bf16"
AMX_PRESENT = "oneDNN runs bfloat16 GEMMs on this CPU's AMX tiles"

# The row count oneDNN picks its weight layout for; a packed weight serves any row count. About one packed
# scoring call (models/forward.py PACK_TOKENS); decoding's few rows still gain (measured in bench/).
_LAYOUT_ROWS = 1024


@torch.library.custom_op("genscore::prepacked_linear", mutates_args=())
def prepacked_linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """PrepackedLinear's kernel as one op a compiled graph calls as it is (models/compiled.py)."""
    return _linear(x, packed_weight, bias)


@prepacked_linear.register_fake
def _(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features(packed_weight)))


def out_features(packed_weight: torch.Tensor) -> int:
    """The output width of a weight packed by pack_weight: oneDNN's layout keeps the [out, in] shape; genscore's
    blocks are [out / 32, in / step, 32, step]."""
    return packed_weight.shape[0] * packed_weight.shape[2] if packed_weight.dim() == 4 else packed_weight.shape[0]


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [out, in] packed for packed_linear: into genscore's blocks where its kernel serves the dtype
    (kernel_refusal) and the blocks tile the shape, else into oneDNN's blocked layout."""
    out, features = weight.shape
    step = _STEPS.get(weight.dtype)
    if step and out % BLOCK == 0 and features % step == 0 and kernel_refusal(weight.dtype) is None:
        return torch.ops.genscore_cpu.pack_linear_weight(weight)
    return onednn_packed(weight)


def onednn_packed(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [out, in] in oneDNN's blocked layout, for mkldnn's linear."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, _LAYOUT_ROWS)


def packed_linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T + b with W packed by pack_weight: [..., in] -> [..., out]."""
    if torch.compiler.is_compiling():
        # inductor lowers mkldnn's op only for frozen constant weights; as an opaque op the packed weight stays
        return prepacked_linear(x, packed_weight, bias)
    return _linear(x, packed_weight, bias)


def _linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if packed_weight.dim() == 4:  # genscore's blocks (out_features)
        # widen: the kernel multiplies a bfloat16 weight in float32 FMAs, the output still bfloat16
        widen = packed_weight.dtype == torch.bfloat16 and widens_bfloat16()
        return torch.ops.genscore_cpu.packed_linear(x, packed_weight, bias, widen)
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


@functools.cache
def widens_bfloat16() -> bool:
    """Whether genscore's bfloat16 linear multiplies in float32 FMAs (inputs and weights widened) instead of by
    vdpbf16ps: on Intel's cores vdpbf16ps issues at a quarter of the FMA rate, half FMA's flops, while AMD's Zen 4
    runs it at twice FMA's flops (docs/users/performance.md). Decided by the CPU alone, so a server's numbers never
    depend on a timing."""
    return cpu_vendor() == "GenuineIntel"


def cpu_refusal(dtype: torch.dtype) -> str | None:
    """Why this CPU leaves `dtype` GEMMs to oneDNN (None when genscore's linear is made for it): the kernel needs
    AVX-512 (ATen at AVX-512, so that ATEN_CPU_CAPABILITY=avx2 turns it off), bfloat16 also avx512_bf16, and on a
    CPU with AMX oneDNN's AMX kernels are faster in bfloat16."""
    if dtype not in _STEPS:
        return f"genscore's linear computes in float32 and bfloat16, not {dtype}"
    if cpu_target() != "avx512":
        return f"{NO_AVX512} ({describe_cpu()})"
    flags = cpu_flags()
    if dtype == torch.bfloat16 and "avx512_bf16" not in flags:
        return f"{NO_AVX512_BF16} ({describe_cpu()})"
    return AMX_PRESENT if dtype == torch.bfloat16 and "amx_bf16" in flags else None


def kernel_refusal(dtype: torch.dtype) -> str | None:
    """Why `dtype` weights are not packed for genscore's linear here (None when they are): the CPU (cpu_refusal),
    the library of genscore's CPU kernels loaded (models/attention_cpu.py build_error), and agreement with
    nn.Linear on every tile of rows the kernel computes."""
    if (refusal := cpu_refusal(dtype)) is not None:
        return refusal
    if not hasattr(torch.ops.genscore_cpu, "packed_linear"):
        return "genscore's CPU kernels are not built"
    return _blocks_error(dtype)


@functools.cache
def _blocks_error(dtype: torch.dtype) -> str | None:
    """Why genscore's linear disagrees with nn.Linear in `dtype` (None when it agrees) on every row count up to three
    tiles, so that each tile size it instantiates runs once."""
    linear = nn.Linear(64, 2 * BLOCK).to(dtype)
    packed = torch.ops.genscore_cpu.pack_linear_weight(linear.weight.detach())
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    with torch.inference_mode():
        for rows in range(1, 43):
            x = torch.randn(rows, 64).to(dtype)
            got = _linear(x, packed, linear.bias.detach()).float()
            want = torch.nn.functional.linear(x.float(), linear.weight.float(), linear.bias.float())
            if not torch.allclose(got, want, atol=tolerance, rtol=tolerance):
                return f"genscore's linear disagrees with nn.Linear in {dtype} on {rows} rows"
    return None


class PrepackedLinear(nn.Module):
    """y = x W^T + b with W held packed (pack_weight); same numbers as nn.Linear up to summation order."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # Buffers, not parameters: the packed layout is not a weight anything should train or re-load.
        self.register_buffer("packed_weight", pack_weight(linear.weight.detach()))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in_features] -> [..., out_features]
        return packed_linear(x, self.packed_weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def _kernel_error(dtype: torch.dtype) -> str | None:
    """Why this torch build's packed kernel fails or disagrees with nn.Linear on a small case (None when it works)."""
    try:
        linear = nn.Linear(64, 48).to(dtype)
        x = torch.randn(5, 64).to(dtype)
        with torch.inference_mode():
            if torch.allclose(PrepackedLinear(linear)(x).float(), linear(x).float(), atol=1e-2, rtol=1e-2):
                return None
        return "the packed kernel disagrees with nn.Linear"
    except (RuntimeError, AttributeError) as exc:  # op missing in this build, or no oneDNN kernel for the CPU
        return str(exc)


def packing_unavailable(model: PreTrainedModel) -> str | None:
    """Why the packed kernel does not apply to `model` (None when it does): it runs on CPU, in float32 or bfloat16,
    bfloat16 only where oneDNN packs it natively (models/cpu_features.py), and only where it works in this build."""
    if model.device.type != "cpu":
        return f"the model runs on {model.device.type}"
    if model.dtype not in (torch.float32, torch.bfloat16):
        return f"oneDNN packs float32 and bfloat16 weights, not {model.dtype}"
    if model.dtype == torch.bfloat16 and (missing := bfloat16_packing_missing()) is not None:
        return missing
    return _kernel_error(model.dtype)


def prepack_linears(model: PreTrainedModel, body: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """Swap each nn.Linear of the decoder body for a PrepackedLinear; returns the swaps, for restore_linears.

    CPU, float32 or bfloat16 only (packing_unavailable; a WARNING says why not). lm_head is not swapped here: its
    weight is often tied to the input embeddings, which must stay a plain matrix; prepacked_head packs a copy of it.
    """
    reason = packing_unavailable(model)
    if reason is not None:
        if model.device.type == "cpu":
            log.warning("%s linear weights are not pre-packed (%s); the model's linears run as plain nn.Linear",
                        str(model.dtype).removeprefix("torch."), reason)
        return []
    swaps = []
    for module in body.modules():
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                setattr(module, name, PrepackedLinear(child))
                swaps.append((module, name, child))
    return swaps


def prepacked_head(model: PreTrainedModel) -> PrepackedLinear | None:
    """A pre-packed copy of the model's lm_head, for its head view (models/head.py build_head); None when
    lm_head is not a plain nn.Linear or the packed kernel does not apply (packing_unavailable).

    A copy: a tied lm_head shares its matrix with the input embeddings, which stay plain, so the largest matrix
    is held twice (V x H). It pays on the small row counts the head runs on: the packed kernel takes less time than
    nn.Linear on the plain matrix there (docs/contributors/architecture.md, "Pre-packed weights", has the numbers).
    """
    head = model.get_output_embeddings()
    if type(head) is not nn.Linear or packing_unavailable(model) is not None:
        return None
    return PrepackedLinear(head)


def restore_linears(swaps: list[tuple[nn.Module, str, nn.Linear]]) -> None:
    """Undo prepack_linears: put the original nn.Linear modules back."""
    for module, name, linear in swaps:
        setattr(module, name, linear)
