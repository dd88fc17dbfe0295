"""The gate Triton's model instances wait at, so that Triton starts while the served model is still loading.

`DeployPyTriton.deploy` starts Triton before the model it serves has loaded. Each model instance's `initialize`
(`deploy/triton_stub_model.py`, in Triton's backend processes) sets up PyTriton's proxy, marks itself held, and
waits at the gate. Triton opens its ports only once every model is loaded, so no client reaches it meanwhile.
`DeployPyTriton.run` opens the gate once the model has answered its warm-up request: Triton's ports open within
the gate's poll interval. `stop` before that closes it for good instead: the instances fail their load and the
starting Triton exits.

The gate is a file in Triton's workspace, which the model config gives the instances (`workspace-path`), written
atomically with the verdict. This file is copied beside the stub model into Triton's model repository: it imports
the standard library only.
"""

from __future__ import annotations

import os
import pathlib
import time

GATE_FILE = "models-gate"
HELD_SUFFIX = ".held"
SERVE = "serve"
STOP = "stop"
POLL_S = 0.005


def decide(workspace: pathlib.Path, verdict: str) -> None:
    """Open the gate in `workspace`: `SERVE` lets the instances go, `STOP` fails their load."""
    staged = workspace / f"{GATE_FILE}.{os.getpid()}"
    staged.write_text(verdict)
    staged.replace(workspace / GATE_FILE)  # the instances never read a half-written verdict


def decided(workspace: pathlib.Path) -> bool:
    """Whether the gate in `workspace` is open (either way)."""
    return (workspace / GATE_FILE).exists()


def held(workspace: pathlib.Path) -> int:
    """How many model instances have reached the gate in `workspace` so far."""
    return sum(1 for _ in workspace.glob(f"*{HELD_SUFFIX}"))


def wait_at_gate(workspace: pathlib.Path, instance: str) -> bool:
    """Mark `instance` held, then wait until the gate opens: True to serve, False to stop."""
    (workspace / f"{instance}{HELD_SUFFIX}").touch()
    gate = workspace / GATE_FILE
    while not gate.exists():
        time.sleep(POLL_S)
    return gate.read_text() == SERVE
