"""Triton kernels checked on the CPU: a test file run again in a child pytest (under Triton's interpreter, or
compiling for a GPU it does not have)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TRITON_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def run_under_triton_interpreter(test_file: str) -> None:
    """Run ``test_file`` again in a child pytest with ``TRITON_INTERPRET=1`` (Triton reads it only when imported,
    so kernel checks on the CPU run in a fresh process); fails with the child's output if any check fails."""
    if TRITON_INTERPRETED:
        pytest.skip("this is the child run")
    run_child_pytest(test_file, {"TRITON_INTERPRET": "1"})


def run_child_pytest(test_file: str, variables: dict[str, str | None]) -> None:
    """Run ``test_file`` in a child pytest with the environment's ``variables`` set (None: unset); fails with the
    child's output unless every check it collected passed."""
    root = Path(__file__).resolve().parents[2]
    environment = {**os.environ, **variables,
                   "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    environment = {name: value for name, value in environment.items() if value is not None}
    child = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", test_file],
                           cwd=root, env=environment, capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stdout[-6000:] + child.stderr[-2000:]
    assert " passed" in child.stdout and "failed" not in child.stdout
