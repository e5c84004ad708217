"""genscore's linear (models/csrc/linear.cpp): its numbers against a float64 reference in float32 and bfloat16, which
weights are packed for it, and a kernel that disagrees left for oneDNN's at load. Runs where the AVX-512 build of the
CPU kernels runs (bfloat16 where the CPU also has avx512_bf16 and no AMX); elsewhere oneDNN's kernels serve."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import models.prepack
from models import load_model
from models.attention_cpu import build_error
from models.prepack import PrepackedLinear, cpu_refusal


def _where_it_runs(dtype: torch.dtype, *values) -> pytest.param:
    return pytest.param(dtype, *values, marks=pytest.mark.skipif(cpu_refusal(dtype) is not None,
                                                                 reason=f"{cpu_refusal(dtype)}"))


DTYPES = [_where_it_runs(torch.float32), _where_it_runs(torch.bfloat16)]
# (weight dtype, input dtype, widen): a bfloat16 weight widened multiplies by FMA (models/prepack.py widens_bfloat16)
# rather than by vdpbf16ps, from float32 inputs or from bfloat16 ones the kernel widens; the kernel runs each path on
# any CPU with avx512_bf16.
INPUTS = [_where_it_runs(torch.float32, torch.float32, False), _where_it_runs(torch.bfloat16, torch.bfloat16, False),
          _where_it_runs(torch.bfloat16, torch.float32, False), _where_it_runs(torch.bfloat16, torch.bfloat16, True)]
# A row's result against float64: bfloat16 rounds once at the end (half an ulp, 2^-9), float32 sums in another order.
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-3, rtol=2**-8)}


@pytest.fixture(scope="module")
def kernel():
    assert build_error(None) is None  # the library of CPU kernels holds the linear
    return torch.ops.genscore_cpu


def _linear(features: int, outputs: int, bias: bool, dtype: torch.dtype) -> nn.Linear:
    torch.manual_seed(features + outputs)
    return nn.Linear(features, outputs, bias=bias).to(dtype)


@pytest.mark.parametrize("dtype,inputs,widen", INPUTS)
@pytest.mark.parametrize("features,outputs,bias", [(64, 96, True), (1536, 64, False)])
def test_every_row_count_matches_a_float64_linear(kernel, dtype, inputs, widen, features, outputs, bias):
    """Every tile size (1-14 rows), several tiles, several chunks of rows."""
    linear = _linear(features, outputs, bias, dtype)
    packed = kernel.pack_linear_weight(linear.weight.detach())
    for rows in [*range(1, 46), 113, 300, 500]:
        x = torch.randn(2, rows, features).to(dtype)  # [2, rows, in], values a bfloat16 holds
        got = kernel.packed_linear(x.to(inputs), packed, None if linear.bias is None else linear.bias.detach(), widen)
        want = nn.functional.linear(x.double(), linear.weight.double(), None if linear.bias is None else
                                    linear.bias.double())
        assert got.shape == (2, rows, outputs) and got.dtype == dtype
        torch.testing.assert_close(got.double(), want, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [DTYPES[0]])
def test_float32_error_stays_small_on_a_wide_input(kernel, dtype):
    """4,096 inputs of unit scale (outputs ~64): one float32 accumulator over the whole input strayed 5.2e-4 from the
    exact sum here, runs of 64 summed apart 6.3e-5 (nn.functional.linear: 8.1e-5)."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(256, 4096, generator=generator)  # [out, in]
    x = torch.randn(16, 4096, generator=generator)  # [rows, in]
    got = kernel.packed_linear(x, kernel.pack_linear_weight(weight), None)
    error = (got.double() - x.double() @ weight.double().T).abs().max().item()
    assert error < 1.2e-4, error


@pytest.mark.parametrize("dtype,inputs,widen", INPUTS)
def test_a_rows_numbers_do_not_depend_on_its_neighbours(kernel, dtype, inputs, widen):
    linear = _linear(576, 192, True, dtype)
    packed = kernel.pack_linear_weight(linear.weight.detach())
    x = torch.randn(1000, 576).to(dtype).to(inputs)  # several chunks of rows in either dtype
    together = kernel.packed_linear(x, packed, linear.bias.detach(), widen)
    for row in (0, 13, 14, 111, 299, 500, 999):
        alone = kernel.packed_linear(x[row:row + 1], packed, linear.bias.detach(), widen)
        assert torch.equal(alone[0], together[row])


@pytest.mark.parametrize("dtype,step", [_where_it_runs(torch.float32, 1), _where_it_runs(torch.bfloat16, 2)])
def test_weights_are_packed_in_blocks_only_where_they_tile(kernel, dtype, step):
    assert PrepackedLinear(_linear(64, 96, True, dtype)).packed_weight.shape == (3, 64 // step, 32, step)
    assert PrepackedLinear(_linear(64, 48, True, dtype)).packed_weight.dim() == 2  # 48 outputs: oneDNN's layout


@pytest.mark.parametrize("dtype", [DTYPES[1]])
def test_both_bfloat16_paths_agree_within_one_rounding(kernel, dtype):
    """Both bfloat16 paths round once at the end, so they differ from each other by at most one bfloat16 ulp, and
    the widened one (exact products, float32 sums) is what a bfloat16 model served through it computes."""
    linear = _linear(1536, 576, False, dtype)
    packed = kernel.pack_linear_weight(linear.weight.detach())
    x = torch.randn(40, 1536).to(dtype)  # [rows, in]
    widened = kernel.packed_linear(x.float(), packed, None).float()  # [rows, out]
    paired = kernel.packed_linear(x, packed, None).float()
    ulp = torch.maximum(widened.abs(), paired.abs()) * 2**-7
    assert bool((widened - paired).abs().le(ulp).all())


@pytest.mark.parametrize("dtype", [DTYPES[1]])
def test_bfloat16_inputs_widened_in_the_kernel_match_float32_inputs(kernel, dtype):
    """The kernel widens bfloat16 inputs a chunk of rows at a time: the same sums, bit for bit, as from the float32
    copy of the input, over one tile, several tiles and several chunks."""
    linear = _linear(1536, 64, False, dtype)
    packed = kernel.pack_linear_weight(linear.weight.detach())
    for rows in (1, 14, 45, 1000):
        x = torch.randn(rows, 1536).to(dtype)  # [rows, in]
        assert torch.equal(kernel.packed_linear(x, packed, None, True), kernel.packed_linear(x.float(), packed, None))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_model_loads_onto_the_kernel_and_reports_it(kernel, tiny_model_dirs, dtype):
    loaded = load_model(str(tiny_model_dirs["llama"]), "cpu", str(dtype).removeprefix("torch."))
    checks = {check.name: check for check in loaded.plan.checks}
    assert checks["cpu_linear_kernel"].enabled and checks["prepacked_linears"].enabled
    weights = [m.packed_weight for m in loaded.model.modules() if isinstance(m, PrepackedLinear)]
    assert weights and all(w.dim() == 4 for w in weights)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_kernel_that_disagrees_leaves_the_weights_to_onednn(kernel, tiny_model_dirs, monkeypatch, dtype):
    """The kernel's own check at load (every tile size against nn.Linear) fails: oneDNN packs every weight, the
    pre-packed linears still serve, and the path says why it is off."""
    monkeypatch.setattr(models.prepack, "_blocks_error", lambda dtype: "genscore's linear disagrees (test)")
    loaded = load_model(str(tiny_model_dirs["llama"]), "cpu", str(dtype).removeprefix("torch."))
    checks = {check.name: check for check in loaded.plan.checks}
    assert not checks["cpu_linear_kernel"].enabled
    assert checks["cpu_linear_kernel"].reason == "genscore's linear disagrees (test)"
    assert checks["prepacked_linears"].enabled
    assert all(m.packed_weight.dim() == 2 for m in loaded.model.modules() if isinstance(m, PrepackedLinear))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_model_whose_kernel_numbers_are_wrong_is_served_by_plain_linears(kernel, tiny_model_dirs, monkeypatch,
                                                                          dtype):
    """Broken on purpose past the kernel's own check (its outputs scaled by half again in the model): the
    self-check's forward comparison switches the pre-packed linears off and the plain ones serve."""
    real = models.prepack._linear

    def scaled(x, packed_weight, bias):
        out = real(x, packed_weight, bias)
        return out * 1.5 if packed_weight.dim() == 4 else out

    monkeypatch.setattr(models.prepack, "_linear", scaled)
    loaded = load_model(str(tiny_model_dirs["llama"]), "cpu", str(dtype).removeprefix("torch."))
    checks = {check.name: check for check in loaded.plan.checks}
    assert not checks["prepacked_linears"].enabled and checks["prepacked_linears"].difference > 0
    assert not any(isinstance(m, PrepackedLinear) for m in loaded.model.modules())
