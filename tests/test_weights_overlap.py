"""The LLM weights filled in while the warm-up runs (`PendingWeights`, `load_engine(weights_in_background=True)`).

On a GPU the decoder is built over zeroed weight tensors and the warm-up (compiling, timing kernels, capturing
graphs) runs while a thread fills them from the file. The same code runs here on the CPU (the devices that overlap
widened to it), with the reader held back by an event until the warm-up has run: the warm-up sees zeros, the
answers after the wait are token for token those of a plain load (float32 and int4), a copy a kernel made of a
weight during the warm-up is made again, and a file that turns bad (a hash mismatch, a short file) fails the load
with the one-line EngineError a plain load gives.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import re
import shutil
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from exporter import TensorRTMMExporter
from exporter.engine import EngineError, directory, loading
from exporter.engine.directory import LLM_WEIGHTS, background_fill
from exporter.engine.loading import PendingWeights
from exporter.engine.writing import write_tensors
from exporter.llm.generate import SamplingParams
from exporter.llm.quant import kernels
from exporter.llm.quant.linear import QuantLinear
from exporter.runtime import Request
from exporter.runtime.scheduler import Scheduler
from support.media import random_image
from support.tokenizer_files import tokenizer_file
from support.vlm import build_vlm

LIMITS = {"max_batch_size": 2, "max_input_len": 256, "max_output_len": 8, "max_multimodal_len": 128}
PROMPT = "describe the image"


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """A tiny Neva exported twice, float32 and int4 weight-only in bfloat16: folder and a plain load's answer."""
    folder = tmp_path_factory.mktemp("overlap")
    vlm = build_vlm(folder / "legacy", tokenizer_file(folder))
    built = {}
    for name, options in {"float32": {"dtype": "float32"},
                          "int4": {"dtype": "bfloat16", "quantization": "int4_wo"}}.items():
        exporter = TensorRTMMExporter(folder / name, device="cpu")
        exporter.export(vlm.nemo, model_type="neva", **LIMITS, **options)
        assert exporter.engine.arriving is None  # the CPU maps the file: nothing arrives later
        built[name] = (folder / name, answer(exporter))
        exporter.close()
    return built


@pytest.fixture
def gate(monkeypatch):
    """The background fill on the CPU too, its reader held until `gate.set()`."""
    opened = threading.Event()
    read = loading.stream_chunks

    def held(*args, **kwargs):
        assert opened.wait(60), "the test never let the reader go"
        return read(*args, **kwargs)

    monkeypatch.setattr(directory, "BACKGROUND_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(loading, "stream_chunks", held)
    return opened


def answer(exporter: TensorRTMMExporter) -> list[list[int]]:
    params = SamplingParams(max_output_len=8, top_k=1)
    (completion,) = exporter.generate([Request(PROMPT, random_image(3), params)])
    assert not isinstance(completion, Exception), completion
    return completion.token_ids


def warm_up_then(monkeypatch, then) -> list[dict]:
    """Run `then(exporter)` at the end of the exporter's warm-up, and record what the warm-up saw."""
    seen: list[dict] = []
    warm_up = TensorRTMMExporter._warm_up

    def observed(self, *args):
        warm_up(self, *args)
        decoder = self.engine.decoder
        seen.append({"arrived": self.engine.arriving.pending.done(),
                     "all_zero": all(not t.any() for t in decoder.state_dict().values())})
        then(self)

    monkeypatch.setattr(TensorRTMMExporter, "_warm_up", observed)
    return seen


def test_the_warm_up_runs_before_the_weights_arrive_and_the_answers_are_a_plain_loads(engines, gate, monkeypatch,
                                                                                      caplog):
    folder, expected = engines["float32"]
    seen = warm_up_then(monkeypatch, lambda exporter: gate.set())
    with caplog.at_level(logging.INFO, logger="exporter.startup"):
        overlapped = TensorRTMMExporter(folder, device="cpu", verify_engine=True)
    assert seen == [{"arrived": False, "all_zero": True}]  # the warm-up ran on the zeroed tensors, reader held
    assert overlapped.engine.arriving is None  # waited for before the load returned
    assert answer(overlapped) == expected
    overlapped.close()
    logged = [record.getMessage() for record in caplog.records]
    order = [next(i for i, line in enumerate(logged) if line.startswith(f"phase {name}:"))
             for name in ("warm-up: compile, choose kernels, capture graphs", "LLM weights: read + transfer",
                          "finish the hash check", "wait for the LLM weights")]
    assert order == sorted(order), logged
    assert "beside the warm-up" in logged[order[1]]
    warm_up_line = logged[order[0]]
    assert "pipeline built in " in warm_up_line and "(KV pool " in warm_up_line and "; other " in warm_up_line


def test_a_weight_copy_made_during_the_warm_up_is_made_again(engines, gate, monkeypatch):
    """int4: the packed kernel's copy of a weight (made at its first run, on CUDA inside the warm-up) is made
    here during the warm-up from the zeroed weight; after the wait it is the copy of the file's weight, in
    place, and the answers are a plain load's."""
    folder, expected = engines["int4"]
    made = {}

    def copy_during_warm_up(exporter):
        layer = exporter.engine.decoder.decoder.layers[0].mlp.linear_fc1
        assert isinstance(layer, QuantLinear)
        made["layer"] = layer
        made["copy"] = kernels._copy_of("packed", layer.weight, functools.partial(kernels.pack_int4_words,
                                                                                 layer.layout))
        made["address"] = made["copy"].data_ptr()
        assert not made["copy"].any()
        gate.set()

    warm_up_then(monkeypatch, copy_during_warm_up)
    overlapped = TensorRTMMExporter(folder, device="cpu")
    layer = made["layer"]
    assert layer.weight.any()
    assert made["copy"].data_ptr() == made["address"]
    assert torch.equal(made["copy"], kernels.pack_int4_words(layer.layout, layer.weight))
    assert answer(overlapped) == expected
    overlapped.close()


def test_a_corrupt_weights_file_fails_the_load_as_a_plain_load_does(engines, gate, monkeypatch, tmp_path):
    corrupt = tmp_path / "engine"
    shutil.copytree(engines["float32"][0], corrupt)
    weights = corrupt / LLM_WEIGHTS
    data = bytearray(weights.read_bytes())
    data[-100] ^= 0xFF  # same size, one byte of a tensor changed
    weights.write_bytes(bytes(data))
    gate.set()
    with pytest.raises(EngineError, match=f"engine file {LLM_WEIGHTS} is corrupt: sha256 mismatch") as error:
        TensorRTMMExporter(corrupt, device="cpu", verify_engine=True)
    assert "\n" not in str(error.value) and str(tmp_path) not in str(error.value)


def test_a_weights_file_cut_short_while_it_is_read_fails_the_load(engines, gate, monkeypatch, tmp_path):
    short = tmp_path / "engine"
    shutil.copytree(engines["float32"][0], short)
    weights = short / LLM_WEIGHTS

    def cut_then_read(exporter):
        with open(weights, "r+b") as stream:
            stream.truncate(weights.stat().st_size - 1000)
        gate.set()

    warm_up_then(monkeypatch, cut_then_read)
    with pytest.raises(EngineError, match=f"engine file {LLM_WEIGHTS} is not a readable safetensors file "
                                          r"\(the file ended before its data did\)") as error:
        TensorRTMMExporter(short, device="cpu", verify_engine=False)
    assert "\n" not in str(error.value) and str(tmp_path) not in str(error.value)
    for thread in threading.enumerate():  # the fill's thread ends (it may take a moment to exit its pool)
        if thread.name.startswith("engine-fill"):
            thread.join(10)
            assert not thread.is_alive()


def random_weights() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    return {"a.weight": torch.randn(48, 40, generator=generator), "a.bias": torch.randn(3, generator=generator),
            "b.weight": torch.randn(7, 5, generator=generator).to(torch.bfloat16), "scalar": torch.tensor(1.5),
            "index": torch.arange(5, dtype=torch.int32)}


def test_pending_weights_are_zero_until_filled_then_the_files_and_copies_are_made_again(tmp_path, monkeypatch):
    """Aligned for a GPU (16 bytes), some tensors of this file are copies, not views: they get the file's values
    at `wait()` too. The digest is fed the whole file."""
    path = tmp_path / "w.safetensors"
    write_tensors(path, random_weights())
    monkeypatch.setitem(loading.VIEW_ALIGNMENT, "cpu", 16)
    pending = PendingWeights(path, "cpu")
    base = pending._data.untyped_storage().data_ptr()
    copies = [name for name, t in pending.tensors.items() if t.untyped_storage().data_ptr() != base]
    assert copies  # the test covers the copy path
    assert not any(t.any() for t in pending.tensors.values())
    digest = hashlib.sha256()
    pending.start(functools.partial(pending.fill, digest))
    pending.wait()
    expected = load_file(path)
    assert {name: torch.equal(t, expected[name]) for name, t in pending.tensors.items()} == {n: True for n in expected}
    assert digest.hexdigest() == hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_cancelled_fill_stops_and_wait_says_so(tmp_path, monkeypatch):
    path = tmp_path / "w.safetensors"
    write_tensors(path, random_weights())
    monkeypatch.setattr(loading, "CHUNK_BYTES", 256)
    monkeypatch.setattr(loading, "PINNED_BUFFERS", 1)
    pending = PendingWeights(path, "cpu")
    pending._stop.set()  # as cancel() sets it, before any chunk is put
    pending.start()
    with pytest.raises(loading.FillStopped):
        pending.wait()
    pending.cancel()  # after the end: nothing raised


@pytest.mark.parametrize("device,tp,served,expected", [
    ("cuda", 1, "bfloat16", True), ("cuda:1", 1, "bfloat16", True), ("cpu", 1, "bfloat16", False),
    ("cuda", 2, "bfloat16", False), ("cuda", 1, "float16", False)])
def test_which_engines_fill_their_weights_in_the_background(device, tp, served, expected):
    manifest = {"dtype": "bfloat16", "tensor_parallel_size": tp}
    assert background_fill(manifest, device, directory.torch_dtype(served)) is expected


def test_the_manifest_records_what_background_fill_reads(engines):
    manifest = json.loads((engines["int4"][0] / "manifest.json").read_text())
    assert manifest["dtype"] == "bfloat16" and manifest["tensor_parallel_size"] == 1


def test_the_warm_up_line_splits_the_captures_into_their_runs_and_the_captures():
    from exporter.tensorrt_mm_exporter import _describe_capture

    stats = {"before": 16, "before_s": 7.16, "before_runs_s": 6.02, "before_capture_s": 1.1, "left": 46}
    assert _describe_capture(stats) == ("16 step graphs captured in 7.16 s (warm-up runs 6.02 s, captures 1.10 s), "
                                        "46 left for the background")
    assert _describe_capture({"before": 0, "left": 0}) == ""


WARM_UP_PARTS = re.compile(r"(?:restored in|pipeline built in|graphs captured in|saved in|other) ([0-9.]+) s")


def test_the_warm_up_line_times_the_pipeline_directly_and_its_parts_sum_to_the_total(engines, monkeypatch, caplog):
    """Work in the pipeline's construction outside the scheduler's build (its thread's start, made 0.3 s slower)
    counts as `other`, not as `pipeline built`; the parts add up to the phase's seconds."""
    folder, _ = engines["float32"]
    start = Scheduler.start
    monkeypatch.setattr(Scheduler, "start", lambda self: (time.sleep(0.3), start(self)))
    with caplog.at_level(logging.INFO, logger="exporter.startup"):
        TensorRTMMExporter(folder, device="cpu").close()
    (line,) = [record.getMessage() for record in caplog.records
               if record.getMessage().startswith("phase warm-up: compile, choose kernels, capture graphs:")]
    total = float(line.split(": ")[2].split(" s")[0])
    parts = [float(seconds) for seconds in WARM_UP_PARTS.findall(line)]
    built, other = float(line.split("pipeline built in ")[1].split(" s")[0]), parts[-1]
    assert built < 0.25 <= other, line
    assert abs(total - sum(parts)) <= 0.005 * (len(parts) + 2), line
    assert "MB from the disk" in line


def test_tensors_the_decoder_took_as_copies_get_the_files_values_too(engines, gate):
    """A decoder that casts what it is given (float32 file, bfloat16 decoder: `background_fill` never asks for
    it, for memory's sake, but any tensor it copies, a quantized engine's scale say, goes the same way)."""
    folder, _ = engines["float32"]
    arriving = directory._start_llm(folder, "cpu", torch.bfloat16, None, None)
    state = arriving.decoder.state_dict()
    assert len(arriving.copied) == len(state) and not any(t.any() for t in state.values())
    gate.set()
    arriving.wait()
    expected = load_file(folder / LLM_WEIGHTS)
    assert all(torch.equal(tensor, expected[name].to(torch.bfloat16)) for name, tensor in
               arriving.decoder.state_dict().items())


def test_a_failed_wait_raises_again_and_frees_the_pinned_ring(engines, gate, tmp_path):
    """A failed fill is never taken for a finished one: each wait raises it (the weights are zeros, not the
    file's), the engine keeps it for `abandon_weights`, and the fill's host buffers are let go at once."""
    short = tmp_path / "engine"
    shutil.copytree(engines["float32"][0], short)
    weights = short / LLM_WEIGHTS
    engine = directory.load_engine(short, device="cpu", verify=False, weights_in_background=True)
    pending = engine.arriving.pending
    with open(weights, "r+b") as stream:
        stream.truncate(weights.stat().st_size - 1000)
    gate.set()
    for _ in range(2):
        with pytest.raises(EngineError, match="the file ended before its data did"):
            engine.wait_for_weights()
    assert engine.arriving is not None and pending._staging == []
    engine.abandon_weights()
    assert engine.arriving is None
    engine.wait_for_weights()  # abandoned: nothing left to wait for
