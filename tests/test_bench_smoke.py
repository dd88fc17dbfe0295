"""The GPU benchmarks run end to end on the CPU at their tiny shapes (timings mean nothing there), so a change to
the code they drive cannot leave them broken until the next GPU run. lora_bench, coldstart_bench, serve_bench
and tp_bench have their own tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(("script", "arguments", "json_name", "table_line"), [
    ("llava_bench.py", [], "llava_bench.json", "decode"),
    ("mixed_decode.py", [], "mixed_decode.json", "ms/step"),
    ("moe_bench.py", [], "moe_bench.json", "roofline"),
    ("quant_bench.py", ["--methods", "int8_wo", "int4_awq"], "quant_bench.json", "int4_awq"),
    ("quant_kernel_probe.py", [], "quant_kernel_probe.json", "quantized kernel probe"),  # Triton's interpreter
    ("paged_bench.py", [], "paged_bench.json", "concurrent requests"),
    ("paged_bench.py", ["--parts", "ttft"], "paged_bench.json", "second question's prefill step alone"),
    ("paged_bench.py", ["--parts", "burst"], "paged_bench.json", "questions about one new image sent together"),
    ("fused_bench.py", [], "fused_bench.json", "a decode step"),  # Triton's interpreter
    ("skinny_probe.py", [], "skinny_probe.json", "rows: cuBLAS"),  # Triton's interpreter
    ("chunk_splits_probe.py", [], "chunk_splits_probe.json", "| engine 1 ("),  # Triton's interpreter
    ("stream_overlap_probe.py", [], "stream_overlap_probe.json", "chunk_shape"),
    ("launch_overlap_probe.py", [], "launch_overlap_probe.json", "plain chain against torch"),  # interpreter
    ("decode_attention_probe.py", [], "decode_attention_probe.json", "GROUP_MAJOR=False"),  # interpreter
    ("int8_convert_probe.py", [], "int8_convert_probe.json", "SASS a weight in the K loop"),  # sm_90 compile
    ("late_reads.py", [], "late_reads.json", "read after the stream began"),  # the demo restarted, to READY
])
def test_bench_runs_at_its_tiny_shape(tmp_path, script, arguments, json_name, table_line):
    done = subprocess.run([sys.executable, str(REPO / "bench" / script), "--tiny", *arguments],
                          env={**os.environ, "OUT": str(tmp_path)}, capture_output=True, text=True, timeout=900,
                          check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert json.loads((tmp_path / json_name).read_text())
    assert table_line in done.stdout


def test_pacer_replay_over_a_measured_h200_run():
    """The pacer replayed over the fourteenth round's measured mixed steps (H200): with the graphs' padding counted,
    the steps stay within each limit as the best one step at a time does; without it (the pacing then measured at
    1.7: the rows' p99 2.00x), they overshoot it."""
    done = subprocess.run([sys.executable, str(REPO / "bench" / "pacer_replay.py"),
                           str(REPO / "bench" / "results" / "paged_bench_h200_fourteenth_mixed.json"),
                           "--limits", "1.7", "1.9"], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    p99 = [float(line.split("step p99 x")[1].split()[0]) for line in done.stdout.splitlines() if "step p99" in line]
    counted, not_counted, serial = p99[0::3], p99[1::3], p99[2::3]
    assert len(counted) == 2 and all(ratio <= limit + 0.01 for ratio, limit in zip(counted, (1.7, 1.9)))
    assert all(ratio > limit + 0.2 for ratio, limit in zip(not_counted, (1.7, 1.9)))
    assert all(abs(a - b) <= 0.02 for a, b in zip(counted, serial))
