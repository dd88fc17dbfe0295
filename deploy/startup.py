"""Checks and environment set-up that must happen before PyTriton starts Triton.

- The Python-backend stub that Triton spawns loads `libpython3.X.so.1.0` through the dynamic loader; with a
  pyenv or conda Python the loader may pick the system's libpython of another patch release, and the model
  fails to load (`'_thread.RLock' object has no attribute '_recursion_count'`). PyTriton copies `os.environ`
  when it spawns Triton, so putting this interpreter's LIBDIR first on `LD_LIBRARY_PATH` in-process is enough.
- Triton 2.51 (embedded in PyTriton 0.7.0) copies an HTTP JSON request body onto the stack of the thread that
  parses it, so a body over half the thread stack size (4 MB under the usual 8 MiB) crashes the whole server
  (Triton issue #5840). Triton's threads take their stack size from `RLIMIT_STACK` when it starts: raising that
  limit in-process first lifts the crash to bodies over `TRITON_STACK_BYTES / 2`.
- Busy ports and a missing model repository are reported before anything starts, naming what to change.
"""

from __future__ import annotations

import logging
import os
import resource
import socket
import sysconfig
from collections.abc import Iterable
from pathlib import Path

LOGGER = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"

TRITON_STACK_BYTES = 256 * 1024 * 1024
"""The stack size Triton's threads get: HTTP JSON bodies up to half of it parse safely."""


class DeployError(RuntimeError):
    """A deployment cannot start; the message says what to change."""


class PortInUseError(DeployError):
    """A port Triton needs is already taken."""


class ModelRepositoryError(DeployError):
    """The model repository to serve is missing or is not an exported model directory."""


def libpython_dir() -> Path | None:
    """The directory holding this interpreter's shared libpython, or None for a statically linked Python."""
    libdir = sysconfig.get_config_var("LIBDIR")
    soname = sysconfig.get_config_var("INSTSONAME") or sysconfig.get_config_var("LDLIBRARY")
    if not sysconfig.get_config_var("Py_ENABLE_SHARED") or not libdir or not soname:
        return None
    return Path(libdir) if (Path(libdir) / soname).exists() else None


def ensure_libpython_on_library_path() -> Path | None:
    """Put this interpreter's libpython directory first on `LD_LIBRARY_PATH` for the Triton processes."""
    libdir = libpython_dir()
    if libdir is None:
        LOGGER.warning(
            "this Python has no shared libpython; Triton's Python backend stub will load the system's "
            "libpython, which works only if it is the same release. Use a Python built with --enable-shared."
        )
        return None
    entries = [e for e in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep) if e and e != str(libdir)]
    os.environ["LD_LIBRARY_PATH"] = os.pathsep.join([str(libdir), *entries])
    return libdir


def raise_stack_limit_for_triton() -> int:
    """Raise `RLIMIT_STACK` (soft) to TRITON_STACK_BYTES, within the hard limit, for the processes started next;
    returns the new soft limit. This process's own threads keep the stack size they were started with."""
    soft, hard = resource.getrlimit(resource.RLIMIT_STACK)
    wanted = TRITON_STACK_BYTES if hard == resource.RLIM_INFINITY else min(TRITON_STACK_BYTES, hard)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(resource.RLIMIT_STACK, (wanted, hard))
        return wanted
    return soft


def _family(address: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in address else socket.AF_INET


def port_in_use(address: str, port: int) -> bool:
    """Whether a server already listens on `port` at `address` (sockets in TIME_WAIT do not count)."""
    with socket.socket(_family(address), socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((address, port))
        except OSError:
            return True
    return False


def free_port(address: str = "127.0.0.1") -> int:
    """A port nothing listens on at `address` now (the OS picks it)."""
    with socket.socket(_family(address), socket.SOCK_STREAM) as probe:
        probe.bind((address, 0))
        return probe.getsockname()[1]


def check_port_free(address: str, port: int, what: str, how_to_change: str) -> None:
    """PortInUseError naming the port and how to pick another if something listens on it."""
    if not 0 < port < 65536:
        raise PortInUseError(f"{what} port {port} is not a valid port number; set {how_to_change} to 1-65535")
    if port_in_use(address, port):
        raise PortInUseError(
            f"{what} port {port} on {address} is already in use (another Triton server?); "
            f"choose a free port with {how_to_change}"
        )


def pick_metrics_port(address: str, http_port: int, taken: Iterable[int]) -> int:
    """The metrics port: HTTP port + 2 as Triton's defaults have it, or any free port if that one is busy."""
    wanted = http_port + 2
    if wanted < 65536 and wanted not in set(taken) and not port_in_use(address, wanted):
        return wanted
    return free_port(address)


def check_model_repository(path: str | os.PathLike) -> Path:
    """The repository path if it holds an exported model (a manifest.json); ModelRepositoryError otherwise."""
    repository = Path(path).expanduser()
    hint = (
        "export a checkpoint into it with --visual_checkpoint (-vc), or point --triton_model_repository "
        "(-tmr) at a directory written by TensorRTMMExporter.export"
    )
    if not repository.exists():
        raise ModelRepositoryError(f"model repository {repository} does not exist; {hint}")
    if not repository.is_dir():
        raise ModelRepositoryError(f"model repository {repository} is not a directory; {hint}")
    if not (repository / MANIFEST_NAME).is_file():
        raise ModelRepositoryError(
            f"model repository {repository} has no {MANIFEST_NAME}, so it is not an exported model; {hint}"
        )
    return repository
