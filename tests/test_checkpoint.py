"""NemoCheckpoint reads every layout NeMo writes back to the canonical tensors and refuses unsafe archives."""

from __future__ import annotations

import io
import json
import pickle
import tarfile

import pytest
import torch
from omegaconf import OmegaConf

from exporter.checkpoint import NemoCheckpoint, NemoCheckpointError
from tools.nemo_writer import hf_llama_to_nemo, tar_directory, write_nemo

torch.set_num_threads(1)


@pytest.fixture
def tokenizer_file(tmp_path):
    path = tmp_path / "tokenizer.model"
    path.write_bytes(b"sentencepiece model bytes")
    return path


def assert_same_tensors(got: dict, expected: dict) -> None:
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def gelu_config(config: dict) -> dict:
    return dict(config, activation="gelu", normalization="layernorm")


ROUND_TRIPS = {
    "legacy": {},
    "legacy-tp2": {"tp_size": 2},
    "legacy-tp4": {"tp_size": 4},
    "legacy-pp2": {"pp_size": 2},
    "legacy-tp2-pp2": {"tp_size": 2, "pp_size": 2},
    "legacy-gzip": {"compress": True},
    "legacy-no-dot-prefix": {"dot_prefix": False},
    "legacy-gzip-tp2-no-dot": {"compress": True, "tp_size": 2, "dot_prefix": False},
    "local-norm-names-tp2": {"transformer_engine": False, "tp_size": 2},
    "non-mcore-names": {"mcore": False},
    "non-mcore-names-tp2-pp2": {"mcore": False, "tp_size": 2, "pp_size": 2},
    "amp-o2-prefix": {"prefix": "model.module."},
    "torch_dist": {"layout": "torch_dist"},
    "torch_dist-rank-chunks": {"layout": "torch_dist", "tp_size": 2, "pp_size": 2},
    "torch_dist-local-norms": {"layout": "torch_dist", "transformer_engine": False},
    "torch_dist-gzip": {"layout": "torch_dist", "compress": True},
    "nemo2": {"layout": "nemo2"},
    "nemo2-vlm-prefix": {"layout": "nemo2", "prefix": "module.language_model."},
}


@pytest.mark.parametrize("options", ROUND_TRIPS.values(), ids=ROUND_TRIPS.keys())
@pytest.mark.parametrize("activation", ["fast-swiglu", "gelu"])
def test_round_trip(tmp_path, tiny_gpt_config, tiny_gpt_weights, tokenizer_file, options, activation):
    config = tiny_gpt_config if activation == "fast-swiglu" else gelu_config(tiny_gpt_config)
    weights = tiny_gpt_weights(config)
    path = write_nemo(
        tmp_path / "m.nemo", config, weights, artifacts={"tokenizer.model": tokenizer_file}, **options
    )
    with NemoCheckpoint(path) as checkpoint:
        assert_same_tensors(checkpoint.state_dict(), weights)
        assert checkpoint.config.num_layers == 4 and checkpoint.config.activation == config["activation"]


@pytest.mark.parametrize("activation", ["swiglu", "geglu"])
def test_legacy_separate_up_half_is_joined(tmp_path, tiny_gpt_config, tiny_gpt_weights, activation):
    """Non-fast legacy GLUs store the up half in `dense_h_to_4h_2`; canonical fc1 is `[gate; up]`."""
    config = dict(tiny_gpt_config, activation=activation)
    weights = tiny_gpt_weights(config)
    path = write_nemo(tmp_path / "m.nemo", config, weights, mcore=False, tp_size=2)
    with tarfile.open(path) as tar:
        rank1 = torch.load(tar.extractfile("./mp_rank_01/model_weights.ckpt"), weights_only=False)
    gate, up = weights["decoder.layers.0.mlp.linear_fc1.weight"].chunk(2)
    layer = "model.language_model.encoder.layers.0.mlp."
    assert torch.equal(rank1[layer + "dense_h_to_4h.weight"], gate.chunk(2)[1])
    assert torch.equal(rank1[layer + "dense_h_to_4h_2.weight"], up.chunk(2)[1])
    assert_same_tensors(NemoCheckpoint(path).state_dict(), weights)


def test_a_tensor_stream_reads_the_state_dict_in_stored_order(tmp_path, tiny_gpt_config, tiny_gpt_weights):
    """A plain legacy `.nemo` and its folder stream (metadata first, then each tensor in the file's order); a gzip
    `.nemo`, TP shards and dist layouts do not (they are read whole)."""
    weights = tiny_gpt_weights(tiny_gpt_config)
    plain = write_nemo(tmp_path / "plain.nemo", tiny_gpt_config, weights)
    with tarfile.open(plain) as tar:
        tar.extractall(tmp_path / "folder", filter="data")
    for path in (plain, tmp_path / "folder"):
        with NemoCheckpoint(path) as checkpoint:
            stream = checkpoint.tensor_stream()
            names = list(stream.metas)
            assert all(meta.is_meta for meta in stream.metas.values())
            read = list(stream.read())
            assert [name for name, _ in read] == names and sorted(names) == sorted(weights)
            assert_same_tensors(dict(read), checkpoint.state_dict())
    assert names != sorted(names)  # the file's order, not the names'
    for name, options in (("gzip", {"compress": True}), ("tp", {"tp_size": 2}), ("dist", {"layout": "torch_dist"})):
        with NemoCheckpoint(write_nemo(tmp_path / f"{name}.nemo", tiny_gpt_config, weights, **options)) as other:
            assert other.tensor_stream() is None, name


def test_extracted_folder(tmp_path, tiny_gpt_config, tiny_gpt_weights, tokenizer_file):
    weights = tiny_gpt_weights(tiny_gpt_config)
    for layout in ("legacy", "torch_dist", "nemo2"):
        path = write_nemo(
            tmp_path / f"{layout}.nemo",
            tiny_gpt_config,
            weights,
            layout=layout,
            tp_size=2,
            artifacts={"tokenizer.model": tokenizer_file},
        )
        folder = tmp_path / layout
        with tarfile.open(path) as tar:
            tar.extractall(folder, filter="data")
        checkpoint = NemoCheckpoint(folder)
        assert_same_tensors(checkpoint.state_dict(), weights)
        assert checkpoint.artifact(checkpoint.config.tokenizer.model) == tokenizer_file.read_bytes()


def test_tp_shards_hold_nemo_slices(tmp_path, tiny_gpt_config, tiny_gpt_weights):
    """Rank files split like NeMo: QKV by whole query groups, fc1 as [gate_r; up_r], proj/fc2 on dim 1."""
    weights = tiny_gpt_weights(tiny_gpt_config)
    path = write_nemo(tmp_path / "m.nemo", tiny_gpt_config, weights, tp_size=2)
    with tarfile.open(path) as tar:
        rank1 = torch.load(tar.extractfile("./mp_rank_01/model_weights.ckpt"), weights_only=False)
    layer, stored = "decoder.layers.1.", "model.decoder.layers.1."
    qkv_groups = weights[layer + "self_attention.linear_qkv.weight"].view(
        4, 4, 4, 32
    )  # [groups, 2 q + k + v, d, H]
    assert torch.equal(rank1[stored + "self_attention.linear_qkv.weight"], qkv_groups[2:].reshape(-1, 32))
    gate, up = weights[layer + "mlp.linear_fc1.weight"].chunk(2)
    assert torch.equal(rank1[stored + "mlp.linear_fc1.weight"], torch.cat([gate[24:], up[24:]]))
    assert torch.equal(
        rank1[stored + "mlp.linear_fc2.weight"], weights[layer + "mlp.linear_fc2.weight"][:, 24:]
    )
    assert torch.equal(
        rank1[stored + "self_attention.linear_proj.bias"], weights[layer + "self_attention.linear_proj.bias"]
    )
    assert torch.equal(
        rank1[stored + "self_attention.linear_qkv.layer_norm_weight"],
        weights[layer + "input_layernorm.weight"],
    )
    assert torch.equal(
        rank1["model.embedding.word_embeddings.weight"], weights["embedding.word_embeddings.weight"][32:]
    )


def test_hand_built_tp_shards_merge(tmp_path):
    """Hand-made TP files (not the writer's) of HF-style q/k/v and gate/up merge to NeMo's global layout."""
    hidden, heads, groups, d, ffn = 8, 4, 2, 2, 6
    q, k, v = torch.randn(heads * d, hidden), torch.randn(groups * d, hidden), torch.randn(groups * d, hidden)
    gate, up = torch.randn(ffn, hidden), torch.randn(ffn, hidden)
    folder = tmp_path / "ckpt"
    for rank in range(2):
        qkv = torch.cat(
            [q[rank * 4 : (rank + 1) * 4], k[rank * 2 : (rank + 1) * 2], v[rank * 2 : (rank + 1) * 2]]
        )
        (folder / f"mp_rank_0{rank}").mkdir(parents=True)
        torch.save(
            {
                "model.decoder.layers.0.self_attention.linear_qkv.weight": qkv,
                "model.decoder.layers.0.mlp.linear_fc1.weight": torch.cat(
                    [gate[rank * 3 : (rank + 1) * 3], up[rank * 3 : (rank + 1) * 3]]
                ),
            },
            folder / f"mp_rank_0{rank}" / "model_weights.ckpt",
        )
    OmegaConf.save({"num_layers": 1, "activation": "fast-swiglu"}, folder / "model_config.yaml")
    merged = NemoCheckpoint(tar_directory(folder, tmp_path / "m.nemo")).state_dict()
    # one query group per rank: global rows are [q heads of group g, k_g, v_g] for g = 0, 1
    expected_qkv = torch.cat([q[:4], k[:2], v[:2], q[4:], k[2:], v[2:]])
    assert torch.equal(merged["decoder.layers.0.self_attention.linear_qkv.weight"], expected_qkv)
    assert torch.equal(merged["decoder.layers.0.mlp.linear_fc1.weight"], torch.cat([gate, up]))


def test_torch_dist_stores_stacked_chunked_layers(tmp_path, tiny_gpt_config, tiny_gpt_weights):
    weights = tiny_gpt_weights(tiny_gpt_config)
    path = write_nemo(
        tmp_path / "m.nemo", tiny_gpt_config, weights, layout="torch_dist", tp_size=2, pp_size=2
    )
    with tarfile.open(path) as tar:
        metadata = pickle.load(tar.extractfile("./model_weights/.metadata")).state_dict_metadata
        assert json.load(tar.extractfile("./model_weights/metadata.json"))["sharded_backend"] == "torch_dist"
    qkv = metadata["model.decoder.layers.self_attention.linear_qkv.weight"]
    assert list(qkv.size) == [4, 64, 32] and len(qkv.chunks) == 4
    assert len(metadata["model.decoder.layers.mlp.linear_fc1.weight"].chunks) == 8  # PP 2 x (gate, up) x TP 2
    assert any("_extra_state/shard_3_4" in key for key in metadata)
    loaded = NemoCheckpoint(path).state_dict()
    assert_same_tensors(loaded, weights)
    for tensor in loaded.values():  # unstacked layers own their memory (safetensors refuses shared storage)
        assert tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()


@pytest.mark.parametrize(
    "options", [{"tp_size": 2}, {"layout": "torch_dist", "tp_size": 2}], ids=["tp2", "dist"]
)
def test_loading_without_storage_offsets(tmp_path, tiny_gpt_config, tiny_gpt_weights, options, monkeypatch):
    """Older torch gives meta tensors no storage offsets: the reader then loads the stored tensors instead."""
    import exporter.checkpoint.streaming as streaming

    weights = tiny_gpt_weights(tiny_gpt_config)
    path = write_nemo(tmp_path / "m.nemo", tiny_gpt_config, weights, **options)
    monkeypatch.setattr(streaming, "stored_offset", lambda meta: None)
    assert_same_tensors(NemoCheckpoint(path).state_dict(), weights)


def test_ptl_style_dict_with_config_in_hyper_parameters(tmp_path, tiny_gpt_config, tiny_gpt_weights):
    weights = tiny_gpt_weights(tiny_gpt_config)
    folder = tmp_path / "ckpt"
    with tarfile.open(write_nemo(tmp_path / "m.nemo", tiny_gpt_config, weights)) as tar:
        tar.extractall(folder, filter="data")
    stored = torch.load(folder / "model_weights.ckpt", weights_only=False)
    torch.save(
        {"state_dict": stored, "hyper_parameters": {"cfg": OmegaConf.create(tiny_gpt_config)}},
        folder / "model_weights.ckpt",
    )
    (folder / "model_config.yaml").unlink()
    checkpoint = NemoCheckpoint(tar_directory(folder, tmp_path / "ptl.nemo"))
    assert checkpoint.config.hidden_size == 32
    assert_same_tensors(checkpoint.state_dict(), weights)


def test_rename_keys_apply_to_stored_names(tmp_path, tiny_gpt_config, tiny_gpt_weights):
    weights = tiny_gpt_weights(tiny_gpt_config)
    for layout in ("legacy", "torch_dist"):
        path = write_nemo(tmp_path / f"{layout}.nemo", tiny_gpt_config, weights, layout=layout, prefix="net.")
        assert "embedding.word_embeddings.weight" not in NemoCheckpoint(path).state_dict()
        renamed = NemoCheckpoint(path, rename_keys=["net.:model."])
        assert_same_tensors(renamed.state_dict(), weights)
    with pytest.raises(ValueError, match="old:new"):
        NemoCheckpoint(path, rename_keys=["no-colon"])


def test_nemo2_config_is_mapped_to_nemo1_names(tmp_path, tiny_gpt_config, tiny_gpt_weights, tokenizer_file):
    path = write_nemo(
        tmp_path / "m.nemo",
        tiny_gpt_config,
        tiny_gpt_weights(tiny_gpt_config),
        layout="nemo2",
        artifacts={"tokenizer.model": tokenizer_file},
    )
    checkpoint = NemoCheckpoint(path)
    with tarfile.open(path) as tar:
        model_yaml = OmegaConf.load(tar.extractfile("./context/model.yaml"))
    assert model_yaml.config.add_bias_linear is True and model_yaml.config.normalization == "RMSNorm"
    assert model_yaml.config.activation_func._target_ == "torch.nn.functional.silu"
    config = checkpoint.config
    assert (config.activation, config.normalization, config.bias) == ("fast-swiglu", "rmsnorm", True)
    assert (config.rotary_percentage, config.max_position_embeddings, config.num_query_groups) == (
        1.0,
        128,
        4,
    )
    assert config.tokenizer.library == "sentencepiece"
    assert checkpoint.artifact(config.tokenizer.model) == tokenizer_file.read_bytes()
    gelu = NemoCheckpoint(
        write_nemo(
            tmp_path / "g.nemo",
            gelu_config(tiny_gpt_config),
            tiny_gpt_weights(gelu_config(tiny_gpt_config)),
            layout="nemo2",
        )
    ).config
    assert (gelu.activation, gelu.normalization) == ("gelu", "layernorm")


def test_artifact_resolution(tmp_path, tiny_gpt_config, tiny_gpt_weights, tokenizer_file):
    vocab = tmp_path / "vocab.json"
    vocab.write_text("{}")
    path = write_nemo(
        tmp_path / "m.nemo",
        tiny_gpt_config,
        tiny_gpt_weights(tiny_gpt_config),
        artifacts={"tokenizer.model": tokenizer_file, "tokenizer.vocab_file": vocab},
    )
    assert tiny_gpt_config["tokenizer"]["model"] == "tokenizer.model"  # the caller's config is left alone
    checkpoint = NemoCheckpoint(path)
    reference = checkpoint.config.tokenizer.model
    assert (
        reference.startswith("nemo:")
        and reference.endswith("_tokenizer.model")
        and len(reference) == 5 + 33 + 15
    )
    expected = tokenizer_file.read_bytes()
    assert checkpoint.artifact(reference) == expected
    assert checkpoint.artifact("/artifacts/tokenizer.model") == expected
    assert checkpoint.artifact("tokenizer.model") == expected
    assert checkpoint.artifact(reference[len("nemo:") :]) == expected  # the member name itself
    assert checkpoint.artifact(checkpoint.config.tokenizer.vocab_file) == b"{}"
    with pytest.raises(NemoCheckpointError, match="merges.txt.*matched none"):
        checkpoint.artifact("nemo:merges.txt")
    assert all(not name.startswith("./") for name in checkpoint.member_names())


def test_tokenizer_delegates_to_llm_tokenizer(
    tmp_path, tiny_gpt_config, tiny_gpt_weights, tokenizer_file, monkeypatch
):
    import exporter.llm.tokenizer as tokenizer_module

    calls = {}

    def fake_load(section, read_artifact, tokenizer_path=None):
        calls.update(section=section, data=read_artifact(section["model"]), path=tokenizer_path)
        return "tokenizer"

    monkeypatch.setattr(tokenizer_module, "load_tokenizer", fake_load)
    path = write_nemo(
        tmp_path / "m.nemo",
        tiny_gpt_config,
        tiny_gpt_weights(tiny_gpt_config),
        artifacts={"tokenizer.model": tokenizer_file},
    )
    assert NemoCheckpoint(path).tokenizer(tokenizer_path="x") == "tokenizer"
    assert calls["data"] == tokenizer_file.read_bytes() and calls["path"] == "x"
    assert calls["section"]["library"] == "sentencepiece"


def test_hf_llama_to_nemo_matches_transformers_projections():
    """Fused QKV rows per group are [its q heads, k, v], fc1 is [gate; up]: checked on transformers' Llama."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        attention_bias=True,
    )
    model = LlamaForCausalLM(config).eval()
    nemo = hf_llama_to_nemo(model.state_dict(), num_attention_heads=8, num_query_groups=2)
    x = torch.randn(3, 32)
    attention, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    fused = torch.nn.functional.linear(
        x,
        nemo["decoder.layers.1.self_attention.linear_qkv.weight"],
        nemo["decoder.layers.1.self_attention.linear_qkv.bias"],
    ).view(3, 2, 6, 4)  # [tokens, groups, 4 q heads + k + v, head_dim]
    with torch.no_grad():
        q, k, v = (
            attention.q_proj(x).view(3, 2, 4, 4),
            attention.k_proj(x).view(3, 2, 1, 4),
            attention.v_proj(x).view(3, 2, 1, 4),
        )
        assert torch.allclose(fused[:, :, :4], q, atol=1e-6)
        assert torch.allclose(fused[:, :, 4:5], k, atol=1e-6) and torch.allclose(
            fused[:, :, 5:], v, atol=1e-6
        )
        fc1 = torch.nn.functional.linear(x, nemo["decoder.layers.1.mlp.linear_fc1.weight"])
        assert torch.allclose(
            torch.nn.functional.silu(fc1[:, :40]) * fc1[:, 40:], mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x)
        )
    assert torch.equal(
        nemo["decoder.layers.1.pre_mlp_layernorm.weight"],
        model.model.layers[1].post_attention_layernorm.weight,
    )
    assert torch.equal(nemo["output_layer.weight"], model.lm_head.weight)
    assert torch.equal(nemo["decoder.final_layernorm.weight"], model.model.norm.weight)


# -- refusals


def tar_with(tmp_path, *members: tarfile.TarInfo, data: bytes = b"") -> str:
    path = tmp_path / "bad.nemo"
    with tarfile.open(path, "w") as tar:
        config = OmegaConf.to_yaml(OmegaConf.create({"num_layers": 1})).encode()
        info = tarfile.TarInfo("./model_config.yaml")
        info.size = len(config)
        tar.addfile(info, io.BytesIO(config))
        for member in members:
            tar.addfile(member, io.BytesIO(data) if member.isfile() else None)
    return path


def member(name: str, kind: bytes = tarfile.REGTYPE, linkname: str = "", size: int = 0) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.size = kind, linkname, size
    return info


@pytest.mark.parametrize(
    "bad, problem",
    [
        (member("/etc/model_weights.ckpt"), "absolute path"),
        (member("./../model_weights.ckpt"), r"'\.\.'"),
        (member("./model_weights.ckpt", tarfile.SYMTYPE, "/etc/passwd"), "link"),
        (member("./model_weights.ckpt", tarfile.LNKTYPE, "model_config.yaml"), "link"),
        (member("./dev0", tarfile.CHRTYPE), "device"),
        (member("./pipe", tarfile.FIFOTYPE), "fifo"),
    ],
)
def test_unsafe_members_are_refused(tmp_path, bad, problem):
    with pytest.raises(NemoCheckpointError, match=problem) as error:
        NemoCheckpoint(tar_with(tmp_path, bad))
    assert bad.name in str(error.value)


def test_truncated_archive(tmp_path, tiny_gpt_config, tiny_gpt_weights):
    path = write_nemo(tmp_path / "m.nemo", tiny_gpt_config, tiny_gpt_weights(tiny_gpt_config))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(NemoCheckpointError, match="truncated") as error:
        NemoCheckpoint(path).state_dict()
    assert "m.nemo" in str(error.value)


def test_truncated_gzip_archive(tmp_path, tiny_gpt_config, tiny_gpt_weights):
    path = write_nemo(tmp_path / "m.nemo", tiny_gpt_config, tiny_gpt_weights(tiny_gpt_config), compress=True)
    path.write_bytes(path.read_bytes()[:-2000])
    with pytest.raises(NemoCheckpointError, match="m.nemo"):
        NemoCheckpoint(path).state_dict()


def test_not_a_tar_or_missing(tmp_path):
    path = tmp_path / "model.nemo"
    path.write_bytes(b"this is not a tar archive" * 100)
    with pytest.raises(NemoCheckpointError, match="model.nemo.*not a readable .nemo archive"):
        NemoCheckpoint(path)
    with pytest.raises(NemoCheckpointError, match="absent.nemo: no such file"):
        NemoCheckpoint(tmp_path / "absent.nemo")


def test_corrupt_weights_member(tmp_path):
    path = tar_with(tmp_path, member("./model_weights.ckpt", size=9), data=b"not torch")
    with pytest.raises(NemoCheckpointError, match="model_weights.ckpt"):
        NemoCheckpoint(path).state_dict()


def test_zarr_checkpoint_is_refused(tmp_path):
    folder = tmp_path / "ckpt" / "model_weights"
    folder.mkdir(parents=True)
    (folder / "metadata.json").write_text(
        json.dumps({"sharded_backend": "zarr", "sharded_backend_version": 1})
    )
    (folder.parent / "model_config.yaml").write_text("num_layers: 1\n")
    with pytest.raises(NemoCheckpointError, match="zarr.*torch_dist"):
        NemoCheckpoint(tar_directory(folder.parent, tmp_path / "z.nemo"))


def test_checkpoint_without_weights_lists_contents(tmp_path):
    with pytest.raises(NemoCheckpointError, match="no weights found.*model_config.yaml, notes.txt"):
        NemoCheckpoint(tar_with(tmp_path, member("./notes.txt")))
