"""The whole tree passes ruff with the rules of pyproject.toml's [tool.ruff] (CI runs it as part of make test)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_ruff_finds_nothing():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert ruff, "ruff is a test dependency (pyproject.toml's test extra)"
    result = subprocess.run([ruff, "check", "--no-cache", str(REPO)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
