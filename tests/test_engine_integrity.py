"""Engine files: atomic export (a failed export changes nothing) and integrity (sizes and sha256 in the manifest).

A real tiny Neva `.nemo` is exported once; each test works on a copy of that engine, next to files of the user's.
Corrupt and truncated files are refused with one line naming the file, by `TensorRTMMExporter(model_dir)` and by
`scripts/deploy_triton.py` (exit status 1, no traceback).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from exporter import TensorRTMMExporter
from exporter.engine import EngineError
from support.archives import METADATA, replace_member, via_stack_global
from support.media import random_image
from support.ports import free_port

REPO = Path(__file__).resolve().parents[1]
LIMITS = {"max_batch_size": 1, "max_input_len": 256, "max_output_len": 4, "max_multimodal_len": 64}
LLM_WEIGHTS = "llm_engine/model.safetensors"
QUESTION = "describe the image"


@pytest.fixture(scope="module")
def pristine(vlm, tmp_path_factory) -> Path:
    """An engine exported from `vlm` (never changed: tests copy it)."""
    engine = tmp_path_factory.mktemp("pristine") / "engine"
    export(engine, vlm.nemo)
    return engine


@pytest.fixture
def engine(pristine, tmp_path) -> Path:
    """A copy of the engine (times kept, so it counts as verified) in a folder that also holds the user's files."""
    folder = tmp_path / "repo"
    shutil.copytree(pristine, folder)
    (folder / "notes.txt").write_text("the user's own notes")
    (folder / "mine").mkdir()
    (folder / "mine" / "data.bin").write_bytes(os.urandom(64))
    return folder


def export(model_dir: Path, nemo: Path, **overrides) -> TensorRTMMExporter:
    exporter = TensorRTMMExporter(model_dir, load_model=False, device="cpu")
    exporter.export(nemo, model_type="neva", dtype="float32", **{**LIMITS, **overrides})
    return exporter


def snapshot(folder: Path) -> dict[str, bytes | None]:
    """Every entry under `folder` (hidden ones too): file bytes, None for folders."""
    return {p.relative_to(folder).as_posix(): (p.read_bytes() if p.is_file() else None)
            for p in sorted(folder.rglob("*"))}


def answer(model_dir: Path, **kwargs) -> list[list[str]]:
    return TensorRTMMExporter(model_dir, device="cpu", **kwargs).forward(QUESTION, random_image(3), max_output_len=3)


# -- the manifest's inventory ----------------------------------------------------------------------------------


def test_manifest_lists_every_file_with_size_and_sha256(pristine):
    manifest = json.loads((pristine / "manifest.json").read_text())
    assert manifest["format_version"] == 2
    on_disk = {p.relative_to(pristine).as_posix(): p for p in pristine.rglob("*") if p.is_file()}
    assert set(on_disk) == set(manifest["files"]) | {"manifest.json", ".verified"}
    for name, record in manifest["files"].items():
        data = on_disk[name].read_bytes()
        assert record == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}, name
    assert LLM_WEIGHTS in manifest["files"] and "visual_engine/model.safetensors" in manifest["files"]


# -- atomic export ----------------------------------------------------------------------------------------------


def _gadget_nemo(folder: Path, marker: Path, tiny_gpt_weights) -> Path:
    from tools.nemo_writer import write_nemo

    config = {"num_layers": 1, "hidden_size": 16, "ffn_hidden_size": 32, "num_attention_heads": 4,
              "activation": "fast-swiglu", "normalization": "rmsnorm", "bias": False}
    base = write_nemo(folder / "base.nemo", config, tiny_gpt_weights(config), layout="torch_dist")
    gadget = via_stack_global("torch.distributed.checkpoint.metadata", "os.system", f"touch {marker}")
    return replace_member(base, folder / "gadget.nemo", METADATA, gadget)


def _truncated_nemo(vlm, folder: Path) -> Path:
    path = folder / "truncated.nemo"
    data = vlm.nemo.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return path


def test_failed_exports_leave_the_engine_and_the_users_files_byte_identical(vlm, engine, tmp_path,
                                                                           tiny_gpt_weights):
    before, answered = snapshot(engine), answer(engine)
    marker = tmp_path / "marker"
    sources = {
        "truncated .nemo": (_truncated_nemo(vlm, tmp_path), "truncated"),
        "missing path": (tmp_path / "absent.nemo", "no such file"),
        "code-running .metadata": (_gadget_nemo(tmp_path, marker, tiny_gpt_weights), "refusing to unpickle"),
        "bad argument": (vlm.nemo, "max_multimodal_len"),
    }
    for case, (source, problem) in sources.items():
        overrides = {"max_multimodal_len": 1} if case == "bad argument" else {}
        with pytest.raises(Exception, match=problem):
            export(engine, source, **overrides)
        assert snapshot(engine) == before, case
    assert not marker.exists()
    assert answer(engine) == answered


def test_an_interrupted_export_leaves_everything_as_it_was(vlm, engine, monkeypatch):
    """Ctrl-C when the new engine is all written (only its inventory is missing): the staging folder goes."""
    import exporter.engine.directory as directory

    def interrupt(_folder, **_):
        raise KeyboardInterrupt

    before = snapshot(engine)
    monkeypatch.setattr(directory, "describe_files", interrupt)
    with pytest.raises(KeyboardInterrupt):
        export(engine, vlm.nemo)
    assert snapshot(engine) == before


@pytest.mark.parametrize("fail_at", [1, 3, 6])
def test_a_failure_while_swapping_moves_everything_back(vlm, engine, monkeypatch, fail_at):
    """The swap is renames; when one fails (here the `fail_at`-th: old manifest out, old folders out, new ones
    in), those done are undone, so the previous engine is whole again."""
    import exporter.engine.atomic as atomic

    real_replace, calls = os.replace, []

    def flaky_replace(src, dst):
        if Path(src).name.startswith(".verified."):  # the marker's own write, before the swap
            return real_replace(src, dst)
        calls.append(src)
        if len(calls) == fail_at:
            raise OSError(28, "No space left on device")
        real_replace(src, dst)

    before = snapshot(engine)
    monkeypatch.setattr(atomic.os, "replace", flaky_replace)
    with pytest.raises(OSError, match="No space left"):
        export(engine, vlm.nemo)
    assert len(calls) >= fail_at  # the failed rename (then the undoing ones)
    assert snapshot(engine) == before


def test_a_failed_export_into_a_new_folder_leaves_no_folder(vlm, tmp_path):
    target = tmp_path / "new" / "engine"
    with pytest.raises(Exception, match="truncated"):
        export(target, _truncated_nemo(vlm, tmp_path))
    assert not target.exists()


def test_export_replaces_only_the_previous_engines_files(vlm, engine):
    """The old engine's entries (its manifest's files, even one this export does not write) are replaced; the
    user's files stay byte-identical."""
    manifest_path = engine / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    (engine / "old_part").mkdir()
    (engine / "old_part" / "x.bin").write_bytes(b"written by an earlier export")
    manifest["files"]["old_part/x.bin"] = {"size": 28, "sha256": hashlib.sha256(b"written by an earlier export")
                                           .hexdigest()}
    manifest_path.write_text(json.dumps(manifest))
    users = {name: data for name, data in snapshot(engine).items() if name.startswith(("notes", "mine"))}
    export(engine, vlm.nemo, max_output_len=8)
    after = snapshot(engine)
    assert {name: after[name] for name in users} == users
    assert not (engine / "old_part").exists()
    new_manifest = json.loads(manifest_path.read_text())
    assert new_manifest["limits"]["max_output_len"] == 8
    assert sorted(after) == sorted({*users, "manifest.json", ".verified", "llm_engine", "visual_engine",
                                    *new_manifest["files"]})
    assert answer(engine)


def test_export_over_a_format_1_engine_replaces_its_folders(vlm, engine):
    manifest_path = engine / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    del manifest["files"]
    manifest_path.write_text(json.dumps({**manifest, "format_version": 1}))
    (engine / ".verified").unlink()
    with pytest.raises(EngineError, match="format version 1.*export the checkpoint again"):
        TensorRTMMExporter(engine, device="cpu")
    export(engine, vlm.nemo)
    assert (engine / "notes.txt").read_text() == "the user's own notes"
    assert json.loads(manifest_path.read_text())["format_version"] == 2


def test_a_folder_without_an_engine_is_refused_whatever_delete_existing_files_says(vlm, tmp_path):
    folder = tmp_path / "busy"
    folder.mkdir()
    (folder / "file.txt").write_text("x")
    for delete in (True, False):
        with pytest.raises(EngineError, match=r"There are files in this folder .*busy.*no engine"):
            export(folder, vlm.nemo, delete_existing_files=delete)
    assert snapshot(folder) == {"file.txt": b"x"}


def test_an_engine_is_kept_when_delete_existing_files_is_false(vlm, engine):
    before = snapshot(engine)
    with pytest.raises(EngineError, match="Try setting delete_existing_files=True"):
        export(engine, vlm.nemo, delete_existing_files=False)
    assert snapshot(engine) == before


def test_an_unrelated_entry_with_an_engine_name_is_not_replaced(vlm, engine):
    """A perception folder name the old engine does not own (here: an audio engine's) blocks the swap."""
    (engine / "perception_engine").mkdir()
    (engine / "perception_engine" / "mine.txt").write_text("mine")
    manifest_path = engine / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["files"] = {k: v for k, v in manifest["files"].items() if not k.startswith("visual_engine/")}
    manifest_path.write_text(json.dumps(manifest))
    shutil.move(engine / "visual_engine", engine / "users_visual_engine")
    (engine / "visual_engine").mkdir()
    (engine / "visual_engine" / "mine.txt").write_text("also mine")
    before = snapshot(engine)
    with pytest.raises(EngineError, match="visual_engine is not part of the engine there"):
        export(engine, vlm.nemo)
    assert snapshot(engine) == before


# -- integrity at load -----------------------------------------------------------------------------------------


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])


def _flip_byte(path: Path, keep_time: bool = False) -> None:
    """Invert one byte of the tensor data (the header stays valid), optionally keeping the file's times."""
    stat = path.stat()
    data = bytearray(path.read_bytes())
    data[len(data) - 7] ^= 0xFF
    path.write_bytes(bytes(data))
    if keep_time:
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


@pytest.mark.parametrize("verify", [None, True, False])
def test_truncated_files_are_named_at_every_load(engine, verify):
    for name in (LLM_WEIGHTS, "visual_engine/model.safetensors", "llm_engine/tokenizer.model"):
        path = engine / name
        saved = path.read_bytes()
        _truncate(path)
        expected = f"engine file {name} is truncated: {len(saved) - 100} of {len(saved)} bytes"
        with pytest.raises(EngineError, match=expected) as error:
            TensorRTMMExporter(engine, device="cpu", verify_engine=verify)
        assert "\n" not in str(error.value) and str(engine) not in str(error.value)
        path.write_bytes(saved)


def test_a_flipped_byte_is_found_when_the_file_changed_since_its_check(engine):
    """Rewriting a file (new modification time) brings the hash check back by default; --no-verify_engine loads
    the bad bytes (as before: the answer would be garbage)."""
    _flip_byte(engine / LLM_WEIGHTS)
    with pytest.raises(EngineError, match=f"engine file {LLM_WEIGHTS} is corrupt: sha256 mismatch"):
        TensorRTMMExporter(engine, device="cpu")
    assert TensorRTMMExporter(engine, device="cpu", verify_engine=False).engine is not None


def test_hashes_are_checked_on_the_first_read_and_skipped_after(pristine, tmp_path):
    """Copied without its marker (a first read), the engine is hashed; a verified engine whose bytes change
    behind unchanged times is only caught with verify_engine=True."""
    engine = tmp_path / "engine"
    shutil.copytree(pristine, engine)
    _flip_byte(engine / "visual_engine/model.safetensors", keep_time=True)
    assert answer(engine)  # the marker matches: sizes checked, hashes not
    (engine / ".verified").unlink()
    with pytest.raises(EngineError, match="engine file visual_engine/model.safetensors is corrupt"):
        TensorRTMMExporter(engine, device="cpu")
    assert not (engine / ".verified").exists()
    shutil.rmtree(engine)
    shutil.copytree(pristine, engine)
    (engine / ".verified").unlink()
    answered = answer(engine)
    assert (engine / ".verified").is_file()  # a passed check is remembered
    _flip_byte(engine / LLM_WEIGHTS, keep_time=True)
    with pytest.raises(EngineError, match=f"engine file {LLM_WEIGHTS} is corrupt"):
        TensorRTMMExporter(engine, device="cpu", verify_engine=True)
    assert answered


def test_a_garbage_safetensors_header_is_one_line_without_hashing(engine):
    path = engine / LLM_WEIGHTS
    size = path.stat().st_size
    path.write_bytes(b"\xff" * size)
    with pytest.raises(EngineError, match=f"engine file {LLM_WEIGHTS} is not a readable safetensors file") as error:
        TensorRTMMExporter(engine, device="cpu", verify_engine=False)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("text, problem", [
    ("{not json", "manifest.json of .* is unreadable"),
    (json.dumps({"format_version": 2, "model_type": "neva", "modality": "vision"}), "lists no engine files"),
    (None, "invalid file name '../../etc/passwd'"),
])
def test_a_broken_manifest_is_one_line(engine, text, problem):
    manifest_path = engine / "manifest.json"
    if text is None:
        manifest = json.loads(manifest_path.read_text())
        manifest["files"]["../../etc/passwd"] = {"size": 1, "sha256": "0" * 64}
        text = json.dumps(manifest)
    manifest_path.write_text(text)
    with pytest.raises(EngineError, match=problem) as error:
        TensorRTMMExporter(engine, device="cpu")
    assert "\n" not in str(error.value)


# -- through scripts/deploy_triton.py -------------------------------------------------------------------------


def run_deploy_script(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, str(REPO / "scripts/deploy_triton.py"), "-tmn", "model", "-tha", "127.0.0.1",
               "-trp", str(free_port()), "--grpc_port", str(free_port()), "--device", "cpu", *args]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, check=False)


def assert_one_error_line(done: subprocess.CompletedProcess, *expected: str) -> None:
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("deploy_triton.py: error:")]
    assert len(errors) == 1, done.stderr
    for text in expected:
        assert text in errors[0], errors[0]


@pytest.mark.parametrize("damage", ["truncated", "flipped"])
def test_deploy_script_names_a_bad_engine_file_and_exits_1(engine, damage):
    path = engine / LLM_WEIGHTS
    _truncate(path) if damage == "truncated" else _flip_byte(path)
    done = run_deploy_script("-tmr", str(engine))
    assert_one_error_line(done, "loading the model repository failed", f"engine file {LLM_WEIGHTS} is",
                          "truncated" if damage == "truncated" else "corrupt: sha256 mismatch")


def test_deploy_script_refuses_a_code_running_checkpoint_and_keeps_the_repository(engine, tmp_path,
                                                                                 tiny_gpt_weights):
    marker = tmp_path / "marker"
    before = snapshot(engine)
    done = run_deploy_script("-tmr", str(engine), "-mt", "neva", "-vc",
                             str(_gadget_nemo(tmp_path, marker, tiny_gpt_weights)))
    assert_one_error_line(done, "the export failed", "refusing to unpickle")
    assert not marker.exists()
    assert snapshot(engine) == before
