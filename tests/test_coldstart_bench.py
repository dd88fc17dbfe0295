"""bench/coldstart_bench.py runs end to end on the CPU at its tiny shape: a real `.nemo`, the export, both weight
loads, a first start, a first start without a kernel cache and a restart of deploy_triton.py with requests, and the
table with the servers' phases."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_coldstart_bench_runs_and_prints_the_table(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path)}
    command = [sys.executable, str(REPO / "bench/coldstart_bench.py"), "--tiny", "--cache_drop", "files",
               "--workdir", str(tmp_path), "--late_reads"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "coldstart_bench.json").read_text())
    assert result["export_s"] > 0 and result["load_old_s"] > 0 and result["load_new_s"] > 0
    by_threads = result["disk_read_cold_GBps_by_threads"]  # every way and thread count was timed
    assert {f"{kind} {threads}" for kind in ("buffered", "direct") for threads in (1, 4, 8, 16, 32)} == set(by_threads)
    assert all(isinstance(speed, str) or speed > 0 for speed in by_threads.values())
    assert result["export_overlap_s"] >= 0  # the phases' spans were read (the tiny shape's may not overlap)
    for start in ("first_start", "first_start_no_kernel_cache", "restart"):  # after the export, without a cache
        measured = result[start]
        assert measured["ready_s"] > 0 and measured["steady_request_s"] > 0, measured
        assert "LLM weights: read + transfer" in measured["phases"] and "Triton start" in measured["phases"]
        assert "READY (since the process started)" in measured["phases"]
        split = measured["first_request_split"]  # the server's metrics split the first request's latency
        assert split["to_first_token_s"] > 0 and split["later_tokens_s"] > 0, split
        assert abs(sum(split[k] for k in ("to_first_token_s", "later_tokens_s", "outside_scheduler_s"))
                   - measured["first_request_s"]) < 1e-6
        assert 0 < measured["steady_request_split"]["to_first_token_s"] < measured["steady_request_s"]
    assert "kernel cache" not in json.dumps(result["first_start"]["phases"])  # the CPU keeps no kernel cache
    late = result["restart"]["late_reads"]  # the restart ran through bench/late_reads.py
    assert late["stream_began_s"] > 0 and "late_reads" not in result["first_start"]
    assert not {"torch.utils._device", "PIL.ImageFile"} & set(late["late_modules"])  # read ahead
    assert "read ahead of the LLM weights" in result["restart"]["phases"]
    table = done.stdout
    assert "first start no kernel cache: process start to READY s" in table
    assert "restart: process start to READY s" in table and "export: LLM write beside the perception s" in table
    assert "first / steady request: to first token " in table and "first start phases:" in table
    assert "read after the LLM weights' stream began" in table
    assert not list(tmp_path.glob("coldstart-*"))  # the work folder is removed
