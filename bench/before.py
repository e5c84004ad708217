"""`--before REF`: genscore at an older commit, measured in the same run as today's code.

The old code is checked out once into a git worktree under .cache/bench/before-<shortsha> and run with this
venv, its tree first on PYTHONPATH and as the working directory, so that `app`, `models`, `sampler` and `bench`
resolve to it. Every process started that way checks, before it runs anything, that `app` really came from
that tree: an editable install or a stray path entry would otherwise measure today's code twice.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

# Run as `python -c`: imports `app`, stops with exit code 3 unless it lies under GENSCORE_BENCH_ROOT, says
# which code runs, then runs the module named by the first argument as __main__ with the rest as its argv.
_LAUNCH = """\
import os, runpy, sys
root = os.path.realpath(os.environ["GENSCORE_BENCH_ROOT"])
import app
where = os.path.realpath(app.__file__)
if not where.startswith(root + os.sep):
    sys.stderr.write(f"[before] app imported from {where}, not from {root}: refusing to run\\n")
    sys.exit(3)
sys.stderr.write(f"[before] running genscore code from {os.path.dirname(where)}\\n")
sys.stderr.flush()
module, sys.argv = sys.argv[1], sys.argv[1:]
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


def commit_facts(repo: Path) -> dict:
    """The commit checked out at repo, and whether tracked files differ from it (uncommitted changes measured)."""
    return {"commit": git(repo, "rev-parse", "HEAD"),
            "dirty": bool(git(repo, "status", "--porcelain", "--untracked-files=no"))}


@dataclass(frozen=True)
class BeforeTree:
    """The older code's worktree: its full and short commit, and the suffix of its systems' names."""

    path: Path
    commit: str
    short: str

    @property
    def suffix(self) -> str:
        return f" (before {self.short})"

    def env(self, base: dict | None = None) -> dict:
        env = dict(os.environ if base is None else base)
        inherited = env.get("PYTHONPATH")
        env["PYTHONPATH"] = str(self.path) + (os.pathsep + inherited if inherited else "")
        env["GENSCORE_BENCH_ROOT"] = str(self.path)
        return env

    def command(self, module: str, *args: str) -> list[str]:
        """`python -m module args` from this tree, through the check that the tree's code is what runs."""
        return [sys.executable, "-c", _LAUNCH, module, *args]

    def verify(self) -> str:
        """Where `app` comes from in a process started as the benchmark starts them; SystemExit if not this tree."""
        probe = subprocess.run([sys.executable, "-c", _LAUNCH, "json.tool", "--help"], cwd=self.path,
                               env=self.env(), capture_output=True, text=True)
        if probe.returncode != 0:
            raise SystemExit(f"--before {self.short}: {probe.stderr.strip() or 'the code check failed'}")
        return next(line for line in probe.stderr.splitlines() if line.startswith("[before]"))


def prepare(ref: str, repo: Path) -> BeforeTree:
    """A detached worktree of ref under repo/.cache/bench, reused when it is already at that commit."""
    commit = git(repo, "rev-parse", "--verify", f"{ref}^{{commit}}")
    short = git(repo, "rev-parse", "--short", commit)
    path = repo / ".cache" / "bench" / f"before-{short}"
    if path.exists():
        at = git(path, "rev-parse", "HEAD") if (path / ".git").exists() else None
        if at != commit:
            raise SystemExit(f"{path} exists but is not a worktree at {commit} (it is at {at}); "
                             f"remove it (git worktree remove --force {path}) and run again")
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        git(repo, "worktree", "add", "--detach", str(path), commit)
    return BeforeTree(path.resolve(), commit, short)
