"""The restart's read-ahead (`exporter.engine.read_ahead`): what a start reads besides the LLM weights, read before
the weights' stream begins.

A restart of a tiny engine through each front end (`deploy_triton.py`, the Python API, the Ray Serve replica) runs
in a fresh process with an audit hook recording each file opened and each module imported, by thread: the
engine's other files and the kernel cache's (a fake one here: there is no GPU) are read, and the modules the load,
its warm-up and the warm-up request would import late are imported, before the prefetch's first read; nothing is
imported after it by the servers. An export that loads its engine reads nothing ahead.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from exporter import TensorRTMMExporter, tensorrt_mm_exporter
from exporter.engine import read_ahead
from exporter.engine.directory import LLM_WEIGHTS
from support.servers import DEPLOY_SCRIPT
from support.tokenizer_files import tokenizer_file
from support.vlm import build_vlm

LIMITS = {"max_batch_size": 1, "max_input_len": 256, "max_output_len": 4, "max_multimodal_len": 64}
KERNEL_FILES = ("choices.json", "triton/0a1b/kernel.cubin", "triton/0a1b/kernel.json", "triton/0a1b/__grp__kernel.json")

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
def vlm(tmp_path_factory):
    folder = tmp_path_factory.mktemp("read_ahead_vlm")
    return build_vlm(folder / "legacy", tokenizer_file(folder))


@pytest.fixture(scope="module")
def engine(tmp_path_factory, vlm) -> Path:
    """A tiny Neva's engine, with a kernel cache beside it as a GPU start leaves one."""
    folder = tmp_path_factory.mktemp("read_ahead")
    TensorRTMMExporter(folder / "engine", load_model=False, device="cpu").export(
        vlm.nemo, model_type="neva", dtype="float32", load_model=False, **LIMITS)
    cache = folder / "engine" / ".cache" / "kernels-0123456789abcdef"
    for name in KERNEL_FILES:
        (cache / name).parent.mkdir(parents=True, exist_ok=True)
        (cache / name).write_bytes(os.urandom(4096))
    return folder / "engine"


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
    expected = set(map(str, read_ahead.engine_files(engine)))
    assert {str(engine / ".cache/kernels-0123456789abcdef" / name) for name in KERNEL_FILES} <= expected
    assert expected - read_first == set()
    assert str(engine / LLM_WEIGHTS) not in read_first
    assert set(read_ahead.LATE_MODULES) <= set(seen["at_stream"])
    if front_end != "python_api":  # the Triton warm-up request imports PyTriton, which a Python user may never use
        assert sorted(set(seen["at_end"]) - set(seen["at_stream"])) == []  # the list misses none
    assert result.stderr.count("phase read ahead of the LLM weights:") == 1  # once per load


def test_an_export_that_loads_its_engine_reads_nothing_ahead(vlm, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(tensorrt_mm_exporter, "read_ahead", lambda model_dir: calls.append("read_ahead"))
    monkeypatch.setattr(tensorrt_mm_exporter, "prefetch_engine", lambda model_dir: calls.append("prefetch"))
    exporter = TensorRTMMExporter(tmp_path / "engine", load_model=False, device="cpu")
    exporter.export(vlm.nemo, model_type="neva", dtype="float32", **LIMITS)
    assert exporter.pipeline is not None and calls == []
    exporter.close()
    TensorRTMMExporter(tmp_path / "engine", device="cpu").close()
    assert calls == ["read_ahead", "prefetch"]


def test_the_engine_files_leave_out_the_llm_weights_and_the_onnx_encoder(engine, tmp_path):
    copy = tmp_path / "engine"
    manifest = json.loads((engine / "manifest.json").read_text())
    manifest["files"].update({"llm_engine/model.rank1.safetensors": {}, "visual_engine/encoder.onnx": {}})
    for name in [*manifest["files"], ".cache/kernels-0/choices.json"]:
        (copy / name).parent.mkdir(parents=True, exist_ok=True)
        (copy / name).write_bytes(b"x" * (len(name) + 1))
    (copy / "manifest.json").write_text(json.dumps(manifest))
    names = [path.relative_to(copy).as_posix() for path in read_ahead.engine_files(copy)]
    assert LLM_WEIGHTS not in names and "llm_engine/model.rank1.safetensors" not in names
    assert "visual_engine/encoder.onnx" not in names
    assert {"manifest.json", ".cache/kernels-0/choices.json", "llm_engine/config.json"} <= set(names)
    sizes = [(copy / name).stat().st_size for name in names]
    assert sizes == sorted(sizes)  # smallest first: the cap leaves the largest


def test_files_over_the_byte_cap_are_left_and_said(engine, monkeypatch, caplog):
    files = read_ahead.engine_files(engine)
    sizes = [path.stat().st_size for path in files]
    monkeypatch.setattr(read_ahead, "MAX_BYTES", sum(sizes[:-1]))
    with caplog.at_level("INFO", logger="exporter.startup"):
        done = read_ahead.read_ahead(engine, modules=("json", "no_such_module_here"))
    assert (done.files, done.nbytes, done.left, done.modules) == (len(files) - 1, sum(sizes[:-1]), 1, 1)
    (line,) = [record.getMessage() for record in caplog.records
               if record.getMessage().startswith("phase read ahead of the LLM weights:")]
    assert f"{len(files) - 1} files" in line and "1 over the cap" in line and "1 modules imported" in line
