"""`genscore serve` with a gate in the model's forward pass, so a test can hold a real server's work exactly where
it wants it (a forward pass running, a generation step in flight) and send signals around it.

Run as `python tests/ops/gated_serve.py serve ...`. The gate is a folder named by TEST_GATE_DIR: once the file
`armed` exists there, each forward pass touches `entered` and waits until `open` exists. Before `armed` (start-up
and warm-up) the gate does nothing.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import models

_HOLD_TIMEOUT_S = 120.0  # a gate the test never opens fails the pass instead of hanging the process


def _install_gate(loaded: models.LoadedModel, folder: Path) -> None:
    def hold(module, args, kwargs):
        if not (folder / "armed").exists():
            return
        (folder / "entered").touch()
        deadline = time.monotonic() + _HOLD_TIMEOUT_S
        while not (folder / "open").exists():
            if time.monotonic() > deadline:
                raise RuntimeError("the test never opened the gate")
            time.sleep(0.005)

    loaded.model.base_model.register_forward_pre_hook(hold, with_kwargs=True)


def main() -> int:
    folder = Path(os.environ["TEST_GATE_DIR"])
    load_model = models.load_model

    def gated_load_model(*args, **kwargs):
        loaded = load_model(*args, **kwargs)
        _install_gate(loaded, folder)
        return loaded

    models.load_model = gated_load_model  # app.main imports it from `models` when app.cli.serve imports app.main
    from app.cli import main as cli_main

    return cli_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
