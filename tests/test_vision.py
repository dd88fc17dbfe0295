"""Vision tower + projector + VisionEncoder against transformers' own CLIP/SigLIP models (tiny, CPU)."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    CLIPConfig,
    CLIPModel,
)

from exporter.perception import (
    DownSampleBlock,
    ProjectorError,
    VisionEncoder,
    VisionEncoderError,
    VisionTowerError,
    build_vision_encoder,
)
from exporter.perception.projector import PROJECTOR_PREFIX
from support.decoding import relative_error
from support.projectors import downsample_by_windows
from support.vision_towers import (
    HEADS,
    LLM_HIDDEN,
    VISION_HIDDEN,
    model_config,
    pixels_for,
    project_by_hand,
    projector_state,
    tiny_tower,
    tower_state,
)

torch.set_num_threads(1)


def reference_features(model, pixels, select_layer=-2, drop=1):
    with torch.no_grad():
        hidden = model(pixel_values=pixels, output_hidden_states=True).hidden_states[select_layer]
    return hidden[:, drop:]


@pytest.mark.parametrize("side", [4, 5])
def test_downsample_block_matches_window_loop(side):
    x = torch.randn(2, side * side, 3)
    expected = downsample_by_windows(x)
    assert torch.equal(DownSampleBlock()(x), expected)
    assert expected.shape == (2, ((side + 1) // 2) ** 2, 12)


@pytest.mark.parametrize(
    "tower_type, adapter, image_size",
    [
        ("clip", "linear", 32),
        ("clip", "mlp2x_gelu", 32),
        ("clip", "mlp3x_gelu", 32),
        ("clip", "identity", 32),
        ("siglip", "mlp_downsample", 40),
        ("siglip", "mlp2x_gelu", 32),
        ("clip", "mlp_downsample", 32),
    ],
)
def test_encoder_matches_transformers(tower_type, adapter, image_size):
    model = tiny_tower(tower_type, image_size)
    llm_hidden = VISION_HIDDEN if adapter == "identity" else LLM_HIDDEN
    cfg = model_config(
        adapter,
        llm_hidden,
        model_type=tower_type,
        crop_size=[image_size, image_size],
        vision_select_feature="cls_patch" if tower_type == "siglip" else "patch",
    )
    state = {**tower_state(model), **projector_state(adapter)}
    encoder = build_vision_encoder(cfg, state)
    pixels = pixels_for(image_size)
    drop = 1 if tower_type == "clip" else 0
    expected = project_by_hand(adapter, reference_features(model, pixels, drop=drop), state)
    with torch.no_grad():
        got = encoder(pixels)
    assert got.shape == (2, encoder.tokens_per_image, llm_hidden)
    assert relative_error(got, expected) < 1e-5
    assert encoder.spec()["feature_layer"] == 2  # the last layer is not computed


@pytest.mark.parametrize("select_layer, select_feature", [(-1, "patch"), (1, "cls_patch"), (0, "patch")])
def test_select_layer_and_feature(select_layer, select_feature):
    model = tiny_tower("clip")
    cfg = model_config("linear", vision_select_layer=select_layer, vision_select_feature=select_feature)
    state = {**tower_state(model, with_hf_prefix=False), **projector_state("linear")}
    encoder = build_vision_encoder(cfg, state)
    pixels = pixels_for(32)
    drop = 1 if select_feature == "patch" else 0
    expected = project_by_hand("linear", reference_features(model, pixels, select_layer, drop), state)
    with torch.no_grad():
        got = encoder(pixels)
    assert got.shape[1] == encoder.tokens_per_image == 16 + 1 - drop
    assert relative_error(got, expected) < 1e-5


def test_siglip_patch_keeps_all_tokens():
    model = tiny_tower("siglip")
    cfg = model_config("linear", model_type="siglip", vision_select_feature="patch")
    encoder = build_vision_encoder(cfg, {**tower_state(model), **projector_state("linear")})
    assert encoder.tokens_per_image == 16


def test_tower_from_full_clip_folder(tmp_path):
    torch.manual_seed(0)
    vision = {
        "hidden_size": VISION_HIDDEN,
        "intermediate_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": HEADS,
        "patch_size": 8,
        "image_size": 32,
    }
    text = {
        "vocab_size": 100,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "max_position_embeddings": 16,
    }
    full = CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=8)).eval()
    full.save_pretrained(tmp_path)
    cfg = model_config("mlp2x_gelu", from_pretrained=str(tmp_path), num_attention_heads=None)
    state = projector_state("mlp2x_gelu")
    encoder = build_vision_encoder(cfg, state)
    pixels = pixels_for(32)
    expected = project_by_hand("mlp2x_gelu", reference_features(full.vision_model, pixels), state)
    with torch.no_grad():
        assert relative_error(encoder(pixels), expected) < 1e-5


def test_tower_from_vision_only_folder_via_vision_tower_path(tmp_path):
    model = tiny_tower("siglip", image_size=40)
    model.save_pretrained(tmp_path)
    cfg = model_config(
        "mlp_downsample",
        from_pretrained="google/siglip-so400m-patch14-384",
        crop_size=[40, 40],
        num_attention_heads=None,
        vision_select_feature="cls_patch",
    )
    state = projector_state("mlp_downsample")
    encoder = build_vision_encoder(cfg, state, vision_tower_path=tmp_path)
    assert encoder.spec()["tower"]["type"] == "siglip"
    pixels = pixels_for(40)
    expected = project_by_hand("mlp_downsample", reference_features(model, pixels, drop=0), state)
    with torch.no_grad():
        assert relative_error(encoder(pixels), expected) < 1e-5


def test_checkpoint_tower_weights_win_over_folder_weights(tmp_path):
    folder_model, trained_model = tiny_tower("clip", seed=0), tiny_tower("clip", seed=7)
    folder_model.save_pretrained(tmp_path)
    cfg = model_config("linear", from_pretrained=str(tmp_path), num_attention_heads=None)
    state = {**tower_state(trained_model), **projector_state("linear")}
    encoder = build_vision_encoder(cfg, state)
    pixels = pixels_for(32)
    expected = project_by_hand("linear", reference_features(trained_model, pixels), state)
    with torch.no_grad():
        assert relative_error(encoder(pixels), expected) < 1e-5


def test_hub_name_without_local_copy_names_vision_tower_path():
    cfg = model_config("linear", from_pretrained="openai/clip-vit-large-patch14-336")
    with pytest.raises(VisionTowerError, match="vision_tower_path"):
        build_vision_encoder(cfg, projector_state("linear"))


def test_bad_vision_tower_path_is_named(tmp_path):
    with pytest.raises(VisionTowerError, match="vision_tower_path"):
        build_vision_encoder(
            model_config("linear"), projector_state("linear"), vision_tower_path=tmp_path / "x"
        )


def test_stored_tower_without_heads_asks_for_them():
    cfg = model_config("linear", num_attention_heads=None)
    state = {**tower_state(tiny_tower("clip")), **projector_state("linear")}
    with pytest.raises(VisionTowerError, match="num_attention_heads"):
        build_vision_encoder(cfg, state)


def test_unknown_projector_lists_supported():
    state = {**tower_state(tiny_tower("clip")), **projector_state("linear")}
    with pytest.raises(ProjectorError, match="mlp_downsample"):
        build_vision_encoder(model_config("qformer"), state)


def test_missing_projector_key_is_named():
    state = {**tower_state(tiny_tower("clip")), **projector_state("mlp2x_gelu")}
    del state[PROJECTOR_PREFIX + "2.bias"]
    with pytest.raises(ProjectorError, match=r"mm_projector\.2\.bias"):
        build_vision_encoder(model_config("mlp2x_gelu"), state)


def test_downsample_needs_square_grid():
    state = {**tower_state(tiny_tower("clip")), **projector_state("mlp_downsample")}
    with pytest.raises(VisionEncoderError, match="vision_select_feature: patch"):
        build_vision_encoder(model_config("mlp_downsample", vision_select_feature="cls_patch"), state)


def test_vision_hidden_size_mismatch_is_reported(tmp_path):
    model = tiny_tower("clip")
    state = {**tower_state(model), **projector_state("linear")}
    with pytest.raises(VisionTowerError, match="hidden_size"):
        build_vision_encoder(model_config("linear", hidden_size=64), state)
    model.save_pretrained(tmp_path)
    with pytest.raises(VisionEncoderError, match="hidden_size"):
        build_vision_encoder(model_config("linear", hidden_size=64), projector_state("linear"), tmp_path)


def test_wrong_layer_shapes_are_reported_briefly():
    state = {**tower_state(tiny_tower("clip")), **projector_state("linear")}
    with pytest.raises(VisionTowerError, match="size mismatch") as error:
        build_vision_encoder(model_config("linear", ffn_hidden_size=128), state)
    assert len(str(error.value)) < 800


@pytest.mark.parametrize("tower_type, adapter", [("clip", "mlp2x_gelu"), ("siglip", "mlp_downsample")])
def test_spec_round_trip_gives_identical_outputs(tmp_path, tower_type, adapter):
    image_size = 40 if tower_type == "siglip" else 32
    model = tiny_tower(tower_type, image_size)
    cfg = model_config(
        adapter,
        model_type=tower_type,
        crop_size=[image_size, image_size],
        vision_select_feature="cls_patch" if tower_type == "siglip" else "patch",
    )
    encoder = build_vision_encoder(cfg, {**tower_state(model), **projector_state(adapter)})
    (tmp_path / "config.json").write_text(json.dumps(encoder.spec()))
    save_file(encoder.state_dict_for_engine(), tmp_path / "model.safetensors")

    rebuilt = VisionEncoder.from_spec(
        json.loads((tmp_path / "config.json").read_text()), load_file(tmp_path / "model.safetensors")
    )
    pixels = pixels_for(image_size)
    with torch.no_grad():  # the served tower is the project's own (the export's is transformers')
        torch.testing.assert_close(rebuilt(pixels), encoder(pixels), rtol=1e-5, atol=1e-5)
    assert rebuilt.spec() == encoder.spec()
    assert rebuilt.preprocessor().to_spec() == encoder.preprocessor().to_spec()


def test_dtype_argument():
    cfg = model_config("linear")
    encoder = build_vision_encoder(
        cfg, {**tower_state(tiny_tower("clip")), **projector_state("linear")}, dtype=torch.bfloat16
    )
    with torch.no_grad():
        out = encoder(pixels_for(32))
    assert out.dtype == torch.bfloat16
    assert all(v.dtype == torch.bfloat16 for v in encoder.state_dict_for_engine().values())


@pytest.mark.parametrize("adapter", ["linear", "mlp2x_gelu", "mlp_downsample"])
def test_rebuilt_encoder_holds_the_given_tensors_once(adapter):
    """The served encoder is built on the meta device and given the loaded tensors: its parameters are those
    tensors (no initialisation, no second copy), and it answers as the export's encoder (transformers' tower)."""
    cfg = model_config(adapter, vision_select_feature="patch")
    encoder = build_vision_encoder(cfg, {**tower_state(tiny_tower("clip")), **projector_state(adapter)})
    weights = {name: tensor.clone() for name, tensor in encoder.state_dict_for_engine().items()}
    rebuilt = VisionEncoder.from_spec(encoder.spec(), weights)
    held = {tensor.data_ptr() for tensor in weights.values()}
    parameters = {parameter.data_ptr() for parameter in rebuilt.parameters()}
    assert parameters == held
    assert not any(parameter.requires_grad for parameter in rebuilt.parameters())
    pixels = pixels_for(32)
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(pixels), encoder(pixels), rtol=1e-5, atol=1e-5)
