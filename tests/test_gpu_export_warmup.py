"""On CUDA (skipped elsewhere): an export on the GPU leaves the engine's kernel cache filled (a hit for this GPU),
frees what its warm-up held and restores Triton's compile folder variable; a start in a fresh process then takes
every kernel from the compile cache, times none, and says the cache was a hit."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from exporter import TensorRTMMExporter
from exporter.engine.kernel_cache import KernelCache
from support.demo import DEMO_NEMO

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
REPO = Path(__file__).resolve().parents[1]
LIMITS = {"max_batch_size": 4, "max_input_len": 512, "max_output_len": 8, "max_multimodal_len": 4 * 64}
# a start in a fresh process: Triton's compiles (all, and those from the compile cache) and the timings it ran
START = """
import json, logging, sys
from exporter import TensorRTMMExporter
from exporter.engine import kernel_cache
from exporter.llm import gemv
logging.basicConfig(level=logging.INFO)
import triton.testing
timed, measure, bench = [], gemv.measure_ms, triton.testing.do_bench
gemv.measure_ms = lambda *args, **kwargs: timed.append(1) or measure(*args, **kwargs)  # the products' candidates
triton.testing.do_bench = lambda *args, **kwargs: timed.append(1) or bench(*args, **kwargs)  # autotuned configs
exporter = TensorRTMMExporter(sys.argv[1], device="cuda")
print(json.dumps({"kernels": kernel_cache._COMPILES.kernels, "cached": kernel_cache._COMPILES.cached,
                  "timed": len(timed)}))
"""


def cuda_tensors() -> list[torch.Tensor]:
    gc.collect()
    return [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.is_cuda]


def test_a_gpu_export_fills_the_kernel_cache_and_a_start_compiles_and_times_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    engine = tmp_path / "engine"
    torch.empty(1, device="cuda")
    before, tensors_before = torch.cuda.memory_allocated(), {id(t) for t in cuda_tensors()}
    TensorRTMMExporter(engine, load_model=False, device="cuda").export(DEMO_NEMO, model_type="neva",
                                                                        dtype="bfloat16", load_model=False, **LIMITS)
    kept = [(tuple(t.shape), t.dtype) for t in cuda_tensors() if id(t) not in tensors_before]
    assert not kept, kept[:20]  # the decoder, the KV pool, the graphs' tensors: none kept
    getattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: None)()  # cuBLAS's per-stream workspaces stay
    assert torch.cuda.memory_allocated() - before < 64 << 20  # the timing buffer (128 MB at least) freed too
    assert "TRITON_CACHE_DIR" not in os.environ
    cache = KernelCache.for_device(engine, "cuda")
    assert any((cache.folder / "triton").iterdir())  # the compiled kernels, in the installed engine's cache

    env = {key: value for key, value in os.environ.items() if key != "TRITON_CACHE_DIR"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-c", START, str(engine)], env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    started = json.loads(done.stdout.strip().splitlines()[-1])
    assert started["kernels"] == started["cached"] and started["timed"] == 0, started
    assert "kernel cache hit" in done.stderr
    assert cache.restore().reason == "hit"
