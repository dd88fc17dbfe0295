"""The restart's read-ahead (`exporter.engine.read_ahead`): what a start reads besides the LLM weights, read before
the weights' stream begins, and the prefetch (`exporter.engine.prefetch`), which reads what it left.

A restart of a tiny engine through each front end (`deploy_triton.py`, the Python API, the Ray Serve replica) runs
in a fresh process with an audit hook recording each file opened and each module imported, by thread: the
engine's other files are read, and the modules the load, its warm-up and the warm-up request would import late
are imported, before the prefetch's first read; nothing is imported after it by the servers. An export that loads
its engine reads nothing ahead. In this process, the spans both read through `page_cache` are recorded: the
prefetch reads the LLM weights and what the read-ahead left over its cap, nothing it read and never the ONNX
encoder; only this start's kernel cache folder is read (a fake GPU identity: there is no GPU), none on the CPU.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from exporter import TensorRTMMExporter, tensorrt_mm_exporter
from exporter.engine import kernel_cache, page_cache, prefetch, read_ahead
from exporter.engine.directory import LLM_WEIGHTS
from exporter.engine.page_cache import Span
from support.servers import DEPLOY_SCRIPT

LIMITS = {"max_batch_size": 1, "max_input_len": 256, "max_output_len": 4, "max_multimodal_len": 64}
KERNEL_FILES = ("choices.json", "triton/0a1b/kernel.cubin", "triton/0a1b/kernel.json", "triton/0a1b/__grp__kernel.json")
IDENTITY = {"gpu": "NVIDIA H100 80GB HBM3", "capability": "9.0", "torch": "2.5.1"}  # this start's, faked
RANK1 = "llm_engine/model.rank1.safetensors"
ONNX = "visual_engine/encoder.onnx"

# the restart, up to the warm-up request: the files opened (thread, path) until the prefetch opens the LLM weights,
# the modules loaded then (an audit hook sees no `importlib.import_module`) and those loaded by the end
RESTART = """
import json, logging, sys, threading
logging.basicConfig(level=logging.INFO)
opened, loaded = [], {{}}
def record(event, args):
    if event == "open" and isinstance(args[0], str) and "stream" not in loaded:
        opened.append((threading.current_thread().name, args[0]))
        if threading.current_thread().name.startswith("engine-prefetch") and args[0].endswith(sys.argv[3]):
            loaded["stream"] = list(sys.modules.copy())
sys.path.insert(0, sys.argv[1])
{imports}
sys.addaudithook(record)
exporter = {start}
exporter.triton_infer_fn(**exporter.triton_warmup_request())
exporter.close()
print(json.dumps({{"opened": opened, "at_stream": loaded["stream"], "at_end": list(sys.modules)}}))
"""
FRONT_ENDS = {  # (imports, the exporter loaded from the engine in sys.argv[2])
    "deploy_triton": ("import deploy_triton", "deploy_triton.build_deployable(deploy_triton.parse_settings("
                      "['-tmn', 'm', '-tmr', sys.argv[2], '--device', 'cpu']))"),
    "python_api": ("from exporter import TensorRTMMExporter", "TensorRTMMExporter(sys.argv[2], device='cpu')"),
    "ray_replica": ("from deploy.ray_serve.replica import EngineReplica",
                    "EngineReplica(sys.argv[2], engine_options={'device': 'cpu'}).exporter"),
}


@pytest.fixture(scope="module")
def engine(tmp_path_factory, vlm) -> Path:
    """A tiny Neva's engine, with a kernel cache beside it as a GPU start leaves one."""
    folder = tmp_path_factory.mktemp("read_ahead")
    TensorRTMMExporter(folder / "engine", load_model=False, device="cpu").export(
        vlm.nemo, model_type="neva", dtype="float32", load_model=False, **LIMITS)
    write_kernel_folder(folder / "engine" / ".cache" / "kernels-0123456789abcdef")
    return folder / "engine"


@pytest.fixture
def fake_engine(engine, tmp_path) -> Path:
    """The engine's inventory with a second rank's LLM weights and an ONNX encoder added, each file of a size of its
    own (the LLM weights the largest), and two kernel cache folders: this start's (`IDENTITY`) and another GPU's."""
    copy = tmp_path / "engine"
    manifest = json.loads((engine / "manifest.json").read_text())
    manifest["files"].update({RANK1: {}, ONNX: {}})
    for index, name in enumerate(manifest["files"]):
        (copy / name).parent.mkdir(parents=True, exist_ok=True)
        (copy / name).write_bytes(b"x" * (1000 * index + 5000 * read_ahead._llm_weights(name) + 1))
    (copy / "manifest.json").write_text(json.dumps(manifest))
    write_kernel_folder(kernel_cache.KernelCache(copy, IDENTITY).folder)
    write_kernel_folder(copy / ".cache" / "kernels-0123456789abcdef")
    return copy


@pytest.fixture
def reads(monkeypatch) -> list[tuple[str, Span]]:
    """(thread name, span) of each span read through `page_cache`, as its readers read them."""
    seen, lock, read = [], threading.Lock(), page_cache.read_span

    def record(span: Span, buffer: memoryview) -> None:
        with lock:
            seen.append((threading.current_thread().name, span))
        read(span, buffer)

    monkeypatch.setattr(page_cache, "read_span", record)
    return seen


def write_kernel_folder(folder: Path) -> None:
    for name in KERNEL_FILES:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(os.urandom(4096))


def read_by(reads: list[tuple[str, Span]], thread: str) -> set[Path]:
    return {span.path for name, span in reads if name == thread}


def wait_for_the_prefetch() -> None:
    for thread in threading.enumerate():
        if thread.name == "engine-prefetch":
            thread.join()


@pytest.mark.parametrize("front_end", FRONT_ENDS)
def test_a_restart_reads_its_other_files_and_imports_its_modules_before_the_weights_stream(engine, front_end):
    imports, start = FRONT_ENDS[front_end]
    result = subprocess.run([sys.executable, "-c", RESTART.format(imports=imports, start=start),
                             str(DEPLOY_SCRIPT.parent), str(engine), LLM_WEIGHTS],
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert result.returncode == 0, result.stderr[-2000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    read_first = {path for thread, path in seen["opened"] if thread.startswith("engine-read-ahead")}
    expected = {str(span.path) for span in read_ahead.engine_files(engine).others}
    assert expected - read_first == set()
    assert str(engine / LLM_WEIGHTS) not in read_first
    assert not [path for thread, path in seen["opened"] if "/.cache/" in path]  # a CPU start keeps no kernel cache
    assert set(read_ahead.LATE_MODULES) <= set(seen["at_stream"])
    if front_end != "python_api":  # the Triton warm-up request imports PyTriton, which a Python user may never use
        assert sorted(set(seen["at_end"]) - set(seen["at_stream"])) == []  # the list misses none
    assert result.stderr.count("phase read ahead of the LLM weights:") == 1  # once per load


def test_an_export_that_loads_its_engine_reads_nothing_ahead(vlm, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(tensorrt_mm_exporter, "read_ahead",
                        lambda model_dir, device: calls.append("read_ahead") or read_ahead.ReadAhead())
    monkeypatch.setattr(tensorrt_mm_exporter, "prefetch_engine", lambda files: calls.append("prefetch"))
    exporter = TensorRTMMExporter(tmp_path / "engine", load_model=False, device="cpu")
    exporter.export(vlm.nemo, model_type="neva", dtype="float32", **LIMITS)
    assert exporter.pipeline is not None and calls == []
    exporter.close()
    TensorRTMMExporter(tmp_path / "engine", device="cpu").close()
    assert calls == ["read_ahead", "prefetch"]


def test_the_engine_files_leave_out_the_llm_weights_and_the_onnx_encoder(fake_engine):
    files = read_ahead.engine_files(fake_engine)
    assert files.weights == [fake_engine / LLM_WEIGHTS, fake_engine / RANK1]
    names = [span.path.relative_to(fake_engine).as_posix() for span in files.others]
    assert ONNX not in names and not {LLM_WEIGHTS, RANK1} & set(names)
    assert {"manifest.json", "llm_engine/config.json"} <= set(names)
    assert not [name for name in names if name.startswith(".cache/")]  # the kernel cache: `kernel_files`
    sizes = [span.length for span in files.others]
    assert sizes == sorted(sizes)  # smallest first: the cap leaves the largest
    assert sizes == [(fake_engine / name).stat().st_size for name in names]


def test_files_over_the_byte_cap_are_left_to_the_stream_and_said(fake_engine, monkeypatch, caplog):
    files = read_ahead.engine_files(fake_engine)
    sizes = [span.length for span in files.others]
    monkeypatch.setattr(read_ahead, "MAX_BYTES", sum(sizes[:-1]))
    with caplog.at_level("INFO", logger="exporter.startup"):
        done = read_ahead.read_ahead(fake_engine, "cpu", modules=("json", "no_such_module_here"))
    assert (done.files, done.nbytes, done.modules) == (len(sizes) - 1, sum(sizes[:-1]), 1)
    assert done.stream == [*files.weights, files.others[-1].path]
    (line,) = [record.getMessage() for record in caplog.records
               if record.getMessage().startswith("phase read ahead of the LLM weights:")]
    assert f"{len(sizes) - 1} files" in line and "1 over the cap" in line and "1 modules imported" in line


def test_the_prefetch_reads_only_what_the_read_ahead_left(fake_engine, reads, monkeypatch, caplog):
    largest = read_ahead.engine_files(fake_engine).others[-1]
    monkeypatch.setattr(read_ahead, "MAX_BYTES", sum(span.length for span in read_ahead.engine_files(
        fake_engine).others) - largest.length)
    monkeypatch.setattr(prefetch, "BLOCK_BYTES", 4096)
    with caplog.at_level("INFO", logger="exporter.startup"):
        done = read_ahead.read_ahead(fake_engine, "cpu", modules=())
        assert prefetch.prefetch_engine(done.stream)
        wait_for_the_prefetch()
    read_first, streamed = read_by(reads, "engine-read-ahead"), read_by(reads, "engine-prefetch")
    assert streamed == {fake_engine / LLM_WEIGHTS, fake_engine / RANK1, largest.path}
    assert not read_first & streamed and fake_engine / ONNX not in read_first | streamed
    for path in streamed:  # every byte once, in blocks
        blocks = sorted((span.offset, span.length) for name, span in reads if span.path == path)
        assert [offset for offset, _ in blocks] == list(range(0, path.stat().st_size, 4096))
        assert sum(length for _, length in blocks) == path.stat().st_size
    total = sum(path.stat().st_size for path in streamed)
    ends = [record.getMessage() for record in caplog.records if "prefetch the engine files" in record.getMessage()]
    assert len(ends) == 1 and re.fullmatch(
        rf"phase prefetch the engine files \(in the background\): \d+\.\d\d s \({total / 1e9:.2f} GB\)", ends[0])


def test_the_prefetch_starts_nothing_without_files_or_room(fake_engine, monkeypatch):
    wait_for_the_prefetch()
    assert not prefetch.prefetch_engine([]) and not prefetch.prefetch_engine([fake_engine / "no_such_file"])
    meminfo = {"MemAvailable": f"MemAvailable: {2 * (fake_engine / LLM_WEIGHTS).stat().st_size // 1024 - 1} kB\n"}
    monkeypatch.setattr(prefetch, "open", lambda path: io.StringIO(meminfo.pop("MemAvailable", "")), raising=False)
    assert not prefetch.prefetch_engine([fake_engine / LLM_WEIGHTS])  # more than half the memory available
    assert not prefetch.prefetch_engine([fake_engine / LLM_WEIGHTS])  # no MemAvailable line
    assert not [thread for thread in threading.enumerate() if thread.name == "engine-prefetch"]


def test_only_this_start_s_kernel_cache_folder_is_read(fake_engine, reads, monkeypatch):
    this_start = kernel_cache.KernelCache(fake_engine, IDENTITY).folder
    monkeypatch.setattr(kernel_cache, "device_identity", lambda device: IDENTITY)
    done = read_ahead.read_ahead(fake_engine, "cuda:0", modules=())
    cached = {path for path in read_by(reads, "engine-read-ahead") if ".cache" in path.parts}
    assert done.kernel_folder == this_start and cached == {this_start / name for name in KERNEL_FILES}
    assert read_ahead.kernel_folder(fake_engine, "cpu") is None  # the CPU keeps no kernel cache


def test_no_kernel_cache_folder_is_read_where_cuda_fails(fake_engine, reads):
    done = read_ahead.read_ahead(fake_engine, "cuda", modules=())  # this machine has no GPU
    assert done.kernel_folder is None and "kernel cache" not in done.describe()
    assert not [span for _, span in reads if ".cache" in span.path.parts]


def test_a_span_is_read_to_its_end_and_no_further(tmp_path, monkeypatch):
    path = tmp_path / "file"
    path.write_bytes(os.urandom(1000))
    calls, preadv = [], os.preadv

    def record(fd: int, buffers: list, offset: int) -> int:
        count = preadv(fd, buffers, offset)
        calls.append((offset, len(buffers[0]), count))
        return count

    monkeypatch.setattr(os, "preadv", record)
    page_cache.read_span(Span(path, 100, 250), memoryview(bytearray(64)))
    assert calls == [(100, 64, 64), (164, 64, 64), (228, 64, 64), (292, 58, 58)]
    calls.clear()
    page_cache.read_span(Span(path, 900, 250), memoryview(bytearray(64)))  # up to the file's end
    assert calls == [(900, 64, 64), (964, 64, 36), (1000, 64, 0)]
