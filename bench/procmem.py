"""Memory of a server's process tree: summed peak RSS and current PSS (vLLM's engine core is a child process)."""

from __future__ import annotations

from pathlib import Path


def process_tree(pid: int) -> list[int]:
    """pid and all its live descendants (vLLM runs its engine core in a child process)."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        for task in Path(f"/proc/{current}/task").glob("*"):
            try:
                todo += [int(child) for child in (task / "children").read_text().split()]
            except OSError:
                continue
    return found


def _status_kb(pid: int, field: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _pss_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def tree_memory_mb(pid: int) -> dict:
    """The tree's summed peak RSS (VmHWM per process; shared libraries count once per process) and its PSS now."""
    pids = process_tree(pid)
    return {"peak_rss_mb": sum(_status_kb(p, "VmHWM") for p in pids) / 1024,
            "pss_mb": sum(_pss_kb(p) for p in pids) / 1024, "processes": len(pids)}
