"""The bounded load script, run briefly against a real server process on a tiny model: at several times capacity,
with clients leaving midway, no request is lost, none errs, every 200 is its own request's answer, every refusal
carries Retry-After, and the server still serves afterwards (the script's exit status says all of that)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "loadtest.py"


def test_overload_with_disconnects_loses_and_mixes_up_nothing(tiny_model_dirs):
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--model", str(tiny_model_dirs["llama"]), "--factor", "4", "--duration", "3",
         "--capacity-requests", "80", "--concurrency", "16", "--pool", "16", "--max-queued-requests", "16",
         "--client-timeout", "60", "--start-timeout", "120"],
        capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    overload = next(line for line in result.stdout.splitlines() if line.startswith("| 4x overload"))
    cells = [c.strip() for c in overload.strip("|").split("|")]
    sent, ok, refused, deadline, abandoned, errors, lost, wrong = map(int, cells[1:9])
    assert lost == 0 and wrong == 0 and errors == 0
    assert sent == ok + refused + deadline + abandoned  # every request is accounted for
    assert ok > 0 and abandoned > 0
