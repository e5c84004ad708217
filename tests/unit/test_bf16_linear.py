"""genscore's bfloat16 linear kernel (models/csrc/bf16_linear.cpp): its numbers against float32 nn.Linear, which
weights are packed for it, and a kernel that disagrees left for oneDNN's at load. Runs where the CPU has
avx512_bf16 and no AMX (elsewhere oneDNN's kernels serve and the module is skipped)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import models.prepack
from models import load_model
from models.attention_cpu import build_error, cpu_target
from models.prepack import PrepackedLinear, bf16_cpu_refusal

# The kernel is in the AVX-512 build only, which ATEN_CPU_CAPABILITY=avx2 (the suite's weaker-CPU run) does not load.
pytestmark = pytest.mark.skipif(bf16_cpu_refusal() is not None or cpu_target() != "avx512",
                                reason=f"{bf16_cpu_refusal() or 'the ' + cpu_target() + ' build of the CPU kernels'}")


@pytest.fixture(scope="module")
def kernel():
    assert build_error(None) is None  # the library of CPU kernels holds the bfloat16 linear
    return torch.ops.genscore_cpu


def _bf16_linear(features: int, outputs: int, bias: bool) -> nn.Linear:
    torch.manual_seed(features + outputs)
    return nn.Linear(features, outputs, bias=bias).to(torch.bfloat16)


@pytest.mark.parametrize("features,outputs,bias", [(64, 96, True), (1536, 64, False)])
def test_every_row_count_matches_a_float32_linear(kernel, features, outputs, bias):
    """Every tile size (1-14 rows), several tiles, several chunks of rows: products summed in float32, one rounding."""
    linear = _bf16_linear(features, outputs, bias)
    packed = kernel.pack_bf16_linear(linear.weight.detach())
    for rows in [*range(1, 46), 113, 300]:
        x = torch.randn(2, rows, features).to(torch.bfloat16)  # [2, rows, in]
        got = kernel.bf16_linear(x, packed, None if linear.bias is None else linear.bias.detach())
        want = nn.functional.linear(x.float(), linear.weight.float(), None if linear.bias is None else
                                    linear.bias.float())
        assert got.shape == (2, rows, outputs) and got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want, atol=1e-3, rtol=2**-8)  # half a bfloat16 ulp, and order


def test_a_rows_numbers_do_not_depend_on_its_neighbours(kernel):
    linear = _bf16_linear(576, 192, True)
    packed = kernel.pack_bf16_linear(linear.weight.detach())
    x = torch.randn(300, 576).to(torch.bfloat16)
    together = kernel.bf16_linear(x, packed, linear.bias.detach())
    for row in (0, 13, 14, 111, 299):
        alone = kernel.bf16_linear(x[row:row + 1], packed, linear.bias.detach())
        assert torch.equal(alone[0], together[row])


def test_weights_are_packed_in_blocks_only_where_they_tile(kernel):
    assert PrepackedLinear(_bf16_linear(64, 96, True)).packed_weight.shape == (3, 32, 32, 2)  # [out/32, in/2, 32, 2]
    assert PrepackedLinear(_bf16_linear(64, 48, True)).packed_weight.dim() == 2  # 48 outputs: oneDNN's layout
    assert PrepackedLinear(nn.Linear(64, 96)).packed_weight.dim() == 2  # float32: oneDNN's


def test_a_model_loads_onto_the_kernel_and_reports_it(kernel, tiny_model_dirs):
    loaded = load_model(str(tiny_model_dirs["llama"]), "cpu", "bfloat16")
    checks = {check.name: check for check in loaded.plan.checks}
    assert checks["bf16_linear_kernel"].enabled and checks["prepacked_linears"].enabled
    weights = [m.packed_weight for m in loaded.model.modules() if isinstance(m, PrepackedLinear)]
    assert weights and all(w.dim() == 4 for w in weights)


def test_a_kernel_that_disagrees_leaves_the_weights_to_onednn(kernel, tiny_model_dirs, monkeypatch):
    """The kernel's own check at load (every tile size against nn.Linear) fails: oneDNN packs every weight, the
    pre-packed linears still serve, and the path says why it is off."""
    monkeypatch.setattr(models.prepack, "_bf16_blocks_error", lambda: "the bfloat16 kernel disagrees (test)")
    loaded = load_model(str(tiny_model_dirs["llama"]), "cpu", "bfloat16")
    checks = {check.name: check for check in loaded.plan.checks}
    assert not checks["bf16_linear_kernel"].enabled
    assert checks["bf16_linear_kernel"].reason == "the bfloat16 kernel disagrees (test)"
    assert checks["prepacked_linears"].enabled
    assert all(m.packed_weight.dim() == 2 for m in loaded.model.modules() if isinstance(m, PrepackedLinear))


def test_a_model_whose_kernel_numbers_are_wrong_is_served_by_plain_linears(kernel, tiny_model_dirs, monkeypatch):
    """Broken on purpose past the kernel's own check (its outputs scaled by half again): the self-check's forward
    comparison switches the pre-packed linears off and the plain ones serve."""
    real = models.prepack._linear

    def scaled(x, packed_weight, bias):
        out = real(x, packed_weight, bias)
        return out * 1.5 if packed_weight.dim() == 4 else out

    monkeypatch.setattr(models.prepack, "_linear", scaled)
    loaded = load_model(str(tiny_model_dirs["llama"]), "cpu", "bfloat16")
    checks = {check.name: check for check in loaded.plan.checks}
    assert not checks["prepacked_linears"].enabled and checks["prepacked_linears"].difference > 0
    assert not any(isinstance(m, PrepackedLinear) for m in loaded.model.modules())
