"""bench/serve_bench.py runs end to end on the CPU with the demo model: a short run of every protocol, closed and
open loop, against the in-process scheduler."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_serve_bench_runs_every_protocol_and_prints_the_table(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path)}
    command = [sys.executable, str(REPO / "bench/serve_bench.py"), "--demo", "--concurrency", "2", "--requests", "4",
               "--rate", "8", "--processes", "2"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "serve_bench.json").read_text())
    phases = [(phase["protocol"], phase["mode"]) for phase in result["phases"]]
    assert phases == [(protocol, mode) for protocol in ("triton_http", "grpc_stream", "openai")
                      for mode in ("c=2", "rate=8/s")]
    assert all(phase["errors"] == 0 and phase["requests"] == 4 for phase in result["phases"]), result["phases"]
    assert all(phase["output_tok_s"] > 0 for phase in result["phases"])
    assert all(phase["ttft_ms"][0] > 0 for phase in result["phases"] if phase["protocol"] != "triton_http")
    assert float(result["scheduler_tok_s"]["2"]) > 0
    table = done.stdout.splitlines()
    assert any(line.startswith("triton_http") and "c=2" in line for line in table)


def test_random_engine_of_a_given_shape_is_exported(tmp_path, monkeypatch):
    """The --llava and --small_llm engines: a random `.nemo` of a shape, exported in the requested dtype."""
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import serve_bench

    shape = {"vision": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                            image_size=28, patch_size=14),
             "llm": dict(vocab_size=1024, hidden_size=64, ffn_hidden_size=128, num_layers=2, num_attention_heads=2)}
    engine = serve_bench.random_engine(tmp_path / "engine", serve_bench.SMALL_LLM, serve_bench.make_words(0, 600),
                                       shape, "float32")
    manifest = json.loads((engine / "manifest.json").read_text())
    assert manifest["dtype"] == "float32", manifest
