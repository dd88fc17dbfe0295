"""bench/lora_bench.py runs end to end on the CPU at a tiny shape (its timings mean nothing there)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_lora_bench_runs_and_prints_the_table(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path)}
    done = subprocess.run([sys.executable, str(REPO / "bench/lora_bench.py"), "--tiny"], env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "lora_bench.json").read_text())
    for key in ("base_bs32", "base_bs1", "no_adapter_rows_bs32", "lora_bs32", "lora_bs1"):
        assert result[key] > 0, key
    assert "4 adapters x 8 rows " in done.stdout and "target: 4 adapters over 32 rows" in done.stdout
    alone = result["lora_alone_ms"]["default"]
    assert set(alone) == {"all", "no_adapter_rows", "attn_qkv", "attn_dense", "mlp_h_to_4h", "mlp_4h_to_h"}
    assert all(ms > 0 for ms in alone.values()) and "LoRA updates of one 32-row step alone" in done.stdout
