"""The compile-ahead pass of a scheduler's start (`cuda_graphs.compile_ahead`): which steps it runs, under which
flag, and that a CPU scheduler skips it. The Triton side (`parallel_compile.compiles_only`) is checked with real
compiles in tests/test_parallel_compile.py; here the flag is a recording stand-in (no GPU)."""

from __future__ import annotations

import json
import logging
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch

from exporter import tensorrt_mm_exporter
from exporter.engine.kernel_cache import CHOICES_FILE, FORMAT, KernelCache, Restored
from exporter.runtime import cuda_graphs, scheduler
from exporter.runtime.cuda_graphs import ForwardStep, compile_ahead
from exporter.runtime.scheduler import Scheduler
from exporter.tensorrt_mm_exporter import TensorRTMMExporter
from support.decoders import scheduler_decoder

STATIC = "the static chunk"  # what the patched `_static_chunk` hands over (a CPU step has no static buffers)


@pytest.fixture(scope="module")
def model():
    return scheduler_decoder()


@pytest.fixture
def steps(monkeypatch) -> list[tuple]:
    """`(rows, chunk: "static" / "eager" / None, full, lora, inside the flag)` of each step computed."""
    inside, computed = [False], []

    @contextmanager
    def flagged():
        inside[0] = True
        try:
            yield
        finally:
            inside[0] = False

    compute = ForwardStep._compute

    def recorded(self, rows, chunk, full, span, lora=False):
        kind = None if chunk is None else "static" if chunk is STATIC else "eager"
        computed.append((rows, kind, full, lora, inside[0]))
        if chunk is STATIC:
            return torch.zeros(rows + 1, self.model.config.vocab_size)
        return compute(self, rows, chunk, full, span, lora)

    monkeypatch.setattr(cuda_graphs, "compiles_only", flagged)
    monkeypatch.setattr(ForwardStep, "_compute", recorded)
    monkeypatch.setattr(ForwardStep, "_static_chunk", lambda self, padded: STATIC)
    return computed


def test_the_pass_runs_the_activation_step_then_each_first_graph_under_the_flag(model, steps):
    compile_ahead(model, rows=4, width=3, block_size=32, chunk_tokens=64, max_beam_width=1, fp8=False, graphs=True)
    step = ForwardStep(model, model.new_paged_kv_cache(2, 32), torch.zeros(4, 3, dtype=torch.int32),
                       cuda_graphs.TokenChooser(4, model.config.vocab_size, model.device, 1), max_chunk=64)
    first = [(rows, "static" if padded else None, full, lora, True) for rows, padded, full, lora in step.first_keys()]
    assert steps == [(4, "eager", True, False, True), *first]


def test_without_graphs_the_pass_runs_the_activation_step_alone(model, steps):
    compile_ahead(model, rows=2, width=3, block_size=32, chunk_tokens=32, max_beam_width=1, fp8=False, graphs=False)
    assert steps == [(2, "eager", True, False, True)]


def test_tensor_parallelism_skips_the_pass(model, steps, monkeypatch):
    monkeypatch.setattr(model, "tp", SimpleNamespace(leader=True))
    compile_ahead(model, rows=2, width=3, block_size=32, chunk_tokens=32, max_beam_width=1, fp8=False, graphs=True)
    assert steps == []


def test_a_cpu_scheduler_does_not_run_the_pass(model, monkeypatch):
    def refused(*args, **kwargs):
        raise AssertionError("compile_ahead ran on the CPU")

    monkeypatch.setattr(scheduler, "compile_ahead", refused)
    Scheduler(model, max_slots=2, max_seq_len=64, eos_id=None)


class RecordingPipeline:
    """`Pipeline` as `_warm_up` builds it, noting whether it was asked to compile ahead in `built`."""

    built: list[bool] = []

    def __init__(self, engine, *, compile_kernels_ahead: bool, **kwargs):
        self.built.append(compile_kernels_ahead)
        self.build_s = 0.0
        self.scheduler = SimpleNamespace(capture_stats={}, kv_pool_s=0.0, on_captured=None)


@pytest.mark.parametrize("restored, ahead", [(None, True), (Restored("missing"), True),
                                             (Restored("other identity"), True), (Restored("hit", 5, 14), False)])
def test_a_start_with_its_kernels_cached_compiles_nothing_ahead(monkeypatch, restored, ahead):
    """On a kernel-cache hit every kernel loads from Triton's disk cache: the start skips the pass (on the H100 it
    cost the restart ~1.5 s of eager steps and gained nothing)."""
    monkeypatch.setattr(RecordingPipeline, "built", [])
    monkeypatch.setattr(tensorrt_mm_exporter, "Pipeline", RecordingPipeline)
    exporter = TensorRTMMExporter.__new__(TensorRTMMExporter)
    exporter.engine, exporter.kv_cache, exporter.max_num_tokens = object(), None, None
    kernels = None if restored is None else SimpleNamespace(save=lambda: True)
    exporter._warm_up(kernels, restored)
    assert RecordingPipeline.built == [ahead]


def write_choices(cache: KernelCache, content: str) -> None:
    """`cache`'s choices.json: "missing" (none), "corrupt", "other identity" or "hit" (no choices in it)."""
    identity = {**cache.identity, "gpu": "another GPU"} if content == "other identity" else cache.identity
    text = "{not json" if content == "corrupt" else json.dumps(
        {"format": FORMAT, "identity": identity, "choices": {}, "autotune": {}, "tuned_kinds": []})
    if content != "missing":
        cache.folder.mkdir(parents=True)
        (cache.folder / CHOICES_FILE).write_text(text)


@pytest.mark.parametrize("content, size", [("missing", 1), ("corrupt", 1), ("other identity", 1), ("hit", 1),
                                           ("missing", 2)])
def test_one_restore_before_the_load_decides_both_the_workers_start_and_the_pass(monkeypatch, tmp_path, caplog,
                                                                                   content, size):
    """The kernel cache is restored once, before the engine loads: where it missed (no file, an unreadable one, one
    of another GPU or version) the compile workers start before the load (their start, worker interpreters
    importing torch and Triton, overlaps it) and the pass runs; a hit does neither. Several ranks start no
    workers (the scheduler skips the pass under tensor parallelism)."""
    calls = []
    cache = KernelCache(tmp_path, {"gpu": "Fake GPU", "capability": "9.0", "triton": "3.9.0"})
    write_choices(cache, content)
    restore = cache.restore
    monkeypatch.setattr(cache, "restore", lambda: calls.append("restore") or restore())
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))  # the user's: left as it is
    monkeypatch.setattr(RecordingPipeline, "built", [])
    monkeypatch.setattr(tensorrt_mm_exporter, "Pipeline", RecordingPipeline)
    monkeypatch.setattr(tensorrt_mm_exporter, "read_manifest", lambda model_dir: {
        "modality": "vision", "tensor_parallel_size": size, "dtype": "float16"})
    monkeypatch.setattr(tensorrt_mm_exporter.KernelCache, "for_device", lambda model_dir, device: cache)
    monkeypatch.setattr(tensorrt_mm_exporter, "Ranks", lambda *args: SimpleNamespace(stop=lambda: None, tp=None))
    monkeypatch.setattr(tensorrt_mm_exporter, "load_engine", lambda *args, **kwargs: calls.append("load") or
                        SimpleNamespace(decoder=SimpleNamespace(tp=None), arriving=None))
    monkeypatch.setattr(tensorrt_mm_exporter, "start_workers", lambda: calls.append("start workers"))
    monkeypatch.setattr(tensorrt_mm_exporter, "stop_workers", lambda: calls.append("stop workers"))
    exporter = TensorRTMMExporter.__new__(TensorRTMMExporter)
    exporter.model_dir, exporter.modality, exporter.device = tmp_path, "vision", "cuda:0"
    exporter.kv_cache, exporter.pipeline, exporter.ranks = SimpleNamespace(dtype="auto"), None, None
    exporter.media_policy = exporter.verify_engine = exporter.lora = exporter.max_num_tokens = None
    with caplog.at_level(logging.INFO, logger="exporter.startup"):
        exporter._load()
    first = content != "hit"
    assert calls == ["restore", *(["start workers"] if first and size == 1 else []), "load", "stop workers"]
    assert RecordingPipeline.built == [first]
    (line,) = [record.getMessage() for record in caplog.records if "phase warm-up" in record.getMessage()]
    assert f"kernel cache {content}" in line and "(restore before the load: " in line, line
