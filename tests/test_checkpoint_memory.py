"""Loading a checkpoint of W bytes never holds two copies of the weights: peak RSS < 1.3 W + 300 MB; streaming its
LLM weights into an engine file (as an export does) holds its read-ahead and write budgets, not the weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from support.decoders import BIG_CONFIG
from tools.nemo_writer import write_nemo

MB = 1 << 20

# Measured in a fresh process: peak RSS after loading minus peak RSS after the imports. The peak is the
# kernel's VmHWM of this process image (ru_maxrss would not do: Linux carries the parent's peak over exec).
CHILD = """
import json, sys
import torch
from exporter.checkpoint import NemoCheckpoint

def peak_rss():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))

torch.set_num_threads(1)
baseline = peak_rss()
weights = NemoCheckpoint(sys.argv[1]).state_dict()
peak = peak_rss()
size = sum(t.numel() * t.element_size() for t in weights.values())
print(json.dumps({"growth": peak - baseline, "weights": size}))
"""

STREAM_CHILD = """
import json, sys
import torch
from exporter.checkpoint import NemoCheckpoint
from exporter.engine import writing

def peak_rss():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))

torch.set_num_threads(1)
writing.MAX_PENDING_BYTES = writing.READ_AHEAD_BYTES = 32 << 20
baseline = peak_rss()
stream = NemoCheckpoint(sys.argv[1]).tensor_stream()
writing.stream_tensors(sys.argv[2], stream.metas, stream.read(), torch.bfloat16)
peak = peak_rss()
size = sum(t.numel() * t.element_size() for t in stream.metas.values())
print(json.dumps({"growth": peak - baseline, "weights": size}))
"""

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/status").exists(), reason="needs Linux /proc for peak RSS"
)


@pytest.fixture(scope="module")
def big_weights(tiny_gpt_weights):
    return tiny_gpt_weights(BIG_CONFIG, vocab=8192)


@pytest.mark.parametrize(
    "options", [{}, {"tp_size": 2}, {"layout": "torch_dist"}], ids=["legacy", "tp2", "torch_dist"]
)
def test_peak_memory_while_loading(tmp_path, big_weights, options):
    path = write_nemo(tmp_path / "big.nemo", BIG_CONFIG, big_weights, **options)
    result = subprocess.run(
        [sys.executable, "-c", CHILD, str(path)], capture_output=True, text=True, check=True
    )
    path.unlink()
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    weights = measured["weights"]
    assert weights >= 430 * MB
    limit = 1.3 * weights + 300 * MB
    assert measured["growth"] < limit, (
        f"RSS grew {measured['growth'] / MB:.0f} MB loading {weights / MB:.0f} MB"
    )


def test_streaming_into_an_engine_file_holds_its_budgets_not_the_weights(tmp_path, big_weights):
    path = write_nemo(tmp_path / "big.nemo", BIG_CONFIG, big_weights)
    # These tensors (4-32 MB) sit below glibc's dynamic mmap threshold, so its per-thread arenas would keep the freed
    # ones (a 7B model's are above it, mapped and unmapped): a fixed threshold measures what the stream holds.
    result = subprocess.run([sys.executable, "-c", STREAM_CHILD, str(path), str(tmp_path / "w.safetensors")],
                            capture_output=True, text=True, check=True,
                            env={**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 << 10)})
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    assert measured["weights"] >= 430 * MB
    assert measured["growth"] < 0.35 * measured["weights"], (
        f"RSS grew {measured['growth'] / MB:.0f} MB streaming {measured['weights'] / MB:.0f} MB"
    )
