"""LoRA adapters served per request on a tiny Neva, against transformers with each adapter merged independently.

Two NeMo PEFT adapters (`support.lora`): "a" (rank 4, alpha 8: scale 2, one file) and "b" (rank 2, alpha given as
the example configs' interpolation, saved TP=2-sharded with fc1's adapter `[gate_r; up_r]` per rank), on all four
targets. Answers with a, b and none share one batch and equal, token for token in float32, transformers' Llama
with that adapter merged by the fixture's own code. Also: reading and naming adapters, the merged export, errors,
the engine directory alone, loading and unloading while serving, beams, streaming, a quantized base.
"""

from __future__ import annotations

import concurrent.futures
import json
import shutil
import sys
import tarfile
import time
from pathlib import Path

import pytest
import torch

from exporter import TensorRTMMExporter
from exporter.engine import EngineError
from exporter.llm.generate import SamplingParams
from exporter.llm.lora_layers import LoraBank
from exporter.lora import LoraError, adapter_sources, read_adapter
from exporter.runtime import Request
from support.lora import ADAPTERS, nemo_config, with_adapter, write_adapter
from support.media import random_image
from support.neva_reference import answer_ids, prompt_embeddings, reference_features, reference_tokens
from support.tokenizer_files import tokenizer_file
from support.vlm import PROMPTS, build_vlm

STEPS = 8
QUESTION = "describe the image"
LIMITS = {"max_batch_size": 4, "max_input_len": 256, "max_output_len": 16, "max_multimodal_len": 4 * 16,
          "max_beam_width": 2}
NEMO_TO_MODULE = dict(zip(ADAPTERS, ("attn_qkv", "attn_dense", "mlp_h_to_4h", "mlp_4h_to_h")))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The tiny Neva, its adapters "a" and "b" (and a third, "c", for loading while serving), and an engine
    exported with a and b."""
    root = tmp_path_factory.mktemp("lora")
    vlm = build_vlm(root / "vlm", tokenizer_file(root))
    config = nemo_config(vlm)
    adapters = {
        "a": write_adapter(root / "adapter_a", config, seed=11, rank=4, alpha=8.0),
        "b": write_adapter(root / "adapter_b", config, seed=12, rank=2, tp_size=2,
                           alpha="${model.peft.lora_tuning.adapter_dim}"),
        "c": write_adapter(root / "adapter_c", config, seed=13, rank=4, alpha=2.0,
                           adapters=tuple(ADAPTERS)[:2]),
    }
    exporter = TensorRTMMExporter(root / "engine", device="cpu")
    exporter.export(vlm.nemo, model_type="neva", dtype="float32", **LIMITS,
                    lora_checkpoint_path=[f"a:{adapters['a'].path}", f"b:{adapters['b'].path}"])
    yield vlm, adapters, exporter, root
    exporter.pipeline.close()


def _reference(vlm, adapter, image, steps=STEPS) -> list[int]:
    return reference_tokens(with_adapter(vlm, adapter), QUESTION, image, steps)


def _ids(exporter, uids, images, steps=STEPS, **params) -> list:
    """Token ids of one request per (uid, image), all submitted together; an exception where one failed."""
    requests = [Request(QUESTION, image, SamplingParams(max_output_len=steps, **params), lora_uid=uid)
                for uid, image in zip(uids, images)]
    return [r if isinstance(r, Exception) else r.token_ids
            for r in exporter.generate(requests)]


# --- reading NeMo's adapter checkpoints --------------------------------------------------------------------------


def test_adapters_read_as_nemo_writes_them(setup, tmp_path):
    """Keys, rank, alpha and the TP=2 shards (fc1's [gate_r; up_r] per rank) come back as the adapter was made;
    a .nemo tar of the folder reads the same."""
    _, adapters, _, _ = setup
    for uid, made in adapters.items():
        read = read_adapter(made.path, uid)
        assert (read.uid, read.rank, read.scale) == (uid, made.rank, made.scale)
        assert set(read.weights) == {(int(p.split(".")[2]), NEMO_TO_MODULE[p.split(".", 3)[3]]) for p in made.pairs}
        for prefix, (a, b) in made.pairs.items():
            got_a, got_b = read.weights[int(prefix.split(".")[2]), NEMO_TO_MODULE[prefix.split(".", 3)[3]]]
            assert torch.equal(got_a, a) and torch.equal(got_b, b), prefix
    archive = tmp_path / "b.nemo"
    with tarfile.open(archive, "w") as tar:
        tar.add(adapters["b"].path, arcname=".")
    from_tar = read_adapter(archive)
    assert from_tar.uid == "b" and all(torch.equal(x, y) for key in from_tar.weights for x, y in
                                       zip(from_tar.weights[key], read_adapter(adapters["b"].path).weights[key]))


def test_lora_checkpoint_path_names_adapters(setup, tmp_path):
    """One adapter (uid = its name), a folder of adapters, uid:path entries, lists and comma-separated strings."""
    _, adapters, _, _ = setup
    a, b = adapters["a"].path, adapters["b"].path
    assert adapter_sources(a) == {"adapter_a": a}
    folder = tmp_path / "many"
    folder.mkdir()
    shutil.copytree(a, folder / "task1")
    (folder / "notes.txt").write_text("not an adapter")
    assert adapter_sources(folder) == {"task1": folder / "task1"}
    assert adapter_sources(f"x:{a},y:{b}") == {"x": a, "y": b}
    assert adapter_sources([f"x:{a}", str(b)]) == {"x": a, "adapter_b": b}
    with pytest.raises(LoraError, match="names LoRA uid 'x' twice"):
        adapter_sources([f"x:{a}", f"x:{b}"])
    with pytest.raises(LoraError, match="not valid"):
        adapter_sources(f"-1:{a}")
    with pytest.raises(LoraError, match="does not exist"):
        adapter_sources(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(LoraError, match="neither a LoRA checkpoint"):
        adapter_sources(tmp_path / "empty")


def test_adapter_checkpoints_that_cannot_be_served_are_refused(setup, tmp_path):
    vlm, _, _, _ = setup
    config = nemo_config(vlm)
    sharded = write_adapter(tmp_path / "no_activation", {k: v for k, v in config.items() if k != "activation"},
                            seed=3, rank=2, alpha=None, tp_size=2)
    with pytest.raises(LoraError, match="no `activation`"):
        read_adapter(sharded.path)
    with pytest.raises(LoraError, match="model.nemo holds no NeMo LoRA adapter weights"):
        read_adapter(vlm.nemo, "base")


# --- serving -----------------------------------------------------------------------------------------------------


def test_adapters_a_b_and_none_in_one_batch_match_transformers(setup):
    """Rows with different adapters and a row with none share one prefill and every decode step; each answers as
    transformers with its own adapter merged (the three answers differ, so the test can fail)."""
    vlm, adapters, exporter, _ = setup
    image = random_image(3)
    expected = [_reference(vlm, adapters["a"], image), _reference(vlm, adapters["b"], image),
                _reference(vlm, None, image)]
    assert len({tuple(ids) for ids in expected}) == 3
    got = _ids(exporter, ["a", "b", None], [image] * 3)
    assert [beams[0] for beams in got] == expected
    tokenizer = exporter.engine.tokenizer
    answers = exporter.forward([QUESTION] * 3, [image] * 3, max_output_len=STEPS, lora_uids=["a", "b", "-1"])
    assert answers == [[tokenizer.decode(ids).strip()] for ids in expected]
    assert exporter.forward(QUESTION, image, max_output_len=STEPS, lora_uids=["b"]) == [answers[1]]


def test_requests_join_a_running_batch_with_their_own_adapters(setup):
    """In flight: a request for b joins while a's and none's are decoding; everyone keeps its adapter."""
    vlm, adapters, exporter, _ = setup
    images = [random_image(4), random_image(5), random_image(6)]
    steps = LIMITS["max_output_len"]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        early = pool.submit(_ids, exporter, ["a", None], images[:2], steps)
        deadline = time.monotonic() + 60
        while exporter.pipeline.scheduler.stats().running_rows < 2 and not early.done():
            assert time.monotonic() < deadline
            time.sleep(0.001)
        late = _ids(exporter, ["b"], images[2:], steps)
        assert [beams[0] for beams in early.result(timeout=60)] == [
            _reference(vlm, adapters["a"], images[0], steps), _reference(vlm, None, images[1], steps)]
    assert late[0][0] == _reference(vlm, adapters["b"], images[2], steps)


def test_beam_search_and_streaming_with_an_adapter(setup):
    vlm, adapters, exporter, _ = setup
    image = random_image(7)
    llm = with_adapter(vlm, adapters["a"]).llm
    text, add_bos = PROMPTS[vlm.template]
    before, after = text.format(q=QUESTION).split("<image>")
    with torch.no_grad():
        embeddings = prompt_embeddings(llm, vlm.sp_path, [before, reference_features(vlm, image), after], add_bos)
        expected = answer_ids(llm, embeddings, STEPS, eos_id=2, num_beams=2)
    (beams,) = _ids(exporter, ["a"], [image], num_beams=2)
    assert beams == expected
    pieces = list(exporter.stream(Request(QUESTION, image, SamplingParams(max_output_len=STEPS), lora_uid="b")))
    assert "".join(pieces) == exporter.forward(QUESTION, image, max_output_len=STEPS, lora_uids=["b"])[0][0]


def test_an_unknown_uid_fails_alone(setup):
    vlm, adapters, exporter, _ = setup
    image = random_image(8)
    failed, served = _ids(exporter, ["zzz", "a"], [image, image])
    assert isinstance(failed, ValueError)
    assert str(failed) == "unknown LoRA adapter 'zzz'; served adapters: 'a', 'b'"
    assert served[0] == _reference(vlm, adapters["a"], image)
    with pytest.raises(ValueError, match="lora_uids holds 2 uids for 3 prompts"):
        exporter.forward([QUESTION] * 3, [image] * 3, lora_uids=["a", "b"])


def test_merged_export_equals_unmerged_serving(setup):
    """merge_lora=True folds the one adapter into the weights (no LoRA served): same answers as serving it."""
    vlm, adapters, exporter, root = setup
    merged = TensorRTMMExporter(root / "merged", device="cpu")
    merged.export(vlm.nemo, model_type="neva", dtype="float32", **LIMITS, lora_checkpoint_path=adapters["b"].path,
                  merge_lora=True)
    try:
        manifest = json.loads((root / "merged" / "manifest.json").read_text())
        assert manifest["lora"] is None and manifest["lora_merged"]["uid"] == "adapter_b"
        assert merged.lora_uids == []
        images = [random_image(9), random_image(10)]
        assert _ids(merged, [None, None], images) == _ids(exporter, ["b", "b"], images)
        with pytest.raises(LoraError, match="merge_lora=True merges one LoRA adapter"):
            merged.export(vlm.nemo, model_type="neva", **LIMITS, merge_lora=True,
                          lora_checkpoint_path=[str(adapters["a"].path), str(adapters["b"].path)])
    finally:
        merged.pipeline.close()


def test_rank_and_targets_are_checked_against_the_adapters(setup):
    vlm, adapters, _, root = setup
    exporter = TensorRTMMExporter(root / "refused", device="cpu")
    a = adapters["a"].path
    cases = [
        ({"max_lora_rank": 2}, "LoRA adapter 'adapter_a' has rank 4, over max_lora_rank=2; raise max_lora_rank to at "
                               "least 4"),
        ({"lora_target_modules": ["attn_qkv", "attn_dense"]}, "LoRA adapter 'adapter_a' adapts mlp_h_to_4h, "
                                                              "mlp_4h_to_h, not in lora_target_modules"),
        ({"lora_target_modules": ["attn_q", "attn_k", "attn_v"]}, "name separate q/k/v or gate projections"),
        ({"lora_target_modules": ["attention_qkv"]}, "lora_target_modules ['attention_qkv'] are not LoRA modules"),
    ]
    for options, message in cases:
        with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
            exporter.export(vlm.nemo, model_type="neva", dtype="float32", **LIMITS, lora_checkpoint_path=a,
                            **options)
    assert not (root / "refused" / "manifest.json").exists()


def test_the_engine_serves_its_adapters_alone_and_takes_more_at_load(setup):
    vlm, adapters, exporter, root = setup
    image = random_image(11)
    manifest = json.loads((root / "engine" / "manifest.json").read_text())
    assert sorted(manifest["lora"]["adapters"]) == ["a", "b"]
    assert {"llm_engine/lora/a/adapter.safetensors", "llm_engine/lora/b/adapter.json"} <= set(manifest["files"])
    again = TensorRTMMExporter(root / "engine", device="cpu", lora_checkpoint_path=f"c:{adapters['c'].path}")
    try:
        assert again.lora_uids == ["a", "b", "c"]
        assert [beams[0] for beams in _ids(again, ["c", "a"], [image, image])] == [
            _reference(vlm, adapters["c"], image), _reference(vlm, adapters["a"], image)]
    finally:
        again.pipeline.close()
    copy = root / "engine_copy"
    shutil.copytree(root / "engine", copy)
    stored = copy / "llm_engine" / "lora" / "a" / "adapter.safetensors"
    data = bytearray(stored.read_bytes())
    data[-1] ^= 1
    stored.write_bytes(bytes(data))
    with pytest.raises(EngineError, match="llm_engine/lora/a/adapter.safetensors is corrupt"):
        TensorRTMMExporter(copy, device="cpu", verify_engine=True)


def test_load_and_unload_adapters_while_serving(setup):
    """load_lora fills a free slot (max_loras); unload_lora stops new requests at once and frees the slot once
    no request uses it; the engine on disk is unchanged."""
    vlm, adapters, _, root = setup
    image = random_image(12)
    serving = TensorRTMMExporter(root / "engine", device="cpu", max_loras=3)
    try:
        bank = serving.engine.decoder.lora
        serving.load_lora("c", adapters["c"].path)
        assert serving.lora_uids == ["a", "b", "c"]
        assert _ids(serving, ["c"], [image])[0][0] == _reference(vlm, adapters["c"], image)
        with pytest.raises(ValueError, match="all 3 LoRA slots are in use"):
            serving.load_lora("d", adapters["a"].path)
        held = bank.acquire("b")  # a request still decoding with b
        serving.unload_lora("b")
        assert isinstance(_ids(serving, ["b"], [image])[0], ValueError)
        with pytest.raises(ValueError, match="all 3 LoRA slots are in use"):
            serving.load_lora("d", adapters["a"].path)
        bank.release(held)
        serving.load_lora("d", adapters["b"].path)
        assert _ids(serving, ["d"], [image])[0][0] == _reference(vlm, adapters["b"], image)
        with pytest.raises(ValueError, match="unknown LoRA adapter 'b'"):
            serving.unload_lora("b")
    finally:
        serving.pipeline.close()
    assert sorted(json.loads((root / "engine" / "manifest.json").read_text())["lora"]["adapters"]) == ["a", "b"]


def test_an_engine_without_lora_says_so(setup):
    vlm, _, _, root = setup
    plain = TensorRTMMExporter(root / "plain", device="cpu")
    plain.export(vlm.nemo, model_type="neva", dtype="float32", **LIMITS)
    try:
        image = random_image(13)
        failed = _ids(plain, ["a"], [image])[0]
        assert str(failed) == "LoRA adapter 'a' asked for, but this model serves no LoRA adapters"
        with pytest.raises(LoraError, match="this model serves no LoRA adapters"):
            plain.load_lora("a", "unused")
        assert plain.forward(QUESTION, image, max_output_len=STEPS, lora_uids=["-1"]) == plain.forward(
            QUESTION, image, max_output_len=STEPS)
    finally:
        plain.pipeline.close()


def test_a_quantized_base_serves_adapters_in_the_model_dtype(setup):
    """int8 weight-only base weights, float32 adapters: it runs, and adapter a changes the answer."""
    vlm, adapters, _, root = setup
    quantized = TensorRTMMExporter(root / "int8", device="cpu")
    quantized.export(vlm.nemo, model_type="neva", dtype="float32", **LIMITS, quantization="int8_wo",
                     lora_checkpoint_path=f"a:{adapters['a'].path}")
    try:
        bank = quantized.engine.decoder.lora
        assert isinstance(bank, LoraBank) and bank.slots[0, "attn_qkv"].a.dtype == torch.float32
        image = random_image(3)
        with_a, without = (beams[0] for beams in _ids(quantized, ["a", None], [image, image]))
        assert len(with_a) == STEPS and without != with_a
    finally:
        quantized.pipeline.close()


def test_deploy_script_checks_the_lora_flags():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    try:
        import deploy_triton
    finally:
        sys.path.pop(0)
    settings = deploy_triton.parse_settings(["-tmn", "m", "-mt", "neva", "-vc", "x.nemo", "-lcp", "a:/x,b:/y",
                                             "--merge_lora", "--max_loras", "3", "-ltm", "attn_qkv", "attn_dense"])
    assert (settings.merge_lora, settings.max_loras, settings.lora_target_modules) == (True, 3, ["attn_qkv",
                                                                                             "attn_dense"])
    assert deploy_triton._export_arguments(settings)["max_lora_rank"] == 64
    for argv, message in [(["-ltm", "attn_x"], "lora_target_modules \\['attn_x'\\] are not LoRA modules"),
                          (["-mlr", "0"], "max_lora_rank must be at least 1"),
                          (["--merge_lora"], "--merge_lora merges an adapter at export")]:
        with pytest.raises(ValueError, match=message):
            deploy_triton.parse_settings(["-tmn", "m", *argv])
