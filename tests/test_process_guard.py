"""`deploy.process_guard`: what runs from a Triton workspace dies with the serving process, with its shared
memory and the workspace; leftovers of dead serving processes are removed at start. (The whole path, SIGKILL of
deploy_triton.py then a restart on the same ports, is in tests/test_deploy_stub.py.)"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

from deploy.process_guard import SHM_DIR, ProcessGuard, clean_stale_files


def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_leftovers_of_dead_serving_processes_are_removed(tmp_path):
    shm, workspaces = tmp_path / "shm", tmp_path / "pytriton"
    shm.mkdir()
    workspaces.mkdir()
    dead, alive = _dead_pid(), os.getpid()
    for name in (f"pytrtion{dead}-ab12", f"pytrtion{alive}-cd34", "psm_1234", "other"):
        (shm / name).write_bytes(b"x")
    for name in (f"nemo-mm-deploy-{dead}-aa", f"nemo-mm-deploy-{alive}-bb", f"workspace_{dead}"):
        (workspaces / name / "model-store").mkdir(parents=True)
    removed = clean_stale_files(workspaces, shm)
    assert sorted(path.name for path in removed) == [f"nemo-mm-deploy-{dead}-aa", f"pytrtion{dead}-ab12"]
    assert sorted(path.name for path in shm.iterdir()) == sorted(["psm_1234", "other", f"pytrtion{alive}-cd34"])
    assert sorted(path.name for path in workspaces.iterdir()) == sorted([f"nemo-mm-deploy-{alive}-bb",
                                                                         f"workspace_{dead}"])


def test_guard_kills_what_runs_from_the_workspace_and_removes_its_files(tmp_path):
    """A shell started from the workspace and its child, which maps a shared-memory file: both are killed, the file
    and the workspace removed, when the guard's pipe closes (as it does when the serving process dies)."""
    workspace = tmp_path / "nemo-mm-deploy-test"
    (workspace / "bin").mkdir(parents=True)
    shell = shutil.copy("/bin/sh", workspace / "bin" / "sh")
    segment = SHM_DIR / f"nemo-mm-deploy-guard-test-{os.getpid()}"
    mapper = (f"import mmap, time; f = open({str(segment)!r}, 'w+b'); f.truncate(4096); "
              "m = mmap.mmap(f.fileno(), 4096); print('mapped', flush=True); time.sleep(300)")
    family = subprocess.Popen([shell, "-c", f'"{sys.executable}" -c "{mapper}" & wait'], stdout=subprocess.PIPE,
                              text=True, start_new_session=True)
    try:
        assert family.stdout.readline().strip() == "mapped"
        guard = ProcessGuard(workspace)
        time.sleep(1.5)  # the guard scans every 0.5 s
        assert guard.process.poll() is None
        guard.stop()
        assert guard.process.returncode == 0
        assert family.wait(timeout=10) == -9  # SIGKILL
        assert not segment.exists() and not workspace.exists()
    finally:
        if family.poll() is None:
            os.killpg(family.pid, 9)
        segment.unlink(missing_ok=True)
