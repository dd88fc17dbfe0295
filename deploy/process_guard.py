"""Triton's processes and files die with the serving process, even when it is killed with SIGKILL.

PyTriton starts `tritonserver`, which starts one Python-backend process per model instance, each with helper
processes; they hold the server's ports and shared memory under /dev/shm. PyTriton asks the kernel to send
`tritonserver` SIGTERM when the serving process dies, and Triton then shuts down gracefully: tens of seconds with
the ports still bound, since its backend processes wait for a serving process that is gone.

`ProcessGuard` is a small separate process that holds a pipe from the serving process. It keeps a list of the
processes running from the serving process's Triton workspace (and their descendants); when the pipe closes, the
serving process has ended (cleanly or killed), and the guard kills whatever is left of them with SIGKILL, removes
the shared memory they had mapped and the workspace, and exits. `clean_stale_files` removes what a guard could not
(PyTriton's shared memory and this package's workspaces whose serving process is gone).

This module is run as a script for the guard itself; it imports the standard library only.
"""

from __future__ import annotations

import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

SHM_DIR = Path("/dev/shm")
WORKSPACE_PREFIX = "nemo-mm-deploy-"
_PYTRITON_SHM = re.compile(r"pytrtion(\d+)-")  # PyTriton's region prefix: "pytrtion<pid>-<hex>" (sic)
_WORKSPACE = re.compile(re.escape(WORKSPACE_PREFIX) + r"(\d+)-")
_SCAN_INTERVAL_S = 0.5
_KILL_WAIT_S = 10.0


def workspace_path(root: Path) -> Path:
    """A fresh Triton workspace path under `root` named after this process (found again if it is left behind)."""
    return root / f"{WORKSPACE_PREFIX}{os.getpid()}-{os.urandom(4).hex()}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale_files(workspace_root: Path, shm_dir: Path = SHM_DIR) -> list[Path]:
    """Remove PyTriton shared memory and this package's Triton workspaces whose serving process is gone."""
    removed = []
    for folder, pattern in ((shm_dir, _PYTRITON_SHM), (workspace_root, _WORKSPACE)):
        if not folder.is_dir():
            continue
        for path in folder.iterdir():
            match = pattern.match(path.name)
            if match and not _alive(int(match.group(1))):
                _remove(path)
                removed.append(path)
    return removed


def _remove(path: Path) -> None:
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    except OSError:
        pass


class ProcessGuard:
    """The guard process of this serving process's Triton workspace (see the module doc)."""

    def __init__(self, workspace: Path):
        read_end, self._write_end = os.pipe()
        self.process = subprocess.Popen(
            [sys.executable, "-I", "-S", str(Path(__file__).resolve()), str(os.getpid()), str(workspace)],
            stdin=read_end, stdout=subprocess.DEVNULL, start_new_session=True,  # outlives Ctrl-C and killpg
        )
        os.close(read_end)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Let the guard clean up what is left now and exit (as it would if this process died)."""
        if self._write_end is not None:
            os.close(self._write_end)
            self._write_end = None
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()


# --- the guard process -----------------------------------------------------------------------------------------


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time) of a process, or None if it is gone (or a zombie, dead but not yet reaped)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return None if fields[0] == "Z" else (int(fields[1]), int(fields[19]))


def _scan(workspace: str, tracked: dict[int, int]) -> None:
    """Add to `tracked` (pid -> start time) the processes run from `workspace` and their descendants."""
    parents: dict[int, tuple[int, int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat := _stat(int(entry))) is not None:
            parents[int(entry)] = stat
    for pid, (_, start) in parents.items():
        try:
            exe = os.readlink(f"/proc/{pid}/exe")
        except OSError:
            continue
        if exe.startswith(workspace + os.sep):
            tracked[pid] = start
    grew = True
    while grew:
        grew = False
        for pid, (parent, start) in parents.items():
            if parent in tracked and pid not in tracked:
                tracked[pid] = start
                grew = True


def _shared_memory_of(pid: int) -> set[str]:
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return set()
    fields = (line.split(None, 5) for line in maps.splitlines())
    return {parts[5] for parts in fields if len(parts) == 6 and parts[5].startswith(f"{SHM_DIR}/")}


def _finish(owner: int, workspace: str, tracked: dict[int, int]) -> None:
    """Kill the tracked processes still running, then remove their shared memory and the workspace."""
    _scan(workspace, tracked)
    alive = {pid for pid, start in tracked.items() if (stat := _stat(pid)) is not None and stat[1] == start}
    shared = set().union(*(_shared_memory_of(pid) for pid in alive))
    for pid in alive:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    deadline = time.monotonic() + _KILL_WAIT_S
    while alive and time.monotonic() < deadline:
        alive = {pid for pid in alive if (stat := _stat(pid)) is not None and stat[1] == tracked[pid]}
        time.sleep(0.02)
    for name in shared:
        _remove(Path(name.removesuffix(" (deleted)")))
    for path in SHM_DIR.glob(f"pytrtion{owner}-*"):
        _remove(path)
    _remove(Path(workspace))


def main(argv: list[str]) -> int:
    """The guard: `process_guard.py <serving pid> <workspace>`, the serving process's pipe on stdin."""
    owner, workspace = int(argv[0]), str(Path(argv[1]).resolve())
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    tracked: dict[int, int] = {}
    while True:
        readable, _, _ = select.select([0], [], [], _SCAN_INTERVAL_S)
        if readable and not os.read(0, 4096):
            break
        _scan(workspace, tracked)
    _finish(owner, workspace, tracked)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
