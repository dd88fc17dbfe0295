"""A separate virtual environment with NeMo's ASR collection (`nemo_toolkit[asr]`), built once and cached outside
the repository, to run NeMo's own modules as a numerical reference. NeMo cannot live in the project venv (it wants
numpy>=2 where PyTriton pins numpy<2).

Cache: $NEMO_MM_DEPLOY_CACHE or ~/.cache/nemo-mm-deploy, one `nemo-ref-<version>` venv per NeMo version; a venv is
reused when its `.complete` marker exists. torch is installed first at the project's own version (never resolved by
pip, which would pull CUDA wheels), then NeMo with torch held at that version. A first build takes about 2 minutes
per version with a warm pip cache (measured: 95 s for 3.0.0, 137 s for 2.4.0) and 2.2 GB of disk each.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

# NeMo release whose audio front end and conv subsampling each frontend of exporter.perception.audio reproduces
NEMO_VERSIONS = {"nemo-2.4": "2.4.0", "nemo-2.5": "3.0.0"}
# pins beyond NeMo's own metadata: NeMo 2.4's ASR extra caps numpy<2, but pip otherwise picks a pyarrow (for
# `datasets`) released later that needs numpy 2
EXTRA_CONSTRAINTS = {"2.4.0": ["pyarrow<22"]}
REFERENCE_SCRIPT = Path(__file__).with_name("nemo_asr_reference.py")
_INSTALL_TIMEOUT_S = 1800


class NemoEnvUnavailable(RuntimeError):
    """The NeMo venv cannot be built here (no package index, no matching wheels); the message says why."""


def cache_dir() -> Path:
    return Path(os.environ.get("NEMO_MM_DEPLOY_CACHE", Path.home() / ".cache" / "nemo-mm-deploy")).expanduser()


def _pip(python: Path, *args: str, log: Path) -> None:
    with open(log, "a") as out:
        out.write(f"$ pip {' '.join(args)}\n")
        out.flush()
        done = subprocess.run([str(python), "-m", "pip", "install", "--disable-pip-version-check", *args],
                              stdout=out, stderr=subprocess.STDOUT, timeout=_INSTALL_TIMEOUT_S)
    if done.returncode:
        tail = "".join(log.read_text().splitlines(keepends=True)[-8:])
        raise NemoEnvUnavailable(f"pip install {' '.join(args)} failed (log {log}):\n{tail}")


def nemo_python(version: str) -> Path:
    """The python of the cached NeMo `version` venv, building it first if needed (a few minutes, once)."""
    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    venv = root / f"nemo-ref-{version}"
    python = venv / "bin" / "python"
    with open(root / f".nemo-ref-{version}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder at a time; others wait and reuse
        if (venv / ".complete").exists():
            return python
        shutil.rmtree(venv, ignore_errors=True)
        start = time.monotonic()
        log = root / f"nemo-ref-{version}.log"
        log.write_text("")
        try:
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True)
            torch_pin = f"torch=={torch.__version__.split('+')[0]}"
            _pip(python, torch_pin, log=log)
            constraints = venv / "torch-constraint.txt"
            constraints.write_text("\n".join([torch_pin, *EXTRA_CONSTRAINTS.get(version, [])]) + "\n")
            _pip(python, "-c", str(constraints), f"nemo_toolkit[asr]=={version}", log=log)
        except (NemoEnvUnavailable, subprocess.SubprocessError, OSError) as error:
            shutil.rmtree(venv, ignore_errors=True)
            if isinstance(error, NemoEnvUnavailable):
                raise
            raise NemoEnvUnavailable(f"cannot create the NeMo {version} venv: {error}") from error
        (venv / ".complete").write_text(json.dumps({"version": version, "install_s": time.monotonic() - start}))
    return python


def run_reference(version: str, cases: list[dict], workdir: Path, timeout_s: int = 600) -> None:
    """Runs tests/support/nemo_asr_reference.py on `cases` (see its docstring) with NeMo `version` (`-P`: the
    script's folder, whose module names could shadow packages, is not on its path)."""
    python = nemo_python(version)
    spec = workdir / f"nemo-{version}-spec.json"
    spec.write_text(json.dumps({"cases": cases}))
    done = subprocess.run([str(python), "-P", str(REFERENCE_SCRIPT), str(spec)], capture_output=True, text=True,
                          timeout=timeout_s, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if done.returncode:
        raise RuntimeError(f"NeMo {version} reference failed:\n{done.stderr[-4000:]}")
