"""Video-NeVA and LITA/VITA: feature blocks and token layouts against hand-written math and transformers' CLIP /
SigLIP; then export -> engine directory -> Pipeline against transformers' Llama fed the same spliced prompt."""

import re
from typing import ClassVar

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from tokenizers import Tokenizer as RawTokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import PreTrainedTokenizerFast

from exporter.engine.directory import export_engine, load_engine
from exporter.engine.limits import EngineLimits
from exporter.llm.generate import SamplingParams
from exporter.llm.tokenizer import HuggingFaceTokenizer, SentencePieceTokenizer, Tokenizer
from exporter.models import MultimodalInputError, PromptLayout, get_model_type
from exporter.models.lita import (
    LitaSettings,
    features_per_video,
    im_vid_pieces,
    lita_features,
    lita_settings,
    split_im_vid_block,
)
from exporter.models.templates import get_template
from exporter.perception.projector import PROJECTOR_PREFIX
from exporter.runtime.pipeline import Pipeline, Request
from support.decoding import relative_error
from support.media import lossless_video, random_frames
from support.tiny_llama import HIDDEN, llama_nemo_config, tiny_llama
from support.tokenizer_files import train_sentencepiece
from support.vision_towers import LLM_HIDDEN, model_config, project_by_hand, projector_state, tiny_tower, tower_state
from tools.nemo_writer import hf_llama_to_nemo, write_nemo

torch.set_num_threads(1)
LITA_TOKENS = ["<extra_id_4>", "<extra_id_5>", "<extra_id_8>", "<extra_id_9>"]
MEDIA = -1  # PromptLayout.token_ids marker of a feature row


class CharTokenizer(Tokenizer):
    """One id per character (its code point + 1000), the four LITA tokens 4/5/8/9, BOS 1."""

    bos_id, eos_id, pad_id, vocab_size = 1, 2, None, 2000
    special: ClassVar[dict[str, int]] = {"<extra_id_4>": 4, "<extra_id_5>": 5, "<extra_id_8>": 8, "<extra_id_9>": 9}

    def encode(self, text, add_bos=False):
        ids = [self.bos_id] if add_bos else []
        for part in re.split("(" + "|".join(map(re.escape, self.special)) + ")", text):
            ids += [self.special[part]] if part in self.special else [1000 + ord(c) for c in part]
        return ids

    def decode(self, ids, skip_special=True):
        return "".join(chr(i - 1000) for i in ids if i >= 1000)

    def token_to_id(self, token):
        return self.special.get(token)

    def save(self, directory):
        return {}


def chars(text):
    return [1000 + ord(c) for c in text]


def layout_rows(layout: PromptLayout) -> torch.Tensor:
    return torch.cat([piece for piece in layout.pieces if isinstance(piece, torch.Tensor)])


# --- LITA: feature blocks and the token layout by hand ---------------------------------------------------------------


def settings(token_format="im_vid_start_end", arch="temporal_all_resolution", sample_frames=3, num_frames=256):
    return LitaSettings(token_format, arch, sample_frames, num_frames)


@pytest.mark.parametrize("count, chosen", [(5, [0, 2, 4]), (2, [0, 1])])  # F = min(T, sample_frames = 3)
def test_im_vid_block_and_layout_by_hand(count, chosen):
    frames = torch.randn(count, 2, 4)  # T frames, S = 2 tokens, H = 4
    block = lita_features(frames, tuple(range(count)), settings())
    spatial = [frames[f, s] for f in chosen for s in range(2)]
    temporal = [(frames[t, 0] + frames[t, 1]) / 2 for t in range(count)]
    torch.testing.assert_close(block, torch.stack(spatial + temporal))

    split_frames, split_temporal = split_im_vid_block(block, tokens_per_frame=2, sample_frames=3)
    assert split_frames.shape == (len(chosen), 2, 4) and split_temporal.shape == (count, 4)
    layout = PromptLayout(im_vid_pieces(split_frames, split_temporal,
                                        {"im_start": 4, "im_end": 5, "vid_start": 8, "vid_end": 9}))
    expected = [4, MEDIA, MEDIA, 5] * len(chosen) + [8] + [MEDIA] * count + [9]
    assert layout.token_ids(MEDIA) == expected
    torch.testing.assert_close(layout_rows(layout), block)


def test_temporal_spatial_pool_by_hand():
    frames = torch.randn(6, 16, 3)  # 6 frames of a 4x4 token grid
    block = lita_features(frames, tuple(range(6)), settings("v1", "temporal_spatial_pool", sample_frames=6))
    temporal = [frames[t].mean(0) for t in range(6)]
    pooled = []
    for t in (0, 2, 3, 5):  # round(linspace(0, 5, 4))
        grid = frames[t].reshape(4, 4, 3)
        for i in range(2):
            for j in range(2):
                pooled.append(grid[2 * i : 2 * i + 2, 2 * j : 2 * j + 2].reshape(4, 3).mean(0))
    torch.testing.assert_close(block, torch.stack(temporal + pooled))
    assert features_per_video(settings("v1", "temporal_spatial_pool", num_frames=6), 16) == block.shape[0]
    with pytest.raises(ValueError, match="even side, got 9 tokens"):  # training's span holds S pooled tokens
        features_per_video(settings("v1", "temporal_spatial_pool"), 9)


def test_temporal_spatial_by_hand():
    frames = torch.randn(4, 3, 2)
    block = lita_features(frames, (0, 1, 2, 3), settings("v1", "temporal_spatial", sample_frames=4))
    expected = [frames[t].mean(0) for t in range(4)] + [frames[:, s].mean(0) for s in range(3)]
    torch.testing.assert_close(block, torch.stack(expected))


def test_repeated_frames_count_in_every_token():
    frames = torch.randn(3, 4, 2)  # 3 distinct frames of a 2x2 grid, sampled as 0, 1, 2, 2, 2
    order, padded = (0, 1, 2, 2, 2), frames[[0, 1, 2, 2, 2]]
    for arch in ("temporal_spatial", "temporal_spatial_pool"):
        once = lita_features(frames, order, settings("v1", arch))
        torch.testing.assert_close(once, lita_features(padded, tuple(range(5)), settings("v1", arch)))
    spatial_mean = (frames[0] + frames[1] + 3 * frames[2]) / 5  # the last frame weighs 3 of 5
    torch.testing.assert_close(lita_features(frames, order, settings("v1", "temporal_spatial"))[5:], spatial_mean)
    all_resolution = lita_features(frames, order, settings(sample_frames=3))  # frames round(linspace(0, 4, 3))
    torch.testing.assert_close(all_resolution[:12], torch.cat([frames[0], frames[2], frames[2]]))


def lita_config(token_format="im_vid_start_end", arch="temporal_all_resolution", llm_type="v1", num_frames=256,
                **mm):
    return OmegaConf.create({
        "data": {"num_frames": num_frames},
        "mm_cfg": {"llm": {"model_type": llm_type}, "lita": {"visual_token_format": token_format,
                                                             "lita_video_arch": arch, "sample_frames": 4}, **mm},
    })


def test_settings_from_config():
    lita = lita_settings(lita_config())
    assert (lita.sample_frames, lita.num_frames, lita.im_start, lita.vid_end) == (4, 256, "<extra_id_4>", "<extra_id_9>")
    llama_3 = lita_settings(lita_config(llm_type="llama_3"))
    assert (llama_3.im_start, llama_3.im_end) == ("<|reserved_special_token_4|>", "<|reserved_special_token_5|>")
    assert llama_3.vid_start == "<extra_id_8>"
    defaults = lita_settings(OmegaConf.create({"mm_cfg": {}, "data": {"num_frames": 8}}))  # NeMo's defaults
    assert (defaults.video_arch, defaults.visual_token_format, defaults.sample_frames) == ("temporal_spatial_pool",
                                                                                           "v1", 4)
    # NeMo's export runtime sampled v1 videos to sample_frames and never read data.num_frames
    v1 = lita_config("v1", "temporal_spatial", num_frames=-1)
    assert lita_settings(v1, "nemo-export").max_frames == 4


@pytest.mark.parametrize(
    "cfg, message",
    [
        (lita_config("v2"), "visual_token_format 'v2' is not one of"),
        (lita_config("v1", "temporal_all_resolution"), "does not go with visual_token_format 'v1'"),
        (lita_config(use_im_start_end=True), "use_im_start_end True has no training layout"),
        (lita_config("v1", "temporal_spatial", num_frames=-1), "need data.num_frames .* >= 1, got -1"),
    ],
)
def test_bad_lita_configs_are_named(cfg, message):
    with pytest.raises(ValueError, match=message):
        lita_settings(cfg)


# --- tiny perception engines built, saved and loaded like an export ---------------------------------------------------


def export_and_load(tmp_path, name, cfg, state, sampling=None):
    kind = get_model_type(name)
    encoder = kind.build_perception(cfg, state, dtype=torch.float32, vision_tower_path=None)
    facts = kind.save_perception(encoder, tmp_path / "visual_engine", cfg, video_frame_sampling=sampling)
    perception = kind.load_perception(tmp_path / "visual_engine", device="cpu", dtype=torch.float32)
    assert facts["features_per_item"] == perception.features_per_item
    return perception


@pytest.fixture(scope="module")
def clip_tower():
    return tiny_tower("clip", 32)


def video_neva_config(**data):
    cfg = model_config("linear")
    return OmegaConf.merge(cfg, {"data": {"num_frames": 4, "conv_template": "nvgpt", **data}})


def test_video_neva_features_are_frame_major(tmp_path, clip_tower):
    state = {**tower_state(clip_tower), **projector_state("linear")}
    perception = export_and_load(tmp_path, "video-neva", video_neva_config(), state)
    frames = random_frames(3)
    (video,) = perception.load_media(frames)
    assert video.order == (0, 1, 2, 2)  # 3 frames padded to num_frames=4 with the last, held once
    pixels = video.pixels[list(video.order)]
    expected_pixels = torch.stack([perception.preprocessor.preprocess_one(frames[i]) for i in (0, 1, 2, 2)])
    torch.testing.assert_close(pixels, expected_pixels)

    (block,) = perception.encode([video])
    with torch.no_grad():
        hidden = clip_tower(pixel_values=pixels, output_hidden_states=True).hidden_states[-2][:, 1:]
    per_frame = project_by_hand("linear", hidden, state)  # [4 frames, 16 tokens, H]
    expected = torch.cat([per_frame[0], per_frame[1], per_frame[2], per_frame[3]])
    assert block.shape == (4 * 16, LLM_HIDDEN) == (perception.features_per_item, LLM_HIDDEN)
    assert relative_error(block, expected) < 1e-5


def test_video_neva_layout_takes_video_or_image_placeholder(tmp_path, clip_tower):
    perception = export_and_load(tmp_path, "video-neva", video_neva_config(),
                                 {**tower_state(clip_tower), **projector_state("linear")})
    block = torch.randn(64, LLM_HIDDEN)
    template = get_template("nvgpt")
    tokenizer = CharTokenizer()
    before, after = template.render("<video>\nWhat happens?", "<video>").split("<video>")
    for text in ("What happens?", "<video>\nWhat happens?", "<image>\nWhat happens?"):
        layout = perception.layout(text, [block], tokenizer, template, apply_chat_template=True)
        assert layout.token_ids(MEDIA) == chars(before) + [MEDIA] * 64 + chars(after)
        assert torch.equal(layout_rows(layout), block)
    with pytest.raises(MultimodalInputError, match="2 <video> .*placeholder"):
        perception.layout("<video> and <video>", [block], tokenizer, template, apply_chat_template=True)


def test_video_neva_needs_a_frame_count(tmp_path, clip_tower):
    state = {**tower_state(clip_tower), **projector_state("linear")}
    with pytest.raises(ValueError, match="data.num_frames is -1"):
        export_and_load(tmp_path, "video-neva", video_neva_config(num_frames=-1), state)
    spliced = export_and_load(tmp_path, "video-neva", video_neva_config(splice_single_frame="last"), state)
    assert spliced.features_per_item == 16
    (video,) = spliced.load_media(random_frames(5))
    torch.testing.assert_close(video.pixels[0], spliced.preprocessor.preprocess_one(random_frames(5)[4]))


@pytest.fixture(scope="module")
def siglip_tower():
    return tiny_tower("siglip", 40)


def vita_config():
    cfg = model_config("mlp_downsample", model_type="siglip", crop_size=[40, 40], vision_select_feature="cls_patch")
    return OmegaConf.merge(cfg, {
        "data": {"num_frames": 4, "conv_template": "llama_3"},
        "mm_cfg": {"llm": {"model_type": "vita"}, "lita": {
            "visual_token_format": "im_vid_start_end", "lita_video_arch": "temporal_all_resolution",
            "sample_frames": 2}},
    })


def test_vita_nemo_export_sampling_against_transformers(tmp_path, siglip_tower):
    state = {**tower_state(siglip_tower), **projector_state("mlp_downsample")}
    perception = export_and_load(tmp_path, "vita", vita_config(), state, sampling="nemo-export")
    frames = random_frames(6)
    (video,) = perception.load_media(lossless_video(frames))
    # 6 frames > num_frames 4: round(6 / ceil(6 / 4)) = 3 frames, round(linspace(0, 5, 3)) = 0, 2, 5
    sampled = torch.stack([perception.preprocessor.preprocess_one(frames[i]) for i in (0, 2, 5)])
    assert video.order == (0, 1, 2)
    torch.testing.assert_close(video.pixels, sampled)

    pixels = video.pixels
    (block,) = perception.encode([video])
    with torch.no_grad():
        hidden = siglip_tower(pixel_values=pixels, output_hidden_states=True).hidden_states[-2]
    per_frame = project_by_hand("mlp_downsample", hidden, state)  # [3, 9, H]
    # F = min(3, sample_frames 2) frames round(linspace(0, 2, 2)) = 0, 2 of the sampled; then 3 temporal means
    expected = torch.cat([per_frame[0], per_frame[2], per_frame.mean(dim=1)])
    assert block.shape == (2 * 9 + 3, LLM_HIDDEN)
    assert relative_error(block, expected) < 1e-5
    assert perception.features_per_item == 2 * 9 + 4


def sentencepiece_tokenizer(tmp_path) -> Tokenizer:
    model = train_sentencepiece(tmp_path / "tokenizer.model")
    return SentencePieceTokenizer(model.read_bytes(), special_tokens=LITA_TOKENS)


def huggingface_tokenizer(tmp_path) -> Tokenizer:
    words = ["<unk>", "<s>", "</s>", "what", "happens", "?", "USER", ":", "ASSISTANT"]
    raw = RawTokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    raw.pre_tokenizer = Whitespace()
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    hf.add_special_tokens({"additional_special_tokens": LITA_TOKENS})
    hf.save_pretrained(tmp_path / "hf")
    return HuggingFaceTokenizer(tmp_path / "hf")


@pytest.mark.parametrize("make_tokenizer", [sentencepiece_tokenizer, huggingface_tokenizer])
def test_lita_layout_with_real_tokenizers(tmp_path, siglip_tower, make_tokenizer):
    perception = export_and_load(tmp_path, "lita", vita_config(),
                                 {**tower_state(siglip_tower), **projector_state("mlp_downsample")})
    tokenizer = make_tokenizer(tmp_path)
    block = torch.randn(2 * 9 + 3, LLM_HIDDEN)
    ids = {token: tokenizer.token_to_id(token) for token in LITA_TOKENS}
    assert None not in ids.values()
    template = get_template("v1")
    layout = perception.layout("what happens ?", [block], tokenizer, template, apply_chat_template=True)
    before, after = template.render("<video>\nwhat happens ?", "<video>").split("<video>")
    frame = [ids["<extra_id_4>"]] + [MEDIA] * 9 + [ids["<extra_id_5>"]]
    expected = (tokenizer.encode(before, add_bos=True) + frame + frame + [ids["<extra_id_8>"]] + [MEDIA] * 3
                + [ids["<extra_id_9>"]] + tokenizer.encode(after))
    assert layout.token_ids(MEDIA) == expected
    torch.testing.assert_close(layout_rows(layout), block)


def test_lita_layout_without_its_tokens_is_an_error(tmp_path, siglip_tower):
    perception = export_and_load(tmp_path, "lita", vita_config(),
                                 {**tower_state(siglip_tower), **projector_state("mlp_downsample")})
    tokenizer = CharTokenizer()
    tokenizer.special = {"<extra_id_4>": 4, "<extra_id_5>": 5}  # no <extra_id_8>/<extra_id_9>
    with pytest.raises(MultimodalInputError, match="no <extra_id_8>, <extra_id_9>"):
        perception.layout("<video>", [torch.randn(21, LLM_HIDDEN)], tokenizer, get_template("v1"), True)


def test_lita_takes_an_image_as_one_frame(tmp_path, siglip_tower):
    perception = export_and_load(tmp_path, "lita", vita_config(),
                                 {**tower_state(siglip_tower), **projector_state("mlp_downsample")})
    image = random_frames(1)[0]
    (video,) = perception.load_media(image)
    assert video.pixels.shape[0] == 1 and video.order == (0, 0, 0, 0)  # padded to num_frames=4, encoded once
    (block,) = perception.encode([video])
    assert block.shape == (2 * 9 + 4, LLM_HIDDEN)  # sample_frames 2 x S spatial rows + num_frames temporal rows
    layout = perception.layout("<image>", [block], CharTokenizer(), get_template("plain"), False)
    assert layout.token_ids(MEDIA) == ([4] + [MEDIA] * 9 + [5]) * 2 + [8] + [MEDIA] * 4 + [9]
    with pytest.raises(MultimodalInputError, match="one video per request"):
        perception.load_media([image, image])
    np.testing.assert_array_equal(image, random_frames(1)[0])  # input untouched


# --- export -> engine directory -> Pipeline against transformers (Llama + CLIP) with the same weights ------------------


@pytest.fixture(scope="module")
def llama_checkpoint_parts(tmp_path_factory, clip_tower):
    """A tiny Llama (transformers), its NeMo config and canonical weights, a CLIP tower, a projector, a tokenizer."""
    folder = tmp_path_factory.mktemp("video_parity")
    tokenizer_file = train_sentencepiece(folder / "tokenizer.model")
    heads, groups, vocab = 8, 4, 384
    hf = tiny_llama(heads, groups, vocab=vocab, seed=5)
    config = llama_nemo_config(heads, groups, vocab=vocab, max_position_embeddings=512)
    config["tokenizer"] = {"library": "sentencepiece", "model": "tokenizer.model",
                           "additional_special_tokens": [f"<extra_id_{i}>" for i in range(10)]}
    generator = torch.Generator().manual_seed(11)
    projector = {PROJECTOR_PREFIX + name: 0.2 * torch.randn(shape, generator=generator) for name, shape in {
        "0.weight": (HIDDEN, 32), "0.bias": (HIDDEN,), "2.weight": (HIDDEN, HIDDEN), "2.bias": (HIDDEN,)}.items()}
    weights = {**hf_llama_to_nemo(hf.state_dict(), heads, groups), **tower_state(clip_tower), **projector}
    return folder, hf, config, weights, projector, tokenizer_file, clip_tower


def export_pipeline(parts, name, extra_config, sampling=None):
    folder, _hf, config, weights, _projector, tokenizer_file, _clip = parts
    cfg = OmegaConf.merge(model_config("mlp2x_gelu", llm_hidden=HIDDEN), config, extra_config)
    nemo = write_nemo(folder / f"{name}.nemo", cfg, weights, artifacts={"tokenizer.model": tokenizer_file})
    engine_dir = folder / f"engine_{name}"
    export_engine(engine_dir, nemo, model_type=name, dtype="float32",
                  limits=EngineLimits(max_input_len=512, max_multimodal_len=256, max_output_len=8),
                  video_frame_sampling=sampling)
    return Pipeline(load_engine(engine_dir))


def reference_embeds(pipeline, hf, text, feature_pieces):
    """Embeddings spliced by hand with transformers' embedding table: the text before the placeholder,
    `feature_pieces` (token-id lists and feature rows), the text after it."""
    engine = pipeline.engine
    before, after = engine.template.render(text, "<video>").split("<video>")
    pieces = [engine.tokenizer.encode(before, add_bos=engine.template.add_bos), *feature_pieces,
              engine.tokenizer.encode(after)]
    embed = hf.get_input_embeddings()
    with torch.no_grad():
        return torch.cat([embed(torch.tensor(p)) if isinstance(p, list) else p for p in pieces]).unsqueeze(0)


def reference_answer(pipeline, hf, embeds, steps=6):
    """Greedy decoding by transformers from `embeds`, cut at the tokenizer's EOS and the template's stops."""
    engine = pipeline.engine
    stops = {engine.tokenizer.eos_id} | {engine.tokenizer.token_to_id(t) for t in engine.template.stop_tokens}
    tokens = []
    with torch.no_grad():
        for _ in range(steps):
            token = int(hf(inputs_embeds=embeds).logits[0, -1].argmax())
            if token in stops:
                break
            tokens.append(token)
            embeds = torch.cat([embeds, hf.get_input_embeddings()(torch.tensor([[token]]))], dim=1)
    return engine.tokenizer.decode(tokens).strip()


def assert_prompt_logits_match(pipeline, hf, text, media, embeds):
    """The engine's prompt (its perception, layout and decoder) gives transformers' logits at every position."""
    engine = pipeline.engine
    blocks = engine.perception.encode(engine.perception.load_media(media))
    layout = engine.perception.layout(text, blocks, engine.tokenizer, engine.template, True)
    ours = torch.cat([engine.decoder.embed(torch.tensor(p)) if isinstance(p, list) else p for p in layout.pieces])
    with torch.no_grad():
        assert relative_error(engine.decoder(ours[None]), hf(inputs_embeds=embeds).logits) < 1e-4


def clip_features(parts, pipeline, frames):
    """Per-frame features by transformers' CLIP + the projector by hand: `[frames, 16, HIDDEN]`."""
    _folder, _hf, _config, _weights, projector, _tokenizer, clip = parts
    pixels = torch.stack([pipeline.engine.perception.preprocessor.preprocess_one(frame) for frame in frames])
    with torch.no_grad():
        hidden = clip(pixel_values=pixels, output_hidden_states=True).hidden_states[-2][:, 1:]
    return project_by_hand("mlp2x_gelu", hidden, projector)


def test_video_neva_pipeline_matches_transformers(llama_checkpoint_parts):
    pipeline = export_pipeline(llama_checkpoint_parts, "video-neva",
                               {"data": {"num_frames": 3, "conv_template": "nvgpt"}})
    frames = random_frames(5, seed=2)
    video, text, hf = lossless_video(frames), "what is in this video", llama_checkpoint_parts[1]
    (answer,) = pipeline.run([Request(text, media=video, params=SamplingParams(max_output_len=6))])
    features = clip_features(llama_checkpoint_parts, pipeline, frames[[0, 2, 4]])  # linspace(0, 4, 3)
    embeds = reference_embeds(pipeline, hf, text, [features.reshape(-1, HIDDEN)])
    assert_prompt_logits_match(pipeline, hf, text, video, embeds)
    assert answer.texts == [reference_answer(pipeline, hf, embeds)]


def test_lita_nemo_export_pipeline_matches_transformers(llama_checkpoint_parts):
    lita = {"visual_token_format": "im_vid_start_end", "lita_video_arch": "temporal_all_resolution",
            "sample_frames": 2}
    pipeline = export_pipeline(llama_checkpoint_parts, "lita",
                               {"data": {"num_frames": 4, "conv_template": "v1"}, "mm_cfg": {"lita": lita}},
                               sampling="nemo-export")
    frames = random_frames(6, seed=3)
    video, text, hf = lossless_video(frames), "<image>\nwhat happens", llama_checkpoint_parts[1]
    (answer,) = pipeline.run([Request(text, media=video, params=SamplingParams(max_output_len=6))])
    features = clip_features(llama_checkpoint_parts, pipeline, frames[[0, 2, 5]])  # 3 of 6 frames
    ids = {t: pipeline.engine.tokenizer.token_to_id(t) for t in LITA_TOKENS}
    spliced = [[ids["<extra_id_4>"]], features[0], [ids["<extra_id_5>"]],
               [ids["<extra_id_4>"]], features[2], [ids["<extra_id_5>"]],
               [ids["<extra_id_8>"]], features.mean(dim=1), [ids["<extra_id_9>"]]]
    embeds = reference_embeds(pipeline, hf, "<video>\nwhat happens", spliced)
    assert_prompt_logits_match(pipeline, hf, text, video, embeds)
    assert answer.texts == [reference_answer(pipeline, hf, embeds)]
