"""What this CPU runs natively, as torch sees it: ATen's vector capability (which ATEN_CPU_CAPABILITY caps) and bfloat16."""

from __future__ import annotations

import functools
import platform
from pathlib import Path

import torch

# The /proc/cpuinfo flags that decide the bfloat16 and float32 kernels, named in logs and the benchmark.
_NAMED_FLAGS = ("avx2", "avx512f", "avx512bw", "avx512_bf16", "amx_bf16", "avx_ne_convert")


def cpu_capability() -> str:
    """ATen's vector capability in force ("AVX512", "AVX2", "DEFAULT", ...): the CPU's, or lower under
    ATEN_CPU_CAPABILITY, the setting that runs the suite as if on a weaker CPU."""
    return torch.backends.cpu.get_cpu_capability()


@functools.cache
def _cpuinfo() -> str:
    """Linux's /proc/cpuinfo ("" elsewhere), read once for the flags, the vendor and the model name."""
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


@functools.cache
def cpu_flags() -> tuple[str, ...]:
    """The named instruction-set flags this CPU reports (Linux /proc/cpuinfo; empty elsewhere)."""
    words = set(_cpuinfo().split())
    return tuple(flag for flag in _NAMED_FLAGS if flag in words)


@functools.cache
def cpu_vendor() -> str:
    """The vendor this CPU reports ("GenuineIntel", "AuthenticAMD"; Linux /proc/cpuinfo, "" elsewhere)."""
    for line in _cpuinfo().splitlines():
        if line.startswith("vendor_id"):
            return line.split(":", 1)[1].strip()
    return ""


@functools.cache
def cpu_model_name() -> str:
    """The CPU's model name (Linux /proc/cpuinfo, else what Python's platform module reports, else "unknown")."""
    for line in _cpuinfo().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def describe_cpu() -> str:
    """One phrase for logs: ATen's capability and the named flags, e.g. "AVX2; flags avx2"."""
    return f"ATen {cpu_capability()}; flags {' '.join(cpu_flags()) or 'unknown'}"


def bfloat16_packing_missing() -> str | None:
    """Why oneDNN cannot pack bfloat16 linear weights here (None when it can): its bfloat16 path needs AVX-512
    (avx512bw/vl/dq) or avx_ne_convert, and genscore also asks for ATen at AVX-512, so that ATEN_CPU_CAPABILITY=avx2
    turns the path off on a CPU that has it."""
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return f"oneDNN's bfloat16 path needs avx512bw/vl/dq or avx_ne_convert ({describe_cpu()})"
    if cpu_capability() != "AVX512":
        return f"ATen runs at {cpu_capability()} (ATEN_CPU_CAPABILITY or the CPU; {describe_cpu()})"
    return None


def native_bfloat16_missing() -> str | None:
    """Why bfloat16 matrix products have no native instructions here (None when avx512_bf16 or AMX run them):
    without them bfloat16 is emulated and runs several times slower than float32."""
    if cpu_capability() == "AVX512" and (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()):
        return None
    return f"no avx512_bf16 or amx_bf16 in use ({describe_cpu()})"
