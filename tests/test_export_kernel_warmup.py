"""The kernel warm-up paid at export (`exporter.runtime.kernel_warmup`), on the CPU: when an export runs it, that
it starts once the LLM's layout is known and before its weights are written, with the engine's config, layout,
dtype and limits, that the export waits for it and saves its kernel cache once the engine is installed, and that
its failure (or the export's) leaves no saved cache. The GPU part (`warm_up_kernels`) is replaced by a fake; the
GPU test is in tests/test_gpu_export_warmup.py."""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from exporter import TensorRTMMExporter, tensorrt_mm_exporter
from exporter.engine import EngineLimits, directory
from exporter.engine.kernel_cache import CHOICES_FILE, KernelCache
from exporter.llm.config import DecoderConfig
from exporter.runtime import kernel_warmup
from exporter.runtime.kernel_warmup import ExportKernelWarmUp, Warmed

IDENTITY = {"gpu": "Fake GPU 80GB", "capability": "9.0", "torch": "2.11.0", "cuda": "12.8", "triton": "3.5.0",
            "package": "0.1.0"}
LIMITS = {"max_batch_size": 2, "max_input_len": 256, "max_output_len": 4, "max_multimodal_len": 64}
REPO = Path(__file__).resolve().parents[1]


class FakeWarmUp:
    """`warm_up_kernels` without a GPU: records its arguments, makes the compile folder of a kernel cache of a fake
    identity, takes `seconds`, then returns a result over that cache (or raises `error`)."""

    def __init__(self, seconds: float = 0.0, error: Exception | None = None):
        self.seconds, self.error = seconds, error
        self.calls: list[dict] = []
        self.ended = threading.Event()

    def __call__(self, model_dir, device, config, layout, dtype, limits) -> Warmed:
        self.calls.append({"model_dir": model_dir, "device": device, "config": config, "layout": layout,
                           "dtype": dtype, "limits": limits, "thread": threading.current_thread().name})
        cache = KernelCache(model_dir, IDENTITY)
        (cache.folder / "triton").mkdir(parents=True)  # as `use_compile_dirs` makes it for the compiled kernels
        time.sleep(self.seconds)
        self.ended.set()
        if self.error is not None:
            raise self.error
        return Warmed(cache, "missing", 3, 2, "")


@pytest.fixture
def fake(monkeypatch) -> FakeWarmUp:
    warm_up = FakeWarmUp(seconds=0.3)
    monkeypatch.setattr(kernel_warmup, "warm_up_kernels", warm_up)
    return warm_up


@pytest.fixture
def starts(monkeypatch) -> list[bool]:
    """Per start of the warm-up: whether the staged LLM weights file existed then (it must not yet)."""
    seen: list[bool] = []
    original = ExportKernelWarmUp.start

    def start(self, config, layout):
        seen.append(any(self.model_dir.glob(f".export-*/{directory.LLM_WEIGHTS}")))
        original(self, config, layout)

    monkeypatch.setattr(ExportKernelWarmUp, "start", start)
    return seen


def export(model_dir: Path, nemo: Path, device: str, **options) -> None:
    TensorRTMMExporter(model_dir, load_model=False, device=device).export(
        nemo, model_type="neva", dtype="float32", load_model=False, **LIMITS, **options)


def saved_caches(model_dir: Path) -> list[Path]:
    return list((model_dir / ".cache").glob(f"kernels-*/{CHOICES_FILE}"))


def test_an_export_on_the_cpu_runs_no_warm_up(vlm, tmp_path, fake, starts):
    export(tmp_path / "engine", vlm.nemo, "cpu")
    assert fake.calls == [] and starts == [] and not (tmp_path / "engine" / ".cache").exists()


def test_a_gpu_export_warms_up_beside_the_write_and_installs_the_cache(vlm, tmp_path, fake, starts, caplog):
    engine = tmp_path / "engine"
    with caplog.at_level(logging.INFO):
        export(engine, vlm.nemo, "cuda")
    assert starts == [False]  # started before the LLM weights file was written
    (call,) = fake.calls
    assert call["thread"] == "export-kernel-warm-up" and call["device"] == "cuda" and call["model_dir"] == engine
    assert call["config"] == DecoderConfig.from_dict(json.loads((engine / "llm_engine/config.json").read_text()))
    with safe_open(engine / directory.LLM_WEIGHTS, "pt") as written:
        assert {name: (tuple(meta.shape), meta.dtype) for name, meta in call["layout"].items()} == \
            {name: (tuple(written.get_slice(name).get_shape()), torch.float32) for name in written.keys()}
    assert all(meta.device.type == "meta" for meta in call["layout"].values()) and call["dtype"] == torch.float32
    assert call["limits"] == EngineLimits(**LIMITS)
    assert fake.ended.is_set()  # the export waited for it
    (saved,) = saved_caches(engine)
    assert saved.parent == KernelCache(engine, IDENTITY).folder
    assert json.loads(saved.read_text())["identity"] == IDENTITY
    (line,) = [r.getMessage() for r in caplog.records if "kernel warm-up for this GPU" in r.getMessage()]
    assert "3 kernel choices made and 2 autotuned configs chosen" in line and "s of the export" in line
    assert "after the weights' write ended" in line or "before the weights' write ended" in line


def test_a_failed_warm_up_is_a_warning_and_the_engine_is_exported_without_a_cache(vlm, tmp_path, monkeypatch,
                                                                                    caplog):
    failing = FakeWarmUp(error=RuntimeError("no GPU"))
    monkeypatch.setattr(kernel_warmup, "warm_up_kernels", failing)
    engine = tmp_path / "engine"
    with caplog.at_level(logging.INFO):
        export(engine, vlm.nemo, "cuda")
    assert (engine / "manifest.json").is_file() and failing.calls and saved_caches(engine) == []
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("kernel warm-up at export failed (RuntimeError: no GPU)" in message for message in warnings)


def test_a_failed_export_saves_no_cache_and_removes_the_folder_it_made(vlm, tmp_path, fake, monkeypatch):
    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(directory, "mark_verified", broken)
    engine = tmp_path / "engine"
    with pytest.raises(OSError, match="disk full"):
        export(engine, vlm.nemo, "cuda")
    assert fake.ended.is_set() and not engine.exists()


def test_the_switch_and_the_cases_without_a_warm_up(vlm, tmp_path, fake):
    export(tmp_path / "engine", vlm.nemo, "cuda", warm_kernels=False)
    assert fake.calls == []
    asked = {"warm_kernels": True, "tensor_parallel_size": 1, "lora": False}
    warm_up = tensorrt_mm_exporter._export_warm_up(tmp_path, "cuda:1", "bfloat16", EngineLimits(**LIMITS), **asked)
    assert isinstance(warm_up, ExportKernelWarmUp) and warm_up.dtype == torch.bfloat16
    warm_up.wait()  # never started (a tensor-parallel write, or a failure before the LLM): nothing to wait for
    for device, change in (("cpu", {}), ("cuda", {"warm_kernels": False}), ("cuda", {"tensor_parallel_size": 2}),
                           ("cuda", {"lora": True})):
        assert tensorrt_mm_exporter._export_warm_up(tmp_path, device, "bfloat16", EngineLimits(**LIMITS),
                                                    **{**asked, **change}) is None


def test_deploy_triton_passes_the_switch():
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import deploy_triton
    finally:
        sys.path.pop(0)
    arguments = ["-tmn", "m", "-mt", "neva", "-vc", "x.nemo"]
    assert deploy_triton._export_arguments(deploy_triton.parse_settings(arguments))["warm_kernels"] is True
    settings = deploy_triton.parse_settings([*arguments, "--no_export_kernel_warmup"])
    assert deploy_triton._export_arguments(settings)["warm_kernels"] is False
