"""CPU linear layers whose weights are packed once, instead of on every call: into genscore's bfloat16 blocks
(models/csrc/bf16_linear.cpp) where that kernel applies, else into oneDNN's blocked layout."""

from __future__ import annotations

import functools
import logging

import torch
from torch import nn
from transformers import PreTrainedModel

from models.attention_cpu import cpu_target
from models.cpu_features import bfloat16_packing_missing, cpu_flags, describe_cpu

log = logging.getLogger("genscore.models")

# genscore's bfloat16 kernel packs weights in blocks of this many output columns (models/csrc/bf16_linear.cpp).
BF16_BLOCK = 32
# Why the bfloat16 kernel leaves a CPU to oneDNN when that is not a fault (reported as "not used").
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
    bfloat16 blocks are [out / 32, in / 2, 32, 2]."""
    return packed_weight.shape[0] * packed_weight.shape[2] if packed_weight.dim() == 4 else packed_weight.shape[0]


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [out, in] packed for packed_linear: into genscore's bfloat16 blocks where that kernel serves it
    (bfloat16_blocks_refusal, and a shape its blocks tile), else into oneDNN's blocked layout."""
    out, features = weight.shape
    if weight.dtype == torch.bfloat16 and out % BF16_BLOCK == 0 and features % 2 == 0 and bf16_blocks_refusal() is None:
        return torch.ops.genscore_cpu.pack_bf16_linear(weight)
    return torch.ops.mkldnn._reorder_linear_weight(weight, _LAYOUT_ROWS)


def packed_linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T + b with W packed by pack_weight: [..., in] -> [..., out]."""
    if torch.compiler.is_compiling():
        # inductor lowers mkldnn's op only for frozen constant weights; as an opaque op the packed weight stays
        return prepacked_linear(x, packed_weight, bias)
    return _linear(x, packed_weight, bias)


def _linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if packed_weight.dim() == 4:  # genscore's bfloat16 blocks (out_features)
        return torch.ops.genscore_cpu.bf16_linear(x, packed_weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


def bf16_cpu_refusal() -> str | None:
    """Why this CPU leaves bfloat16 GEMMs to oneDNN (None when genscore's bfloat16 kernel is made for it): the
    kernel needs avx512_bf16, and on a CPU with AMX oneDNN's AMX kernels are faster."""
    flags = cpu_flags()
    if "avx512_bf16" not in flags:
        return f"{NO_AVX512_BF16} ({describe_cpu()})"
    return AMX_PRESENT if "amx_bf16" in flags else None


def bf16_blocks_refusal() -> str | None:
    """Why bfloat16 weights are not packed for genscore's bfloat16 kernel here (None when they are): the CPU
    (bf16_cpu_refusal), the avx512 build of genscore's CPU kernels loaded (models/attention_cpu.py build_error),
    and agreement with nn.Linear on every tile of rows the kernel computes."""
    if (refusal := bf16_cpu_refusal()) is not None:
        return refusal
    if not hasattr(torch.ops.genscore_cpu, "bf16_linear"):
        return "genscore's CPU kernels are not built"
    if cpu_target() != "avx512":
        return f"genscore's CPU kernels run their {cpu_target()} build"
    return _bf16_blocks_error()


@functools.cache
def _bf16_blocks_error() -> str | None:
    """Why the bfloat16 kernel disagrees with nn.Linear (None when it agrees) on every row count up to three tiles,
    so each tile size it instantiates is run once."""
    linear = nn.Linear(64, 2 * BF16_BLOCK).to(torch.bfloat16)
    packed = torch.ops.genscore_cpu.pack_bf16_linear(linear.weight.detach())
    with torch.inference_mode():
        for rows in range(1, 43):
            x = torch.randn(rows, 64).to(torch.bfloat16)
            got = torch.ops.genscore_cpu.bf16_linear(x, packed, linear.bias.detach()).float()
            want = torch.nn.functional.linear(x.float(), linear.weight.float(), linear.bias.float())
            if not torch.allclose(got, want, atol=1e-2, rtol=1e-2):
                return f"the bfloat16 kernel disagrees with nn.Linear on {rows} rows"
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
