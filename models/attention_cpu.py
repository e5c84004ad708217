"""genscore's CPU attention kernels (models/csrc/varlen_attention.cpp): the packed-attention op, one call per layer over
the whole packed row, causal inside each segment; and a decode step's attention, each row's query against its own
keys only. Built for the machine's instruction set (just in time, ahead by `genscore build-kernels`, or shipped in a wheel
by `make wheel`) and cached; they refuse what they cannot honour."""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import platform
import threading
import time
from pathlib import Path

import torch

from models.attention_cuda import model_head_dim
from models.cpu_features import cpu_capability

log = logging.getLogger("genscore.models")

CPU_VARLEN = "cpu_varlen"  # the kernel name a ForwardPlan's attention_kernel and a PackedRow carry
# The sources of the one library of CPU kernels: the attention kernels, and the linear (models/prepack.py).
SOURCES = tuple(Path(__file__).parent / "csrc" / name for name in ("varlen_attention.cpp", "linear.cpp"))
# Where the built kernel is kept, under the cache directory: the next start loads it without compiling.
EXTENSIONS = "extensions"
# Where a wheel made by `make wheel` carries its builds made ahead (setup.py), one per instruction set.
SHIPPED = Path(__file__).parent / "kernels"
_DTYPES = (torch.float32, torch.bfloat16)
_HEAD_DIMS = (16, 32, 64, 80, 96, 128, 256)  # the head dimensions the source instantiates
# Longer segments run the per-segment loop: there SDPA's flash kernel, which blocks queries and keys for its GEMMs,
# is faster than this kernel's blocks of four queries; where that is depends on the vector width of the build
# (docs/users/performance.md).
MAX_SEGMENT = {"avx512": 384, "avx2": 128, "generic": 128}
# The same bound for segments that read a span of other keys first: the keys a query reads, its span's and its own.
MAX_SPANNED_KEYS = {target: 2 * tokens for target, tokens in MAX_SEGMENT.items()}
_FLAGS = ("-O3", "-ffast-math", "-fopenmp")  # OpenMP: at::parallel_for runs on torch's threads
# The instruction sets a build targets, named after ATen's vector capabilities: a build runs on every CPU that has its
# set, not only the one that made it, so an image can carry the builds made ahead on its build machine.
TARGETS = {
    "avx512": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma"),
    "avx2": ("-mavx2", "-mfma"),
    "generic": (),  # the compiler's baseline for the machine (SSE2 on x86-64), or another architecture's
}

# A build lock older than this is taken for one whose process was killed mid-build (a build takes well under it).
STALE_BUILD_S = 300

_lock = threading.Lock()
_built: dict[str, str | None] = {}  # "error": why the kernel could not be built (None: it is loaded); "target"; "path"


def cpu_target() -> str:
    """The build this process runs: the one for ATen's vector capability, so ATEN_CPU_CAPABILITY=avx2 (the suite's
    weaker-CPU run) takes the AVX2 build on an AVX-512 machine too."""
    return {"AVX512": "avx512", "AVX2": "avx2"}.get(cpu_capability(), "generic")


def ahead_targets() -> tuple[str, ...]:
    """The targets `genscore build-kernels` builds on this kind of machine: every x86-64 level, else the baseline."""
    return ("avx512", "avx2", "generic") if platform.machine().lower() in ("x86_64", "amd64") else ("generic",)


def build_name(target: str) -> str:
    """A build's name: its target and a hash of everything it depends on, its sources, its flags and torch's version
    (the ABI), so a cached build is only ever loaded where it was made for."""
    sources = "|".join(source.read_text() for source in SOURCES)
    key = f"{sources}|{_FLAGS}|{TARGETS[target]}|{torch.__version__}|{platform.machine()}"
    return f"genscore_cpu_kernels_{target}_{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def _put_ninja_on_path() -> None:
    """torch's builder runs `ninja` from PATH: the one the `ninja` package installed, wherever this Python runs from
    (a venv's interpreter called by its path does not put the venv's bin on PATH)."""
    try:
        import ninja
    except ImportError:
        return  # a ninja on PATH may still serve; without one the build fails and says so
    if ninja.BIN_DIR not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])


def build_error(cache_dir: Path | None) -> str | None:
    """Load the kernel built for this CPU from `cache_dir`, or build it there, once per process; None when it is
    ready, else why not.

    A machine without a C++ compiler and no build made ahead, or a build that fails, leaves the per-segment loop in
    place: the self-check reports the reason and the model loads as before."""
    with _lock:
        if "error" in _built:
            return _built["error"]
        target = _built["target"] = cpu_target()
        try:
            _built["path"] = str(_load_or_build(target, cache_dir))
            error = None if hasattr(torch.ops.genscore_cpu, "varlen_attention") else "the built library has no op"
        except Exception as exc:  # noqa: BLE001 - no compiler, no headers, a failed build: the loop stays
            error = f"genscore's CPU kernels could not be built: {type(exc).__name__}: {str(exc)[:300]}"
        _built["error"] = error
        if error is not None:
            log.warning("%s; packed attention runs one SDPA call per segment, decode steps SDPA, linears oneDNN's "
                        "kernels", error)
        return error


def built_library(target: str, cache_dir: Path) -> Path:
    """Where the build for `target` is kept under `cache_dir`."""
    name = build_name(target)
    return Path(cache_dir) / EXTENSIONS / name / f"{name}.so"


def loaded_library() -> Path | None:
    """The file this process loaded the kernels from; None before build_error() or where they could not be built."""
    return Path(_built["path"]) if _built.get("error", "not built") is None else None


def _load_or_build(target: str, cache_dir: Path | None) -> Path:
    """Load the build for `target` into torch.ops: the wheel's, else the cache directory's (compiling it first where
    `cache_dir` holds none); the file it loaded."""
    name = build_name(target)
    built = None if cache_dir is None else built_library(target, cache_dir)
    # a wheel carries its builds under their names, so only a wheel made for this source and torch has this one
    for ready in (SHIPPED / f"{name}.so", built):
        if ready is not None and ready.exists():
            torch.ops.load_library(str(ready))  # the name says it is this source for this target: no build check
            return ready
    from torch.utils.cpp_extension import _get_build_directory, load

    _put_ninja_on_path()
    if built is not None:
        built.parent.mkdir(parents=True, exist_ok=True)
    build_dir = built.parent if built is not None else Path(_get_build_directory(name, verbose=False))
    clear_stale_lock(build_dir / "lock")
    log.info("building genscore's CPU kernels %s (cached after the first start)", name)
    load(name=name, sources=[str(source) for source in SOURCES], extra_cflags=[*_FLAGS, *TARGETS[target]],
         is_python_module=False, build_directory=str(build_dir), verbose=False)
    return build_dir / f"{name}.so"


def clear_stale_lock(lock: Path, stale_after_s: float = STALE_BUILD_S, poll_s: float = 1.0) -> None:
    """Wait while another process's build of the kernel holds `lock` (torch's builder waits for that file to go,
    without end); remove it once it is older than any build takes, which means its process was killed mid-build."""
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return
        if age > stale_after_s:
            log.warning("removing %s: a build of the CPU attention kernel left it %.0f s ago and did not finish", lock,
                        age)
            lock.unlink(missing_ok=True)
            return
        time.sleep(poll_s)


def cpu_varlen_refusal(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why the CPU kernel cannot run a model on `device` in `dtype` (None: it can, subject to building it and the
    self-check)."""
    if device.type != "cpu":
        return "the CPU attention kernel runs on CPU only"
    if dtype not in _DTYPES:
        return f"the CPU attention kernel does not compute in {dtype}"
    if head_dim not in _HEAD_DIMS:
        return f"the CPU attention kernel is not built for a head dimension of {head_dim}"
    return None


def _serves(query: torch.Tensor) -> bool:
    """Whether the built kernel takes this query [1, H, T, D]: on the CPU, in a dtype and head dimension it is built for."""
    return (_built.get("error", "not built") is None and query.device.type == "cpu" and query.dtype in _DTYPES
            and query.shape[-1] in _HEAD_DIMS)


def segment_attention_cpu(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
    cu_seqlens: torch.Tensor, bounds: list[int], scaling: float | None, window: int | None,
) -> tuple[torch.Tensor, list[tuple[int, int]]] | None:
    """models/packed.py segment_attention through the CPU kernel: the result [1, T, H, D] and the segments (start,
    end) longer than MAX_SEGMENT, whose rows the kernel leaves for the caller's per-segment loop; None where it does
    not serve the call (a mask that is not a sliding window, an unbuilt kernel, no segment within the bound).

    query [1, H, T, D]; key, value [1, H_kv, T, D]; cu_seqlens [n + 1] int32 on the CPU, bounds the same on the host.
    Like the CUDA kernel it reads no mask: causal attention inside each segment, within the layer's sliding window
    where it has one. Which way a segment goes depends on its own length only, so a row's neighbours never change it.
    """
    if not _serves(query) or (attention_mask is not None and window is None):
        return None
    limit = MAX_SEGMENT[_built["target"]]
    longer = [(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b - a > limit]
    if len(longer) == len(bounds) - 1:
        return None
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    out = torch.ops.genscore_cpu.varlen_attention(
        query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),  # [T, H, D], [T, H_kv, D] x2
        cu_seqlens, None, scale, 0 if window is None else window, limit)  # [T, H, D]
    return out[None], longer  # [1, T, H, D]


def spanned_attention_cpu(row, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          scaling: float | None) -> torch.Tensor | None:
    """Segments that read a span of other keys (a shared prefix's) in full before their own keys causally, in one
    kernel call: [1, T, H, D], or None where the kernel does not serve the call (unbuilt, a segment or span too long).

    query [1, H, T, D]; key, value [1, H_kv, past + T, D] (the row's own keys last); row a models/packed.py PackedRow
    whose mask the caller built as exactly that (own_mask), its spans indexing the key rows.
    """
    if not _serves(query) or row.spans is None:
        return None
    if row.max_length + max((e - s for s, e in row.spans), default=0) > MAX_SPANNED_KEYS[_built["target"]]:
        return None
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    spans = torch.tensor(row.spans, dtype=torch.long).reshape(-1, 2)  # [n, 2]
    out = torch.ops.genscore_cpu.varlen_attention(
        query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),  # [T, H, D], [past + T, H_kv, D]
        row.cu_seqlens, spans, scale, 0, 0)  # [T, H, D]
    return out[None]  # [1, T, H, D]


def decode_attention_cpu(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, lengths: torch.Tensor,
                         scaling: float | None) -> torch.Tensor | None:
    """A decode step's attention through the CPU kernel: [B, 1, H, D], or None where the kernel does not serve the
    call (unbuilt, another dtype or head dimension, more than one query per row).

    query [B, H, 1, D]; key, value [B, H_kv, W, D] (views of the decode cache's buffers); lengths [B] int64, each
    row's real tokens, which are its last columns (the decode cache is left-padded). The kernel reads no mask: each
    row attends to exactly those columns, so the caller keeps SDPA for any layer whose mask says more (a window).
    """
    if not _serves(query) or query.shape[2] != 1 or key.stride(-1) != 1 or value.stride(-1) != 1:
        return None
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    out = torch.ops.genscore_cpu.decode_attention(query[:, :, 0], key, value, lengths, scale)  # [B, H, D]
    return out[:, None]  # [B, 1, H, D]


def model_cpu_varlen_refusal(model) -> str | None:
    """cpu_varlen_refusal for a loaded model: its device, its dtype and its attention head dimension."""
    return cpu_varlen_refusal(model.device, model.dtype, model_head_dim(model))


def build_main(argv: list[str]) -> int:
    """`--target T --cache-dir DIR`: build (and load) the kernel for one target into DIR; `genscore build-kernels`
    runs it in a process of its own per target, since loading a build for an instruction set this CPU lacks may end
    the process."""
    parser = argparse.ArgumentParser(prog="genscore build-kernels (one target)")
    parser.add_argument("--target", choices=sorted(TARGETS), required=True)
    parser.add_argument("--cache-dir", type=Path, required=True)
    args = parser.parse_args(argv)
    _load_or_build(args.target, args.cache_dir)
    return 0
