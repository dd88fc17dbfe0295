"""SALM end to end: a tiny NeMo-layout checkpoint (perception, Llama, LoRA, SentencePiece) exported and answered
token for token as transformers answers with the LoRA merged independently; clips of different lengths batched;
NeMo's split export layout; audio files (WAV, FLAC, OGG, MP3, another rate, stereo) decoded, resampled, mixed down.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import soundfile
import torch
from omegaconf import OmegaConf

from exporter import TensorRTMMExporter
from exporter.engine import EngineError
from exporter.llm.generate import SamplingParams
from exporter.lora import LoraError, lora_alpha_and_dim, merge_lora
from exporter.media_safety import MediaPolicy
from exporter.models.salm import SalmModel, salm_prompt, salm_template
from exporter.perception.audio_io import AudioLimits, AudioLoadError, load_audio
from exporter.runtime import Completion, Request
from support.salm import (
    DEFAULT_QUESTION,
    PERCEPTION_CONFIG,
    RATE,
    TRAINED_PROMPT,
    build_salm,
    reference_tokens,
    write_clips,
    write_split_layout,
)

STEPS = 8
LIMITS = {"max_batch_size": 4, "max_input_len": 256, "max_output_len": 16, "max_multimodal_len": 256}


@pytest.fixture(scope="module")
def salm(tmp_path_factory):
    return build_salm(tmp_path_factory.mktemp("salm"))


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    return write_clips(tmp_path_factory.mktemp("clips"))


@pytest.fixture(scope="module")
def exporter(salm, tmp_path_factory):
    engine = tmp_path_factory.mktemp("engine")
    exporter = TensorRTMMExporter(engine, modality="audio", device="cpu")
    exporter.export(salm.nemo, model_type="salm", dtype="float32", **LIMITS)
    return exporter


def _ids(exporter, text, media, steps=STEPS) -> list[int]:
    (completion,) = exporter.generate([Request(text, media, SamplingParams(max_output_len=steps))])
    if isinstance(completion, Exception):
        raise completion
    return completion.token_ids[0]


# --- checkpoint, prompt and reference ----------------------------------------------------------------------------


def test_answers_match_the_reference_token_for_token(salm, clips, exporter):
    cases = [("", clips.wav, clips.wav_signal, DEFAULT_QUESTION),
             ("what is said here?", clips.flac, clips.flac_signal, "what is said here?")]
    for text, path, signal, question in cases:
        expected = reference_tokens(salm, signal, TRAINED_PROMPT.format(q=question), STEPS)
        assert len(expected) >= 3
        assert _ids(exporter, text, str(path)) == expected


def test_the_lora_and_its_scale_change_the_answer(salm, clips):
    """The reference can tell a missing LoRA merge apart (so the test above can fail)."""
    prompt = TRAINED_PROMPT.format(q=DEFAULT_QUESTION)
    merged = [reference_tokens(salm, s, prompt, STEPS) for s in (clips.wav_signal, clips.flac_signal)]
    plain = [reference_tokens(salm, s, prompt, STEPS, merged=False) for s in (clips.wav_signal, clips.flac_signal)]
    assert merged != plain


def test_engine_directory_layout_and_template(salm, exporter):
    engine = exporter.model_dir
    manifest = json.loads((engine / "manifest.json").read_text())
    assert (manifest["model_type"], manifest["modality"]) == ("salm", "audio")
    assert {p.name for p in (engine / "perception_engine").iterdir()} == {"config.json", "model.safetensors"}
    config = json.loads((engine / "perception_engine" / "config.json").read_text())
    assert config["perception"]["frontend"] == salm.perception.frontend
    assert config["features_per_second"] == manifest["features_per_item"] == 13  # 100 mel frames / 4 / 2
    template = json.loads((engine / "llm_engine" / "template.json").read_text())
    assert (template["prompt"], template["add_bos"], template["stop_tokens"]) == ("Q: {message}\nA:", False, ["[EOG]"])


@pytest.mark.parametrize("frontend", ["nemo-2.4", "nemo-2.5"])
def test_the_audio_frontend_option_is_recorded_and_served(salm, clips, frontend, tmp_path):
    chosen = TensorRTMMExporter(tmp_path, modality="audio", device="cpu")
    chosen.export(salm.nemo, model_type="salm", dtype="float32", audio_frontend=frontend, **LIMITS)
    config = json.loads((tmp_path / "perception_engine" / "config.json").read_text())
    assert config["perception"]["frontend"] == chosen.engine.perception.perception.frontend == frontend
    samples = len(clips.wav_signal)
    _, mel_lengths = chosen.engine.perception.perception.features(torch.from_numpy(clips.wav_signal)[None],
                                                                  torch.tensor([samples]))
    assert int(mel_lengths[0]) == samples // 160 + (1 if frontend == "nemo-2.4" else 0)  # the reference's §2.3
    chosen.pipeline.close()


def test_nemo_runner_prompt_and_raw_text(exporter, clips):
    default = _ids(exporter, "", str(clips.wav))
    assert _ids(exporter, "Q: what's the transcription of the audio? A:", str(clips.wav)) == default
    raw = exporter.forward(f"Q: {DEFAULT_QUESTION}\nA:", str(clips.wav), max_output_len=STEPS,
                           apply_chat_template=False)
    assert raw == exporter.forward("", str(clips.wav), max_output_len=STEPS)


def test_prompt_template_rules():
    config = OmegaConf.create({"data": {"train_ds": {"prompt_template": "[INST] {input} [/INST] {output}",
                                                     "add_bos": True}}})
    template = salm_template(config)
    assert (template.prompt, template.add_bos) == ("[INST] {message} [/INST]", True)
    assert salm_prompt("  hi  ", template) == "[INST] hi [/INST]"
    escaped = salm_template({"data": {"train_ds": {"prompt_template": "Q: {context}\\n{{A}}: {answer}"}}})
    assert salm_prompt("", escaped) == f"Q: {DEFAULT_QUESTION}\n{{{{A}}}}:"
    assert salm_template({}).prompt == "Q: {message}\nA:"
    with pytest.raises(ValueError, match="end with"):
        salm_template({"data": {"train_ds": {"prompt_template": "{answer} Q: {context}"}}})


# --- batching, inputs and errors ----------------------------------------------------------------------------------


def test_clips_of_different_lengths_in_one_batch_each_get_their_own_answer(exporter, clips):
    media = [str(clips.wav), str(clips.flac), str(clips.stereo), clips.wav_signal[: RATE // 2]]
    texts = ["", "what is said here?", "", ""]
    alone = [exporter.forward(t, m, max_output_len=STEPS)[0] for t, m in zip(texts, media)]
    together = exporter.forward(texts, media, max_output_len=STEPS)
    assert together == alone
    assert len({a[0] for a in alone}) >= 3  # the audio decides the answer


def test_waveform_bytes_and_path_give_the_same_answer(exporter, clips):
    by_path = _ids(exporter, "", str(clips.wav))
    assert _ids(exporter, "", clips.wav.read_bytes()) == by_path
    assert _ids(exporter, "", clips.wav_signal) == by_path


def test_bad_audio_fails_alone(exporter, clips):
    params = SamplingParams(max_output_len=STEPS)
    requests = [Request("", str(clips.wav), params), Request("", b"RIFF\x00\x00 this is not audio", params),
                Request("", str(clips.flac), params), Request("", None, params),
                Request("", [str(clips.wav), str(clips.flac)], params)]
    results = exporter.generate(requests)
    assert isinstance(results[1], AudioLoadError) and "not a decodable audio file" in str(results[1])
    assert isinstance(results[3], ValueError) and "one audio clip" in str(results[3])
    assert isinstance(results[4], ValueError) and "one audio clip per request, got 2" in str(results[4])
    for index, path in ((0, clips.wav), (2, clips.flac)):
        assert isinstance(results[index], Completion)
        assert results[index].token_ids[0] == _ids(exporter, "", str(path))


def test_engine_directory_answers_alone_in_a_fresh_process(exporter, clips):
    script = (
        "import json, sys\n"
        "from exporter import TensorRTMMExporter\n"
        "e = TensorRTMMExporter(sys.argv[1], modality='audio', device='cpu')\n"
        f"print(json.dumps(e.forward('', sys.argv[2], max_output_len={STEPS})))\n"
        "e.pipeline.close()\n"  # the scheduler may still run a dropped step; exiting under it aborts the process
    )
    done = subprocess.run([sys.executable, "-c", script, str(exporter.model_dir), str(clips.flac)],
                          capture_output=True, text=True, timeout=120, check=False,
                          env={"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == exporter.forward("", str(clips.flac),
                                                                                  max_output_len=STEPS)


def test_split_layout_with_llm_checkpoint_path(salm, clips, tmp_path):
    perception_dir, llm_nemo = write_split_layout(salm, tmp_path / "split")
    split = TensorRTMMExporter(tmp_path / "engine", modality="audio", device="cpu")
    split.export(perception_dir, llm_checkpoint_path=llm_nemo, model_type="salm", dtype="float32", **LIMITS)
    expected = reference_tokens(salm, clips.wav_signal, TRAINED_PROMPT.format(q=DEFAULT_QUESTION), STEPS)
    assert _ids(split, "", str(clips.wav)) == expected
    alone = TensorRTMMExporter(tmp_path / "engine2", modality="audio", device="cpu")
    with pytest.raises(EngineError, match="llm_checkpoint_path"):
        alone.export(perception_dir, model_type="salm", dtype="float32", **LIMITS)


# --- audio files --------------------------------------------------------------------------------------------------


def test_audio_formats_decode_to_mono_at_the_model_rate(clips):
    assert np.array_equal(load_audio(clips.wav, RATE), clips.wav_signal)
    assert np.array_equal(load_audio(clips.flac.read_bytes(), RATE), clips.flac_signal)
    resampled = load_audio(clips.stereo, RATE)  # 44.1 kHz, two channels
    assert resampled.shape == clips.stereo_mono_16k.shape
    inner = slice(200, -200)  # the resampler's edges
    assert np.abs(resampled[inner] - clips.stereo_mono_16k[inner]).max() < 2e-3
    for lossy, seconds in ((clips.ogg, 1.2), (clips.mp3, 1.2)):
        signal = load_audio(lossy, RATE)
        assert signal.dtype == np.float32 and signal.ndim == 1
        assert abs(signal.shape[0] / RATE - seconds) < 0.1


def test_audio_errors_say_what_to_change(clips, tmp_path):
    with pytest.raises(AudioLoadError, match="not a decodable audio file"):
        load_audio(b"\x00" * 100, RATE)
    with pytest.raises(AudioLoadError, match="over the limit of 0.5 s"):
        load_audio(clips.wav, RATE, AudioLimits(max_duration_s=0.5))
    with pytest.raises(AudioLoadError, match="over the limit of 1000"):
        load_audio(clips.flac, RATE, AudioLimits(max_bytes=1000))
    with pytest.raises(AudioLoadError, match="cannot be read"):
        load_audio(tmp_path / "missing.wav", RATE)
    with pytest.raises(AudioLoadError, match="1-D float array"):
        load_audio(np.zeros((2, 100), dtype=np.float32), RATE)
    with pytest.raises(AudioLoadError, match="NaN"):
        load_audio(np.array([0.0, np.nan], dtype=np.float32), RATE)
    silent = tmp_path / "empty.wav"
    soundfile.write(silent, np.zeros(0, dtype=np.float32), RATE)
    with pytest.raises(AudioLoadError, match="no audio samples"):
        load_audio(silent, RATE)


# --- LoRA merge ---------------------------------------------------------------------------------------------------


def test_lora_merge_scale_and_errors():
    base = torch.randn(6, 4)
    a, b = torch.randn(2, 4), torch.randn(6, 2)
    lora = "decoder.layers.0.self_attention.adapter_layer.lora_dense_attention_adapter."
    weights = {"decoder.layers.0.self_attention.linear_proj.weight": base.clone(),
               lora + "linear_in.weight": a, lora + "linear_out.weight": b}
    interpolated = OmegaConf.create({"peft": {"lora_tuning": {"adapter_dim": 2,
                                                              "alpha": "${model.peft.lora_tuning.adapter_dim}"}}})
    assert lora_alpha_and_dim(interpolated) == (None, 2)
    merged = merge_lora(dict(weights), interpolated)
    assert set(merged) == {"decoder.layers.0.self_attention.linear_proj.weight"}
    torch.testing.assert_close(merged["decoder.layers.0.self_attention.linear_proj.weight"], base + b @ a)
    scaled = merge_lora(dict(weights), {"peft": {"lora_tuning": {"adapter_dim": 2, "alpha": 6}}})
    torch.testing.assert_close(scaled["decoder.layers.0.self_attention.linear_proj.weight"], base + 3 * b @ a)
    with pytest.raises(LoraError, match="rank 2"):
        merge_lora(dict(weights), {"peft": {"lora_tuning": {"adapter_dim": 8}}})
    with pytest.raises(LoraError, match="lacks its linear_out"):
        merge_lora({k: v for k, v in weights.items() if "linear_out" not in k}, {})
    with pytest.raises(LoraError, match="not one this exporter merges"):
        merge_lora({"decoder.layers.0.self_attention.adapter_layer.lora_unfused_kqv_adapter.q_adapter.linear_in"
                    ".weight": a}, {})


def test_export_onnx_writes_the_perception_encoder(salm, clips, tmp_path):
    import onnxruntime

    onnx_exporter = TensorRTMMExporter(tmp_path / "engine", modality="audio", device="cpu")
    onnx_exporter.export(salm.nemo, model_type="salm", dtype="float32", export_onnx=True, **LIMITS)
    path = tmp_path / "engine" / "perception_engine" / "encoder.onnx"
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    signal = torch.from_numpy(clips.flac_signal)[None]
    with torch.no_grad():
        mel, mel_lengths = salm.perception.features(signal, torch.tensor([signal.shape[1]]))
        expected, expected_lengths = salm.perception.encode(mel, mel_lengths)
    encoded, lengths = session.run(None, {"processed_signal": mel.numpy(),
                                          "processed_signal_length": mel_lengths.int().numpy()})
    assert lengths.tolist() == expected_lengths.tolist()
    np.testing.assert_allclose(encoded, expected.numpy(), rtol=1e-4, atol=1e-4)


def test_checkpoints_without_perception_weights_are_refused_with_the_reason(salm):
    weights = {f"perception.{k}": v for k, v in salm.perception.state_dict().items() if not k.startswith("encoder.")}
    config = OmegaConf.create({"perception": PERCEPTION_CONFIG})
    with pytest.raises(ValueError, match="frozen audio encoder"):
        SalmModel().build_perception(config, weights, dtype=torch.float32, vision_tower_path=None)
    with pytest.raises(ValueError, match="no 'perception' section"):
        SalmModel().build_perception(OmegaConf.create({"num_layers": 2}), {}, dtype=torch.float32,
                                     vision_tower_path=None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_answers_equal_the_reference(salm, clips, exporter):
    """The same engine on the GPU: float32 tokens equal the reference's, for clips batched together."""
    gpu = TensorRTMMExporter(exporter.model_dir, modality="audio", device="cuda")
    try:
        signals = (clips.wav_signal, clips.flac_signal)
        expected = [reference_tokens(salm, s, TRAINED_PROMPT.format(q=DEFAULT_QUESTION), STEPS) for s in signals]
        results = gpu.generate([Request("", str(path), SamplingParams(max_output_len=STEPS))
                                for path in (clips.wav, clips.flac)])
        assert [r.token_ids[0] for r in results] == expected
    finally:
        gpu.pipeline.close()


def test_the_media_policy_caps_what_the_engine_decodes(exporter, clips):
    seconds = len(clips.wav_signal) / RATE
    capped = TensorRTMMExporter(exporter.model_dir, modality="audio", device="cpu",
                                media_policy=MediaPolicy(max_audio_duration_s=seconds / 2, max_bytes=10**6))
    params = SamplingParams(max_output_len=STEPS)
    too_long, too_big = capped.generate([Request("", str(clips.wav), params), Request("", b"\0" * (10**6 + 1), params)])
    assert isinstance(too_long, AudioLoadError) and "--media_max_audio_duration_s" in str(too_long)
    assert isinstance(too_big, AudioLoadError) and "--media_max_bytes" in str(too_big)
    capped.pipeline.close()
