"""`genscore build-kernels`: the CPU attention kernel built ahead for each instruction set (as the Dockerfile's build
stage does), then loaded, with no compiler, by a process of each instruction set this CPU runs, with SDPA's numbers;
and `make wheel`'s wheel, which carries those builds."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from app.cli import main
from models import attention_cpu
from tests.ops.test_warm_cache import run_cli

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None, reason="no C++ compiler")

# ATEN_CPU_CAPABILITY for a process that runs each target's build, weakest first
CAPABILITY = {"generic": "default", "avx2": "avx2", "avx512": "avx512"}

# In a process of its own (one library per process registers the op): load the kernel from the cache directory
# argv[1], run four segments of GQA attention through it, and compare each with causal SDPA in float64.
CHECK = """
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from models.attention_cpu import build_error, cpu_target

error = build_error(Path(sys.argv[1]))
if error is not None:
    sys.exit(error)
torch.manual_seed(0)
lengths = [5, 37, 1, 90]
tokens = sum(lengths)
q, k, v = torch.randn(tokens, 4, 64), torch.randn(tokens, 2, 64), torch.randn(tokens, 2, 64)
cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
out = torch.ops.genscore_cpu.varlen_attention(q, k, v, cu, None, 64 ** -0.5, 0, 0)  # [T, H, D]
worst = 0.0
for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
    segment = [t[start:end].transpose(0, 1).double() for t in (q, k, v)]  # [H, L, D]
    reference = F.scaled_dot_product_attention(*segment, is_causal=True, enable_gqa=True).transpose(0, 1)
    worst = max(worst, (out[start:end].double() - reference).abs().max().item())
print(cpu_target(), worst)
"""


def _check(target: str, cache_dir: Path, code: Path = REPO) -> subprocess.CompletedProcess:
    """CHECK as a process of `target`'s instruction set, with genscore's packages from `code`, whose compiler always
    fails: only a build made ahead serves."""
    env = dict(os.environ, ATEN_CPU_CAPABILITY=CAPABILITY[target], CXX="false", PYTHONPATH=str(code))
    return subprocess.run([sys.executable, "-c", CHECK, str(cache_dir)], env=env, capture_output=True, text=True,
                          timeout=300, cwd=code)


def _runnable_targets() -> list[str]:
    """This CPU's target and the weaker ones that also run here."""
    order = list(CAPABILITY)
    return order[: order.index(attention_cpu.cpu_target()) + 1]


@pytest.fixture(scope="module")
def built_ahead(tmp_path_factory) -> Path:
    cache_dir = tmp_path_factory.mktemp("kernels")
    assert run_cli("build-kernels", "--cache-dir", str(cache_dir)) == 0
    return cache_dir


def test_build_kernels_builds_every_target_of_the_machine(built_ahead):
    for target in attention_cpu.ahead_targets():
        assert attention_cpu.built_library(target, built_ahead).is_file(), target


@pytest.mark.parametrize("target", list(CAPABILITY))
def test_a_build_made_ahead_is_loaded_without_a_compiler_and_gives_sdpa_numbers(built_ahead, target):
    if target not in _runnable_targets():
        pytest.skip(f"this CPU does not run the {target} build")
    result = _check(target, built_ahead)
    assert result.returncode == 0, result.stderr[-2000:]
    served, worst = result.stdout.split()
    assert served == target
    assert float(worst) < 1e-5


def test_another_targets_build_is_not_loaded(built_ahead, tmp_path):
    """A cache holding only a weaker CPU's build: the process wants its own, and without a compiler keeps the loop."""
    if "avx2" not in _runnable_targets()[:-1]:
        pytest.skip("needs a CPU above AVX2")
    only_avx2 = attention_cpu.built_library("avx2", built_ahead).parent
    shutil.copytree(only_avx2, tmp_path / attention_cpu.EXTENSIONS / only_avx2.name)
    result = _check(_runnable_targets()[-1], tmp_path)
    assert result.returncode != 0
    assert "could not be built" in result.stderr


@pytest.fixture(scope="module")
def wheel(built_ahead, tmp_path_factory) -> Path:
    """`make wheel` from a copy of the source tree, taking the builds `built_ahead` holds rather than compiling."""
    work = tmp_path_factory.mktemp("wheel")
    source = work / "source"
    for package in ("app", "models", "sampler"):
        shutil.copytree(REPO / package, source / package, ignore=shutil.ignore_patterns("__pycache__", "kernels"))
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(REPO / name, source / name)
    env = dict(os.environ, GENSCORE_WHEEL_KERNELS=str(built_ahead))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "--quiet",
                    "--wheel-dir", str(work / "dist"), str(source)], env=env, check=True, timeout=600, cwd=work)
    (built,) = (work / "dist").glob("*.whl")
    return built


def test_the_wheel_carries_a_build_for_every_target_and_names_its_platform(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for target in attention_cpu.ahead_targets():
        assert f"models/kernels/{attention_cpu.build_name(target)}.so" in names, target
    assert "models/csrc/varlen_attention.cpp" in names  # the builds' names hash their sources
    assert wheel.name.startswith("genscore-0.1.0-py3-none-") and not wheel.name.endswith("-any.whl")


def test_a_server_installed_from_the_wheel_loads_its_kernels_without_a_compiler(wheel, tmp_path):
    installed, empty_cache = tmp_path / "site-packages", tmp_path / "cache"
    zipfile.ZipFile(wheel).extractall(installed)
    empty_cache.mkdir()
    result = _check(attention_cpu.cpu_target(), empty_cache, code=installed)
    assert result.returncode == 0, result.stderr[-2000:]
    served, worst = result.stdout.split()
    assert served == attention_cpu.cpu_target()
    assert float(worst) < 1e-5
    assert not any(empty_cache.iterdir())  # nothing was built


def test_cpu_target_follows_atens_capability(monkeypatch):
    for capability, target in (("AVX512", "avx512"), ("AVX2", "avx2"), ("DEFAULT", "generic"), ("SVE256", "generic")):
        monkeypatch.setattr(attention_cpu, "cpu_capability", lambda capability=capability: capability)
        assert attention_cpu.cpu_target() == target


def test_build_kernels_is_a_listed_command(capsys):
    assert main(["--help"]) == 0
    assert "build-kernels" in capsys.readouterr().out
