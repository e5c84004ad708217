"""A memory limit for a child process in tests: a fresh memory cgroup (v2 or v1) holding only that child, or
RLIMIT_AS when no cgroup can be created; its peak usage and the OOM kills it saw."""

from __future__ import annotations

import contextlib
import os
import resource
from collections.abc import Callable
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
# Address space a torch process maps without touching it (thread stacks, allocator arenas, shared libraries):
# RLIMIT_AS counts it, a cgroup does not, so the fallback adds it to the limit (`genscore serve` on the default
# model: VmSize - VmRSS measured at 1.4 GB; a 4 GiB allowance keeps a new thread's arena from failing the start).
VIRTUAL_SLACK_BYTES = 4 << 30


class NoMemoryLimit(RuntimeError):
    """Neither a cgroup nor RLIMIT_AS can limit a child here; the message says why."""


def _own_cgroup(line_filter: Callable[[str], bool]) -> str | None:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if line_filter(controllers):
            return path
    return None


class MemoryLimit:
    """Limit one child process to `limit_bytes`: pass `preexec` as Popen's preexec_fn, call close() when it is gone."""

    def __init__(self, limit_bytes: int):
        self.limit_bytes = limit_bytes
        self.kind = ""
        self.folder: Path | None = None
        errors = []
        for make in (self._make_v2, self._make_v1):
            try:
                self.folder = make()
                return
            except OSError as exc:
                errors.append(f"{make.__name__[6:]}: {exc}")
        try:  # the child sets it; here only check that the limit can be raised back to where it is
            soft, hard = resource.getrlimit(resource.RLIMIT_AS)
            if hard != resource.RLIM_INFINITY and hard < limit_bytes + VIRTUAL_SLACK_BYTES:
                raise OSError(f"hard RLIMIT_AS {hard} is below the limit")
            self.kind = "rlimit_as"
        except (OSError, ValueError) as exc:
            errors.append(f"rlimit_as: {exc}")
            raise NoMemoryLimit("; ".join(errors)) from None

    def _make_v2(self) -> Path:
        if not (CGROUP_ROOT / "cgroup.controllers").is_file():
            raise OSError("no cgroup v2 hierarchy at /sys/fs/cgroup")
        own = _own_cgroup(lambda controllers: controllers == "")
        parent = CGROUP_ROOT / (own or "/").lstrip("/")
        if "memory" not in (parent / "cgroup.subtree_control").read_text().split():
            raise OSError(f"the memory controller is not enabled below {parent}")
        folder = parent / f"genscore-test-{os.getpid()}-{id(self)}"
        folder.mkdir()
        (folder / "memory.max").write_text(str(self.limit_bytes))
        with contextlib.suppress(OSError):
            (folder / "memory.swap.max").write_text("0")
        self.kind = "cgroup_v2"
        return folder

    def _make_v1(self) -> Path:
        base = CGROUP_ROOT / "memory"
        if not (base / "memory.limit_in_bytes").is_file():
            raise OSError("no cgroup v1 memory hierarchy at /sys/fs/cgroup/memory")
        own = _own_cgroup(lambda controllers: "memory" in controllers.split(","))
        folder = None
        # inside our own cgroup first (its limits then apply too); the hierarchy's root if that one is not writable
        for parent in (base / (own or "/").lstrip("/"), base):
            try:
                folder = parent / f"genscore-test-{os.getpid()}-{id(self)}"
                folder.mkdir()
                break
            except OSError:
                folder = None
        if folder is None:
            raise OSError(f"cannot create a cgroup under {base}")
        (folder / "memory.limit_in_bytes").write_text(str(self.limit_bytes))
        with contextlib.suppress(OSError):  # without swap accounting the file is absent: nothing to swap to then
            (folder / "memory.memsw.limit_in_bytes").write_text(str(self.limit_bytes))
        self.kind = "cgroup_v1"
        return folder

    def preexec(self) -> None:
        """Runs in the child between fork and exec: join the cgroup (or set RLIMIT_AS) before anything is loaded."""
        if self.folder is not None:
            (self.folder / "cgroup.procs").write_text(str(os.getpid()))
        else:
            limit = self.limit_bytes + VIRTUAL_SLACK_BYTES
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    def _read(self, name: str) -> str:
        return (self.folder / name).read_text() if self.folder is not None else ""

    def peak_bytes(self) -> int | None:
        """The cgroup's peak usage (page cache included); None under RLIMIT_AS."""
        if self.kind == "cgroup_v1":
            return int(self._read("memory.max_usage_in_bytes"))
        if self.kind == "cgroup_v2":
            with contextlib.suppress(OSError):
                return int(self._read("memory.peak"))
        return None

    def oom_kills(self) -> int:
        """Processes the kernel killed for want of memory in the cgroup (0 under RLIMIT_AS: it fails allocations)."""
        name = {"cgroup_v1": "memory.oom_control", "cgroup_v2": "memory.events"}.get(self.kind)
        if name is None:
            return 0
        for line in self._read(name).splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def close(self) -> None:
        """Remove the cgroup; its processes must have exited (a leftover is moved to the parent first)."""
        if self.folder is None or not self.folder.exists():
            return
        with contextlib.suppress(OSError):
            for pid in self._read("cgroup.procs").split():
                (self.folder.parent / "cgroup.procs").write_text(pid)
        with contextlib.suppress(OSError):
            self.folder.rmdir()
