"""Cold start: engine weights streamed to and from disk, the kernel-choice cache, and the start-up phase lines.

Writing a dict is checked byte for byte against safetensors' own `save_file`; writing a stream (an export's LLM
weights, in the checkpoint's order) by safetensors' own reader, the header's layout and the hash; loading against
safetensors' `load_file` and the file's sha256; the CUDA path's read ring runs on the CPU with copies that land
only when waited for, so a buffer reused too early shows as wrong bytes. The kernel cache is checked with fake
timings and a fake GPU identity (no GPU here): a hit times nothing, and another identity, a corrupt file or stale
entries fall back to timing and are rewritten. Peak memory is measured in a fresh process.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from exporter import TensorRTMMExporter
from exporter.checkpoint import NemoCheckpoint, NemoCheckpointError
from exporter.engine import EngineError, writing
from exporter.engine.directory import LLM_WEIGHTS, load_llm_weights
from exporter.engine.kernel_cache import CHOICES_FILE, KernelCache
from exporter.engine.loading import load_tensors, stream_chunks
from exporter.engine.progress import byte_progress
from exporter.engine.safetensors_format import read_header
from exporter.engine.writing import stream_tensors, write_tensors
from exporter.llm import gemv, paged_triton
from exporter.meta_device import on_meta
from exporter.models import get_model_type
from support.media import random_image

MB = 1 << 20
IDENTITY = {"gpu": "Fake GPU 80GB", "capability": "9.0", "torch": "2.11.0", "cuda": "12.8", "triton": "3.5.0",
            "package": "0.1.0"}
LIMITS = {"max_batch_size": 1, "max_input_len": 256, "max_output_len": 4, "max_multimodal_len": 64}


def random_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {"layers.0.weight": torch.randn(48, 40, generator=generator), "layers.0.bias": torch.randn(48),
            "norm.weight": torch.randn(40), "embedding.weight": torch.randn(97, 40, generator=generator),
            "scalar": torch.tensor(1.5)}


# --- writing ---------------------------------------------------------------------------------------------------------

def test_streamed_weights_are_the_bytes_save_file_writes(tmp_path):
    weights = random_weights()
    save_file({name: t.to(torch.bfloat16).contiguous() for name, t in weights.items()}, tmp_path / "old.safetensors")
    consumed = dict(weights)
    sha256 = write_tensors(tmp_path / "new.safetensors", consumed, torch.bfloat16, writers=3)
    new = (tmp_path / "new.safetensors").read_bytes()
    assert new == (tmp_path / "old.safetensors").read_bytes()
    assert sha256 == hashlib.sha256(new).hexdigest()
    assert consumed == {}  # each tensor left the caller's dict as it was written


def test_mixed_dtypes_are_stored_aligned_and_read_back_by_safetensors(tmp_path):
    """A quantized engine's mix (int8 / uint8 weights, bf16 scales, float32 leftovers): every tensor starts at a
    multiple of its element size, so it can be viewed in place."""
    generator = torch.Generator().manual_seed(1)
    weights = {"a.weight": torch.randint(-128, 127, (33, 17), dtype=torch.int8, generator=generator),
               "a.weight_scale": torch.randn(33).to(torch.bfloat16), "b.packed": torch.randint(0, 255, (5, 3),
                                                                                           dtype=torch.uint8),
               "c.bias": torch.randn(7), "d.index": torch.arange(3), "empty": torch.empty(0, 4)}
    write_tensors(tmp_path / "mixed.safetensors", dict(weights))
    with safe_open(tmp_path / "mixed.safetensors", "pt") as stored:
        assert {name: stored.get_tensor(name).dtype for name in stored.keys()} == {  # noqa: SIM118
            name: t.dtype for name, t in weights.items()}
        for name, tensor in weights.items():
            assert torch.equal(stored.get_tensor(name), tensor)
    with open(tmp_path / "mixed.safetensors", "rb") as stream:
        data_start, entries = read_header(stream, (tmp_path / "mixed.safetensors").stat().st_size)
    assert data_start % 8 == 0 and all(e.start % e.dtype.itemsize == 0 for e in entries)


def test_streamed_tensors_load_with_safetensors_and_keep_the_stream_order(tmp_path):
    """The header comes from the metadata alone, the data follows the source's order (not the names'), and the
    file is valid safetensors: safetensors' reader and the engine's loader give the tensors, the hash matches."""
    weights = random_weights(3)
    order = ["norm.weight", "scalar", "layers.0.weight", "embedding.weight", "layers.0.bias"]
    path = tmp_path / "streamed.safetensors"
    sha256 = stream_tensors(path, {name: weights[name].to("meta") for name in order},
                            ((name, weights[name].clone()) for name in order), torch.bfloat16, ahead_bytes=1)
    expected = {name: t.to(torch.bfloat16) for name, t in weights.items()}
    assert sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    with safe_open(path, "pt") as stored:
        assert sorted(stored.keys()) == sorted(expected)
        assert all(torch.equal(stored.get_tensor(name), expected[name]) for name in expected)
    loaded = load_tensors(path, "cpu")
    assert all(torch.equal(loaded[name], expected[name]) for name in expected)
    with open(path, "rb") as stream:
        data_start, entries = read_header(stream, path.stat().st_size)  # contiguous, covering the file
    assert data_start % 8 == 0 and [e.name for e in entries] == order


def test_the_reader_runs_at_most_its_budget_ahead_of_the_writers(tmp_path, monkeypatch):
    monkeypatch.setattr(writing, "MAX_PENDING_BYTES", 4000)
    tensors = {f"t{i:02d}": torch.full((250,), float(i)) for i in range(40)}  # 1,000 bytes each as float32
    written, ahead = [0], []

    def source():
        for number, (name, tensor) in enumerate(tensors.items()):
            ahead.append(number * 1000 - written[0])  # read beyond what the writers have finished
            yield name, tensor

    path = tmp_path / "w.safetensors"
    stream_tensors(path, {k: v.to("meta") for k, v in tensors.items()}, source(), torch.float32,
                   progress=lambda n: written.__setitem__(0, written[0] + n), writers=2, ahead_bytes=3000)
    assert max(ahead) <= 3000 + 4000 + 2 * 1000 + 4 * 1000  # read-ahead + pending (+ one each) + the pool's queue
    stored = load_file(path)
    assert all(torch.equal(stored[k], v) for k, v in tensors.items())


@pytest.mark.parametrize("failure", ["reading", "writing"])
def test_a_failure_on_either_side_stops_the_stream_and_its_reader(tmp_path, failure):
    weights = random_weights()
    metas = {name: t.to("meta") for name, t in weights.items()}

    def source():
        for number, (name, tensor) in enumerate(weights.items()):
            if number == 2:
                if failure == "reading":
                    raise NemoCheckpointError("member model_weights.ckpt is truncated")
                name = "not.asked.for"
            yield name, tensor

    with pytest.raises((NemoCheckpointError, ValueError), match="truncated|expected tensor"):
        stream_tensors(tmp_path / "w.safetensors", metas, source(), torch.bfloat16)
    assert not [t for t in threading.enumerate() if t.name == "engine-reader"]


# --- loading ---------------------------------------------------------------------------------------------------------

def test_cpu_load_views_one_mapping_hashes_and_leaves_the_file_alone(tmp_path):
    path = tmp_path / "w.safetensors"
    write_tensors(path, random_weights())
    expected, file_bytes = load_file(path), path.read_bytes()
    digest, seen = hashlib.sha256(), []
    loaded = load_tensors(path, "cpu", digest, seen.append)
    assert list(loaded) == list(expected) and all(torch.equal(loaded[k], expected[k]) for k in expected)
    assert len({t.untyped_storage().data_ptr() for t in loaded.values()}) == 1  # views of one mapping
    assert digest.hexdigest() == hashlib.sha256(file_bytes).hexdigest()
    assert sum(seen) == sum(t.numel() * t.element_size() for t in expected.values())
    loaded["norm.weight"].zero_()  # a private mapping: the process's copy changes, the file does not
    assert path.read_bytes() == file_bytes


class DeferredCopy:
    """A copy that lands only when waited for (as a CUDA copy may): reading into its source before then loses it."""

    def __init__(self, target: torch.Tensor, offset: int, chunk: torch.Tensor, log: list):
        self.target, self.offset, self.chunk, self.log = target, offset, chunk, log
        self.done = False

    def synchronize(self) -> None:
        if not self.done:
            self.target[self.offset:self.offset + len(self.chunk)].copy_(self.chunk)
            self.done = True
            self.log.append(self.offset)


@pytest.mark.parametrize("chunk_bytes,buffers", [(1000, 3), (777, 1), (1 << 20, 4)])
def test_the_read_ring_reuses_a_buffer_only_after_its_copy(tmp_path, chunk_bytes, buffers):
    """The CUDA path's reading loop (threads reading ahead into a ring of staging buffers) on the CPU."""
    path = tmp_path / "w.safetensors"
    write_tensors(path, random_weights(2))
    data, start = path.read_bytes(), 64
    target = torch.zeros(len(data) - start, dtype=torch.uint8)
    copies, landed = [], []

    def put(offset: int, chunk: torch.Tensor) -> DeferredCopy:
        copies.append(DeferredCopy(target, offset, chunk, landed))
        return copies[-1]

    digest = hashlib.sha256(data[:start])
    descriptor = os.open(path, os.O_RDONLY)
    try:
        staging = [torch.empty(chunk_bytes, dtype=torch.uint8) for _ in range(buffers)]
        stream_chunks(descriptor, start, len(data) - start, staging, put, digest)
    finally:
        os.close(descriptor)
    for copy in copies:
        copy.synchronize()
    assert bytes(target.numpy()) == data[start:]
    assert digest.hexdigest() == hashlib.sha256(data).hexdigest()
    assert [c.offset for c in copies] == sorted(c.offset for c in copies)


def test_a_broken_weights_file_is_one_line_naming_it(tmp_path):
    (tmp_path / "llm_engine").mkdir()
    weights = tmp_path / LLM_WEIGHTS
    write_tensors(weights, random_weights())
    weights.write_bytes(weights.read_bytes()[:-5])
    with pytest.raises(EngineError, match=f"engine file {LLM_WEIGHTS} is not a readable safetensors file") as error:
        load_llm_weights(tmp_path, "cpu")
    assert "\n" not in str(error.value) and str(tmp_path) not in str(error.value)


LOAD_CHILD = """
import json, sys
from collections.abc import Callable
from pathlib import Path
import torch
from exporter.engine.directory import load_llm_weights
from exporter.llm.config import DecoderConfig
from exporter.llm.model import Decoder

def memory():
    with open("/proc/self/status") as status:
        fields = dict(line.split(":", 1) for line in status)
    return {key: int(fields[key].split()[0]) * 1024 for key in ("VmHWM", "RssAnon")}

torch.set_num_threads(1)
model_dir = Path(sys.argv[1])
config = DecoderConfig.from_dict(json.loads((model_dir / "llm_engine" / "config.json").read_text()))
before = memory()
decoder = Decoder.from_state_dict(config, load_llm_weights(model_dir, "cpu"))
with torch.inference_mode():
    decoder(decoder.embed(torch.arange(4))[None])  # every layer's weights are read
after = memory()
print(json.dumps({"peak": after["VmHWM"] - before["VmHWM"], "anon": after["RssAnon"] - before["RssAnon"]}))
"""


def test_loading_engine_weights_on_cpu_copies_nothing(tmp_path, tiny_gpt_weights):
    """~580 MB of float32 weights: after a forward pass has read all of them, the process holds them once (as the
    file's pages), and no anonymous copy."""
    from exporter.llm.config import DecoderConfig
    from support.decoders import BIG_CONFIG

    weights = tiny_gpt_weights(BIG_CONFIG, vocab=8192)
    weights = {k: v for k, v in weights.items() if "mm_projector" not in k}
    config = DecoderConfig.from_nemo({**BIG_CONFIG, "share_embeddings_and_output_weights": False,
                                          "position_embedding_type": "rope"}, vocab_size=8192)
    (tmp_path / "llm_engine").mkdir()
    (tmp_path / "llm_engine" / "config.json").write_text(json.dumps(config.to_dict()))
    size = sum(t.numel() * t.element_size() for t in weights.values())
    write_tensors(tmp_path / LLM_WEIGHTS, weights)
    done = subprocess.run([sys.executable, "-c", LOAD_CHILD, str(tmp_path)], capture_output=True, text=True,
                          check=False, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0, done.stderr
    grown = json.loads(done.stdout.strip().splitlines()[-1])
    assert size >= 500 * MB
    assert grown["anon"] < 0.2 * size + 100 * MB, f"anonymous memory grew {grown['anon'] / MB:.0f} MB"
    assert grown["peak"] < 1.2 * size + 150 * MB, f"peak grew {grown['peak'] / MB:.0f} MB for {size / MB:.0f} MB"


# --- the kernel cache ------------------------------------------------------------------------------------------------

@pytest.fixture
def fresh_choices(monkeypatch):
    """An empty gemv choice table and autotune caches, and a fake timer that counts what it times."""
    monkeypatch.setattr(gemv, "_CHOICES", {})
    monkeypatch.setattr(gemv, "_KNOWN", {})
    for kernel in gemv.TUNED.values():
        monkeypatch.setattr(kernel, "cache", {})
    timed: list[str] = []

    def fake_measure(run):
        timed.append(run.__name__)
        return {"cublas": 2.0, "triton": 1.0}[run.__name__]

    monkeypatch.setattr(gemv, "measure_ms", fake_measure)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # a CPU build cannot ask
    return timed


def candidates(ran: list[str]) -> dict:
    def cublas():
        ran.append("cublas")

    def triton():
        ran.append("triton")

    return {"cublas": cublas, "triton": triton}


def restart(monkeypatch) -> None:
    """What a new process starts from: nothing chosen, nothing remembered, empty autotune caches, no paged-attention
    call timed."""
    monkeypatch.setattr(gemv, "_CHOICES", {})
    monkeypatch.setattr(gemv, "_KNOWN", {})
    monkeypatch.setattr(paged_triton, "_tuned", set())
    for kernel in gemv.TUNED.values():
        monkeypatch.setattr(kernel, "cache", {})


KEY = (4096, 11008, torch.bfloat16)


def test_a_kernel_cache_hit_times_nothing(tmp_path, fresh_choices, monkeypatch):
    ran: list[str] = []
    gemv.fastest(KEY, candidates(ran), "cublas")
    assert fresh_choices == ["cublas", "triton"] and ran == ["triton"]
    tuned = gemv.TUNED.get("gemv")
    if tuned is not None:  # with Triton: one autotune result to keep, as the kernel's own cache holds it
        tuned.cache[(4096, 11008, "torch.bfloat16", "torch.bfloat16")] = tuned.configs[3]
    assert KernelCache(tmp_path, IDENTITY).save()

    restart(monkeypatch)
    fresh_choices.clear()
    restored = KernelCache(tmp_path, IDENTITY).restore()
    assert restored.reason == "hit" and restored.choices == 1
    gemv.fastest(KEY, candidates(ran), "cublas")
    assert fresh_choices == [] and ran[-1] == "triton"
    if tuned is not None:
        assert restored.autotuned == 1
        assert gemv.TUNED["gemv"].cache == {(4096, 11008, "torch.bfloat16", "torch.bfloat16"): tuned.configs[3]}


@pytest.mark.skipif(not paged_triton.available(), reason="needs Triton")
def test_every_autotuned_kernel_times_its_candidates_briefly():
    """Triton's default timing (25 ms of warm-up and 100 ms of runs a candidate) took 14.3 s of a first start's
    warm-up on the H100: the attention, matrix-vector and expert kernels time with the short benchmark (the
    quantized ones with their graph timing, `gemv.measure_ms`)."""
    pytest.importorskip("triton")
    from exporter.llm import moe_triton  # noqa: F401 (importing registers its kernel)
    from exporter.llm.quant import kernels  # noqa: F401

    assert {"gemv", "paged_decode", "paged_decode_fp8", "paged_decode_mha_fp8", "paged_chunk",
            "moe_grouped"} <= set(gemv.TUNED)
    for name, kernel in gemv.TUNED.items():
        if not name.startswith("quant"):
            assert kernel.do_bench is gemv.time_candidate, name
    assert gemv.TUNE_WARMUP_MS + gemv.TUNE_REP_MS <= 30


def test_a_restart_times_no_paged_attention_call_the_first_start_timed(tmp_path, fresh_choices, monkeypatch):
    """The paged kernels' configurations timed on representative work (`_tune_first`) are kept with the kinds of
    call they were timed for: a restart takes them and times only a kind of call it has not met."""
    restart(monkeypatch)
    monkeypatch.setattr(paged_triton, "_INTERPRETED", False)  # the parent pytest; the interpreter never times
    timed: list[str] = []

    def representative(name: str) -> Callable[[], None]:
        def run() -> None:
            timed.append(name)
            paged_triton._decode_tuned.cache[(8, 1, 128, 32, 1, False, 128)] = paged_triton._decode_tuned.configs[1]
        return run

    kind = ("decode", 8, torch.Size([32, 128]), torch.bfloat16)
    paged_triton._tune_first(kind, 4096, representative("first start"))
    assert KernelCache(tmp_path, IDENTITY).save()
    saved = json.loads((KernelCache(tmp_path, IDENTITY).folder / CHOICES_FILE).read_text())
    assert saved["tuned_kinds"] == [repr(kind)] and saved["autotune"]["paged_decode"]

    restart(monkeypatch)
    restored = KernelCache(tmp_path, IDENTITY).restore()
    assert restored.reason == "hit"
    paged_triton._tune_first(kind, 4096, representative("restart"))
    paged_triton._tune_first(("chunk", torch.Size([32, 128])), 4096, representative("a new kind"))
    assert timed == ["first start", "a new kind"]
    assert paged_triton._decode_tuned.cache[(8, 1, 128, 32, 1, False, 128)] == paged_triton._decode_tuned.configs[1]


@pytest.mark.parametrize("change", ["gpu", "torch", "triton", "package"])
def test_another_gpu_or_version_measures_again(tmp_path, fresh_choices, monkeypatch, change):
    gemv.fastest(KEY, candidates([]), "cublas")
    KernelCache(tmp_path, IDENTITY).save()
    restart(monkeypatch)
    fresh_choices.clear()
    other = KernelCache(tmp_path, {**IDENTITY, change: "something else"})
    assert other.folder != KernelCache(tmp_path, IDENTITY).folder
    assert other.restore().reason == "missing"
    gemv.fastest(KEY, candidates([]), "cublas")
    assert fresh_choices == ["cublas", "triton"]
    assert other.save()
    assert json.loads((other.folder / CHOICES_FILE).read_text())["identity"][change] == "something else"


@pytest.mark.parametrize("content,reason", [
    (b"{not json", "corrupt"), (b"\xff\xfe\x00", "corrupt"), (b"[]", "corrupt"),
    (json.dumps({"format": 99, "identity": IDENTITY, "choices": {}, "autotune": {}}).encode(), "corrupt"),
    (json.dumps({"format": 1, "identity": IDENTITY, "choices": [], "autotune": {}}).encode(), "corrupt"),
    (json.dumps({"format": 1, "identity": {**IDENTITY, "gpu": "Other"}, "choices": {}, "autotune": {}}).encode(),
     "other identity"),
])
def test_a_corrupt_or_foreign_cache_file_falls_back_to_timing_and_is_rewritten(tmp_path, fresh_choices, content,
                                                                                reason):
    cache = KernelCache(tmp_path, IDENTITY)
    cache.folder.mkdir(parents=True)
    (cache.folder / CHOICES_FILE).write_bytes(content)
    assert cache.restore().reason == reason
    gemv.fastest(KEY, candidates([]), "cublas")
    assert fresh_choices == ["cublas", "triton"]
    assert cache.save()
    assert KernelCache(tmp_path, IDENTITY).restore().reason == "hit"


def test_stale_entries_are_ignored_one_by_one(tmp_path, fresh_choices):
    """A candidate name that no longer exists is timed again; an autotune config the kernel no longer has, or a
    malformed entry, is skipped; the good entries still count."""
    good_key, stale_key = "4096 4096 torch.bfloat16", gemv.key_text(KEY)
    tuned = gemv.TUNED.get("gemv")
    configs = [] if tuned is None else [[[64, 64, "torch.bfloat16", "torch.bfloat16"], str(tuned.configs[0])],
                                        [[1, 2], "BLOCK_N: 3, no such config"], "not an entry"]
    cache = KernelCache(tmp_path, IDENTITY)
    cache.folder.mkdir(parents=True)
    (cache.folder / CHOICES_FILE).write_text(json.dumps({
        "format": 1, "identity": IDENTITY, "choices": {good_key: "triton", stale_key: "retired_kernel"},
        "autotune": {"gemv": configs, "no_such_kernel": [[[1], "x"]]}}))
    restored = cache.restore()
    assert restored.reason == "hit" and restored.autotuned == (0 if tuned is None else 1)
    gemv.fastest((4096, 4096, torch.bfloat16), candidates([]), "cublas")
    assert fresh_choices == []
    gemv.fastest(KEY, candidates([]), "cublas")
    assert fresh_choices == ["cublas", "triton"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_engine_keeps_nothing_and_still_loads(tmp_path, fresh_choices):
    tmp_path.chmod(0o555)
    try:
        cache = KernelCache(tmp_path, IDENTITY)
        assert cache.restore().reason == "missing"
        assert not cache.save() and cache.use_compile_dirs() == {}
    finally:
        tmp_path.chmod(0o755)


def test_every_module_registering_an_autotuned_kernel_is_imported_with_the_kernel_cache():
    """The exporter restores the kernel cache before the engine loads: each kernel whose saved configs it seeds
    (`gemv.TUNED`, filled as the kernels' modules are imported) is registered by then (a fresh interpreter)."""
    package = Path(gemv.__file__).resolve().parents[1]
    registering = sorted(".".join(path.relative_to(package.parent).with_suffix("").parts)
                         for path in package.rglob("*.py") if "register_tuned(" in path.read_text())
    assert "exporter.llm.gemv" in registering and "exporter.llm.moe_triton" in registering
    imported = subprocess.run([sys.executable, "-c", "import json, sys, exporter.engine.kernel_cache; "
                               "print(json.dumps(sorted(sys.modules)))"],
                              cwd=package.parent, capture_output=True, text=True, timeout=300)
    assert imported.returncode == 0, imported.stderr[-3000:]
    assert set(registering) <= set(json.loads(imported.stdout)), registering


def test_the_compile_cache_goes_into_the_cache_folder_unless_the_user_chose(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    cache = KernelCache(tmp_path, IDENTITY)
    assert cache.use_compile_dirs() == {"TRITON_CACHE_DIR": str(cache.folder / "triton")}
    assert (cache.folder / "triton").is_dir()
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    assert KernelCache(tmp_path / "other", IDENTITY).use_compile_dirs() == {}
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "mine")


def test_triton_kernels_are_kept_in_the_cache_folder_between_starts(tmp_path):
    """Two fresh processes compile the same Triton kernel (for the H100, no GPU needed) with the cache folder's
    compile dir: the second takes it from the cache, and the summary for the warm-up's phase line says so."""
    pytest.importorskip("triton")
    code = ("import json; from pathlib import Path; "
            "from exporter.engine.kernel_cache import KernelCache, compile_summary; "
            "print(json.dumps(compile_summary())); "
            f"KernelCache(Path({str(tmp_path)!r}), {IDENTITY!r}).use_compile_dirs(); "
            "from triton.backends.compiler import GPUTarget; from triton.compiler import ASTSource, compile; "
            "from exporter.llm.fused_triton import _fused_activate_kernel as kernel; "
            "compile(ASTSource(fn=kernel, signature={'h_ptr': '*bf16', 'out_ptr': '*bf16', 'F': 'i32', "
            "'h_stride': 'i32', 'ACTIVATION': 'constexpr', 'GATED': 'constexpr', 'BLOCK': 'constexpr', "
            "'PDL': 'constexpr'}, constexprs={'ACTIVATION': 0, 'GATED': True, 'BLOCK': 1024, 'PDL': False}), target=GPUTarget('cuda', 90, 32)); "
            "print(json.dumps(compile_summary()))")
    environment = {key: value for key, value in os.environ.items() if key != "TRITON_CACHE_DIR"}
    summaries = []
    for _ in range(2):
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                                env={**environment, "PYTHONPATH": os.pathsep.join(sys.path)})
        assert result.returncode == 0, result.stderr[-2000:]
        summaries.append([json.loads(line) for line in result.stdout.strip().splitlines()[-2:]])
    assert summaries[0][0] == summaries[1][0] == ""  # nothing compiled yet: nothing to say
    assert re.fullmatch(r"Triton: 1 kernels in [0-9.]+ s, 0 from the compile cache, 0 in parallel batches "
                        r"\(0.00 s wall\)", summaries[0][1])
    assert re.fullmatch(r"Triton: 1 kernels in [0-9.]+ s, 1 from the compile cache, 0 in parallel batches "
                        r"\(0.00 s wall\)", summaries[1][1])
    assert any((KernelCache(tmp_path, IDENTITY).folder / "triton").iterdir())


def test_the_compile_counter_listens_once_chains_the_listener_before_it_and_skips_a_triton_without_the_hook(
        monkeypatch):
    from types import SimpleNamespace

    from exporter.engine import kernel_cache

    calls = []
    compilation = SimpleNamespace(listener=lambda **kwargs: calls.append(kwargs["cache_hit"]))
    monkeypatch.setattr(gemv, "triton", SimpleNamespace(knobs=SimpleNamespace(compilation=compilation)))
    counter = kernel_cache._TritonCompiles()
    counter.listen()
    counter.listen()  # again: no change (chaining itself would recurse)
    assert compilation.listener is counter
    counter(src=None, metadata=None, metadata_group=None, times=SimpleNamespace(total=2_000_000), cache_hit=True)
    assert (counter.kernels, counter.cached, counter.seconds, calls) == (1, 1, 2.0, [True])
    for triton in (None, SimpleNamespace(), SimpleNamespace(knobs=SimpleNamespace())):  # no Triton, no hook
        monkeypatch.setattr(gemv, "triton", triton)
        kernel_cache._TritonCompiles().listen()


# --- the engine directory --------------------------------------------------------------------------------------------

def export(model_dir: Path, nemo: Path) -> None:
    TensorRTMMExporter(model_dir, load_model=False, device="cpu").export(nemo, model_type="neva", dtype="float32",
                                                                          load_model=False, **LIMITS)


def test_the_cache_folder_is_no_part_of_the_engine(vlm, tmp_path, caplog):
    """Kernel cache files beside an engine: hash checks pass, an export over it keeps them, a folder holding only
    a cache takes an export; and export and load log each phase with its time."""
    engine = tmp_path / "engine"
    stale = engine / ".cache" / "kernels-0123456789abcdef" / CHOICES_FILE
    stale.parent.mkdir(parents=True)
    stale.write_text("{}")  # only a cache: the folder counts as empty
    with caplog.at_level(logging.INFO):
        export(engine, vlm.nemo)
    manifest = json.loads((engine / "manifest.json").read_text())
    assert not any(name.startswith(".cache") for name in manifest["files"])
    with caplog.at_level(logging.INFO):
        exporter = TensorRTMMExporter(engine, device="cpu", verify_engine=True)
    assert exporter.forward("describe the image", random_image(1), max_output_len=2)
    export(engine, vlm.nemo)  # over the engine and its cache
    assert stale.read_text() == "{}"
    shutil.copytree(engine, tmp_path / "copy")  # copied: no marker match, hashed on the first load
    assert TensorRTMMExporter(tmp_path / "copy", device="cpu").engine is not None
    logged = "\n".join(record.getMessage() for record in caplog.records)
    for phase in ("read the checkpoint", "perception", "write the LLM weights", "hash the other engine files",
                  "check the engine files", "LLM weights: read + transfer", "load the engine",
                  "warm-up: compile, choose kernels, capture graphs"):
        assert f"phase {phase}: " in logged, phase


def test_export_streams_the_llm_weights_in_the_checkpoint_order(vlm, tmp_path, caplog):
    """A plain `.nemo`'s LLM weights go straight from the checkpoint into the engine file, in its stored order; a
    gzip `.nemo` (no seeking into it) takes the read-whole path: both engines hold the same tensors, each file's
    hash is the manifest's."""
    gzipped = tmp_path / "vlm.nemo"
    with gzip.open(gzipped, "wb", compresslevel=1) as out:
        out.write(vlm.nemo.read_bytes())
    engines = {}
    for name, nemo in (("streamed", vlm.nemo), ("whole", gzipped)):
        caplog.clear()
        with caplog.at_level(logging.INFO):
            export(tmp_path / name, nemo)
        written = next(r.getMessage() for r in caplog.records if "phase write the LLM weights" in r.getMessage())
        assert ("read from the checkpoint as written" in written) == (name == "streamed"), written
        path = tmp_path / name / LLM_WEIGHTS
        manifest = json.loads((tmp_path / name / "manifest.json").read_text())
        assert manifest["files"][LLM_WEIGHTS]["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
        engines[name] = load_file(path)
        with open(path, "rb") as stream:
            engines[name + " order"] = [e.name for e in read_header(stream, path.stat().st_size)[1]]
    with NemoCheckpoint(vlm.nemo) as checkpoint:
        stored = list(checkpoint.tensor_stream(select=lambda n: n in engines["whole"]).metas)
    assert engines["streamed order"] == stored != sorted(stored)
    assert engines["whole order"] == sorted(stored)
    assert engines["streamed"].keys() == engines["whole"].keys()
    assert all(torch.equal(engines["streamed"][k], engines["whole"][k]) for k in engines["whole"])


SPAN = re.compile(r"phase (.+?): [0-9.]+ s \(from ([0-9.]+) to ([0-9.]+) s of the export")


def test_export_writes_the_llm_weights_while_the_perception_is_built(vlm, tmp_path, caplog, monkeypatch):
    """The perception (made 3 s slower here) is built on its own thread while the main thread streams the LLM
    weights: the write begins long before the perception ends, as the phase lines' spans in the export show."""
    kind = get_model_type("neva")
    build = kind.build_perception

    def slow_build(*args, **kwargs):
        time.sleep(3.0)
        return build(*args, **kwargs)

    monkeypatch.setattr(kind, "build_perception", slow_build)
    with caplog.at_level(logging.INFO):
        export(tmp_path / "engine", vlm.nemo)
    spans = {match[1]: (float(match[2]), float(match[3]))
             for match in map(SPAN.search, (r.getMessage() for r in caplog.records)) if match}
    perception, written = spans["perception"], spans["write the LLM weights"]
    assert perception[1] - perception[0] >= 3.0
    assert written[0] < perception[1] - 2.0, spans  # began within a second of the perception's start
    assert spans["read the checkpoint"][0] == 0.0


def test_export_imports_no_torch_dynamo(vlm, tmp_path):
    """Building the decoder and the vision tower on the meta device initialises nothing: an initialiser run on
    meta tensors imports torch._dynamo (seconds on a cold start, under the import lock both threads wait on)."""
    code = ("import sys; from pathlib import Path; from exporter import TensorRTMMExporter; "
            f"TensorRTMMExporter(Path({str(tmp_path / 'engine')!r}), load_model=False, device='cpu').export("
            f"Path({str(vlm.nemo)!r}), model_type='neva', dtype='float32', load_model=False, **{LIMITS!r}); "
            "print('torch._dynamo' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "False"
    assert (tmp_path / "engine" / LLM_WEIGHTS).is_file()


def test_a_server_start_imports_no_torch_dynamo(vlm, tmp_path):
    """Loading an engine (its warm-up included) and answering a request, in a fresh process (on the GPU where there
    is one: the decoder's fused kernels are Triton's own, no torch.compile), import no torch._dynamo."""
    export(tmp_path / "engine", vlm.nemo)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    code = ("import sys; from pathlib import Path; from exporter import TensorRTMMExporter; "
            "from support.media import random_image; "
            f"exporter = TensorRTMMExporter(Path({str(tmp_path / 'engine')!r}), device={device!r}); "
            "answer = exporter.forward('describe the image', random_image(1), max_output_len=2); exporter.close(); "
            "print(bool(answer), 'torch._dynamo' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "True False"


class _Initialised(torch.nn.Module):
    """A CPU parameter (zeros) that ``nn.init`` then fills: zeros left where the initialisers were skipped."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1000, device="cpu"))
        torch.nn.init.normal_(self.weight)
        torch.nn.init.kaiming_uniform_(self.weight[None])


def test_on_meta_builds_without_initialisers_on_its_own_thread_only():
    """Inside `on_meta` modules hold meta tensors and no initialiser runs; another thread meanwhile builds and
    initialises as usual (torch's function modes are per thread)."""
    elsewhere, inside = {}, threading.Event()

    def build_elsewhere():
        inside.wait()
        elsewhere["module"], elsewhere["embedding"] = _Initialised(), torch.nn.Embedding(1000, 8)

    thread = threading.Thread(target=build_elsewhere)
    thread.start()
    with on_meta():
        inside.set()
        thread.join()
        skipped = _Initialised()
        built = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    assert all(p.device.type == "meta" for p in built.parameters())
    assert not skipped.weight.detach().any()
    assert elsewhere["module"].weight.detach().abs().sum() > 0
    assert elsewhere["embedding"].weight.device.type == "cpu"
    assert 0.9 < float(elsewhere["embedding"].weight.detach().std()) < 1.1


def test_progress_is_logged_in_quarters_off_a_terminal(caplog):
    with caplog.at_level(logging.INFO), byte_progress("loading the LLM weights", 8 << 30) as advance:
        for _ in range(16):
            advance(512 << 20)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [f"loading the LLM weights: {p}% of 8.59 GB" for p in (25, 50, 75)]


@pytest.mark.parametrize("tower_type", ["clip", "siglip"])
def test_export_builds_the_tower_without_transformers_and_with_its_defaults(tmp_path, tower_type):
    """A tower folder's config.json that leaves defaults out: the engine's spec holds the values transformers' own
    config class gives them, and building the tower imports no transformers."""
    from omegaconf import OmegaConf

    from support.vision_towers import model_config, projector_state, tiny_tower

    reference = tiny_tower(tower_type)
    reference.save_pretrained(tmp_path / "tower")
    written = tmp_path / "tower" / "config.json"
    minimal = {key: value for key, value in json.loads(written.read_text()).items()
               if key not in ("hidden_act", "layer_norm_eps", "num_channels")}  # as older writers leave them
    written.write_text(json.dumps(minimal))
    OmegaConf.save(model_config("linear", model_type=tower_type, num_attention_heads=None), tmp_path / "cfg.yaml")
    torch.save(projector_state("linear"), tmp_path / "state.pt")
    code = ("import json, sys, torch; from omegaconf import OmegaConf; "
            "from exporter.perception.vision_encoder import build_vision_encoder; "
            f"folder = {str(tmp_path)!r}; "
            "encoder = build_vision_encoder(OmegaConf.load(folder + '/cfg.yaml'), torch.load(folder + '/state.pt'), "
            "vision_tower_path=folder + '/tower'); "
            "print(json.dumps([encoder.spec()['tower']['config'], 'transformers' in sys.modules]))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert result.returncode == 0, result.stderr[-2000:]
    config, imported = json.loads(result.stdout.strip().splitlines()[-1])
    assert not imported
    expected = reference.config
    for field in ("hidden_size", "intermediate_size", "num_attention_heads", "num_channels", "image_size",
                  "patch_size", "hidden_act", "layer_norm_eps"):
        assert config[field] == getattr(expected, field), field
    assert config["num_hidden_layers"] == expected.num_hidden_layers - 1  # trimmed to the feature layer (-2)
