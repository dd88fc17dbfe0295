"""SALM audio perception (exporter.perception.audio) against NeMo's own ASR modules, the reference's formulas,
and ONNX Runtime."""

from __future__ import annotations

import copy
import math
import os
import shutil
import subprocess
import wave
from pathlib import Path

import numpy as np
import pytest
import torch

from exporter.perception.audio import AudioPerception, AudioPerceptionError, export_audio_onnx
from exporter.perception.audio.features import slaney_mel_filterbank
from support.nemo_reference_env import NEMO_VERSIONS, NemoEnvUnavailable, nemo_python, run_reference

SAMPLE_RATE = 16000
PREPROCESSOR = "nemo.collections.asr.modules.AudioToMelSpectrogramPreprocessor"
CONFORMER = "nemo.collections.asr.modules.ConformerEncoder"
IDENTITY = "nemo.collections.speechlm2.modules.perception.IdentityConnector"
REL_TOLERANCE = 1e-4


def preprocessor_cfg(n_mels: int = 80, **overrides) -> dict:
    """A FastConformer / Canary front end (`pad_to: 0`, per-feature normalisation)."""
    cfg = {"_target_": PREPROCESSOR, "sample_rate": SAMPLE_RATE, "normalize": "per_feature", "window_size": 0.025,
           "window_stride": 0.01, "window": "hann", "features": n_mels, "n_fft": 512, "log": True,
           "frame_splicing": 1, "dither": 1e-5, "pad_to": 0, "pad_value": 0.0}
    cfg.update(overrides)
    return cfg


def encoder_cfg(feat_in: int, **overrides) -> dict:
    """A tiny FastConformer: dw_striding x8, 2 layers, d_model 32."""
    cfg = {"_target_": CONFORMER, "feat_in": feat_in, "feat_out": -1, "n_layers": 2, "d_model": 32,
           "subsampling": "dw_striding", "subsampling_factor": 8, "subsampling_conv_channels": 16,
           "ff_expansion_factor": 4, "self_attention_model": "rel_pos", "n_heads": 4, "att_context_size": [-1, -1],
           "xscaling": True, "untie_biases": True, "pos_emb_max_len": 5000, "conv_kernel_size": 9,
           "conv_norm_type": "batch_norm", "dropout": 0.0, "dropout_pre_encoder": 0.0, "dropout_emb": 0.0,
           "dropout_att": 0.0}
    cfg.update(overrides)
    return cfg


def tiny_salm_perception_cfg(n_mels: int = 80, output_dim: int = 48) -> dict:
    """NeMo-1 SALM layout: FastConformer, a 1-layer Conformer adapter at factor 1, proj to the LLM width."""
    return {
        "preprocessor": preprocessor_cfg(n_mels),
        "encoder": encoder_cfg(n_mels),
        "modality_adapter": encoder_cfg(32, n_layers=1, subsampling_factor=1, subsampling=None),
        "output_dim": output_dim,
    }


# model cases checked against NeMo: 80 and 128 mels, xscaling on and off, tied and untied position biases, conv norm
# kinds, striding x4, out_proj, limited attention context, no biases, Conformer and identity adapters
MODEL_CASES = {
    "fc80_xscale_conformer_adapter": tiny_salm_perception_cfg(80),
    "canary128_noxscale_identity": {
        "preprocessor": preprocessor_cfg(128),
        "encoder": encoder_cfg(128, d_model=64, n_heads=8, xscaling=False, untie_biases=False,
                               conv_norm_type="layer_norm"),
        "modality_adapter": {"_target_": IDENTITY, "d_model": 64},
        "output_dim": 40,
    },
    "striding4_outproj_nobias": {
        "preprocessor": preprocessor_cfg(80),
        "encoder": encoder_cfg(80, subsampling="striding", subsampling_factor=4, feat_out=24, use_bias=False,
                               att_context_size=[[24, 8], [-1, -1]], xscaling=False),
        "modality_adapter": encoder_cfg(24, n_layers=1, subsampling_factor=2, conv_norm_type="group_norm4"),
        "output_dim": 40,
    },
}
# front-end variants checked against NeMo (mel only)
MEL_CASES = {
    "exactpad_hamming_clamp_allfeatures": {"preprocessor": preprocessor_cfg(
        64, window_size=None, window_stride=None, n_window_size=400, n_window_stride=160, exact_pad=True,
        window="hamming", log_zero_guard_type="clamp", log_zero_guard_value="tiny", normalize="all_features",
        pad_to=16, mag_power=1.0)},
    "blackman_none_eps_band": {"preprocessor": preprocessor_cfg(
        40, window="blackman", normalize="NA", log_zero_guard_value="eps", lowfreq=20, highfreq=7000, preemph=None,
        n_fft=1024, mel_norm=None)},
    "bartlett_nolog": {"preprocessor": preprocessor_cfg(80, window="bartlett", log=False, pad_to=8)},
}


def randomize_(perception: AudioPerception, seed: int, cfg: dict | None = None) -> dict[str, torch.Tensor]:
    """Random weights (default inits, plus random norms, batch-norm statistics and position biases, equal across
    layers where `cfg` ties them); returns the state dict without the front-end buffers, as NeMo's perception keys
    minus `perception.`."""
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    for module in perception.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    for name, tensor in perception.state_dict().items():
        if name.startswith("preprocessor.") or name.endswith("num_batches_tracked"):
            continue
        noise = torch.randn(tensor.shape, generator=generator)
        if name.endswith("running_var"):
            tensor.copy_(torch.rand(tensor.shape, generator=generator) + 0.5)
        elif name.endswith(("running_mean", "pos_bias_u", "pos_bias_v")) or ("norm" in name and name.endswith("bias")):
            tensor.copy_(0.2 * noise)
        elif "norm" in name and name.endswith("weight"):
            tensor.copy_(1.0 + 0.2 * noise)
    for section in ("encoder", "modality_adapter"):
        if (cfg or {}).get(section, {}).get("untie_biases", True) is False:  # NeMo: one pair shared by all layers
            layers = getattr(perception, section).layers
            for layer in layers[1:]:
                for name in ("pos_bias_u", "pos_bias_v"):
                    getattr(layer.self_attn, name).data.copy_(getattr(layers[0].self_attn, name))
    return {k: v.clone() for k, v in perception.state_dict().items() if not k.startswith("preprocessor.")}


def espeak_clip(text: str, tmp: Path) -> np.ndarray:
    """`text` spoken by espeak-ng, resampled to 16 kHz mono float32 (skips when espeak-ng cannot be had)."""
    import soxr

    if shutil.which("espeak-ng") is None:
        if os.geteuid() == 0 and shutil.which("apt-get"):
            subprocess.run(["apt-get", "install", "-y", "espeak-ng"], capture_output=True, timeout=600)
        if shutil.which("espeak-ng") is None:
            pytest.skip("espeak-ng is not installed and cannot be installed here (apt-get install espeak-ng)")
    path = tmp / f"{abs(hash(text))}.wav"
    subprocess.run(["espeak-ng", "-w", str(path), text], check=True, capture_output=True)
    with wave.open(str(path)) as wav:
        assert wav.getsampwidth() == 2 and wav.getnchannels() == 1
        rate = wav.getframerate()
        samples = np.frombuffer(wav.readframes(wav.getnframes()), dtype="<i2").astype(np.float32) / 32768.0
    return soxr.resample(samples, rate, SAMPLE_RATE).astype(np.float32)


def padded_batch(clips: list[np.ndarray], seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Clips right-padded with low noise (not zeros, so masking mistakes show)."""
    rng = np.random.default_rng(seed)
    longest = max(len(clip) for clip in clips)
    signal = (0.01 * rng.standard_normal((len(clips), longest))).astype(np.float32)
    for row, clip in enumerate(clips):
        signal[row, : len(clip)] = clip
    return signal, np.array([len(clip) for clip in clips], dtype=np.int64)


def noise_batch() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    clips = [(0.1 * rng.standard_normal(n)).astype(np.float32) for n in (24000, 11217, 17600)]
    return padded_batch(clips, seed=8)


def speech_batch(tmp: Path) -> tuple[np.ndarray, np.ndarray]:
    clips = [espeak_clip("What is the transcription of this audio?", tmp),
             espeak_clip("Hello world.", tmp)[:-1234],
             espeak_clip("Fast conformer encoders subsample by eight.", tmp)]
    return padded_batch(clips, seed=9)


def rel_error(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(ours - ref) / max(np.linalg.norm(ref), 1e-30))


def valid(x: np.ndarray, lengths: np.ndarray, time_axis: int) -> np.ndarray:
    """Concatenation of each item's valid frames."""
    return np.concatenate([np.take(x[i], np.arange(n), axis=time_axis - 1).ravel() for i, n in enumerate(lengths)])


@pytest.fixture(scope="module", params=sorted(NEMO_VERSIONS))
def nemo_results(request, tmp_path_factory):
    """Runs every case on noise and speech batches through NeMo `frontend`'s version once; returns
    (frontend, {(case, inputs): (our model, signal, lengths, NeMo outputs)})."""
    frontend = request.param
    version = NEMO_VERSIONS[frontend]
    try:
        nemo_python(version)
    except NemoEnvUnavailable as error:
        pytest.skip(f"NeMo {version} reference venv unavailable: {error}")
    work = tmp_path_factory.mktemp(f"nemo-{version}")
    batches = {"noise": noise_batch()}
    try:
        batches["speech"] = speech_batch(work)
    except pytest.skip.Exception as skip:
        batches["speech"] = skip
    runs, cases = {}, []
    for seed, (case, cfg) in enumerate({**MODEL_CASES, **MEL_CASES}.items()):
        model = AudioPerception.from_config(cfg if "encoder" in cfg else _with_dummy_encoder(cfg), frontend=frontend)
        weights = work / f"{case}.pt"
        torch.save(randomize_(model, seed, cfg), weights)
        for kind, batch in batches.items():
            if isinstance(batch, pytest.skip.Exception):
                continue
            inputs, output = work / f"{case}-{kind}-in.npz", work / f"{case}-{kind}-out.npz"
            np.savez(inputs, signal=batch[0], lengths=batch[1])
            cases.append({"perception": cfg, "weights": str(weights), "inputs": str(inputs), "output": str(output)})
            runs[case, kind] = (model, batch, output)
    run_reference(version, cases, work)
    results = {key: (model, batch, dict(np.load(output))) for key, (model, batch, output) in runs.items()}
    return frontend, results, batches


def _with_dummy_encoder(cfg: dict) -> dict:
    """A mel-only case still needs an encoder to build an AudioPerception; NeMo's side runs the front end only."""
    n_mels = cfg["preprocessor"]["features"]
    return cfg | {"encoder": encoder_cfg(n_mels, n_layers=1), "modality_adapter": {"_target_": IDENTITY},
                  "output_dim": 32}


def _result(nemo_results, case: str, kind: str):
    frontend, results, batches = nemo_results
    if isinstance(batches[kind], pytest.skip.Exception):
        pytest.skip(str(batches[kind]))
    return frontend, results[case, kind]


@pytest.mark.parametrize("kind", ["noise", "speech"])
@pytest.mark.parametrize("case", sorted({**MODEL_CASES, **MEL_CASES}))
def test_mel_features_match_nemo(nemo_results, case, kind):
    frontend, (model, (signal, lengths), ref) = _result(nemo_results, case, kind)
    featurizer = model.preprocessor.featurizer
    assert rel_error(featurizer.fb.numpy(), ref["fb"]) < 1e-6, "Slaney filterbank differs from NeMo's (librosa)"
    np.testing.assert_array_equal(featurizer.window.numpy(), ref["window"])
    mel, mel_lengths = model.features(torch.from_numpy(signal), torch.from_numpy(lengths))
    assert mel.shape == ref["mel"].shape
    np.testing.assert_array_equal(mel_lengths.numpy(), ref["mel_lengths"])
    assert mel_lengths.dtype == torch.int64
    error = rel_error(valid(mel.numpy(), mel_lengths.numpy(), 2), valid(ref["mel"], ref["mel_lengths"], 2))
    assert error < REL_TOLERANCE, f"{frontend} mel relative error {error:.2e}"
    np.testing.assert_array_equal(mel.numpy()[ref["mel"] == 0.0], 0.0)  # padding where NeMo pads


@pytest.mark.parametrize("kind", ["noise", "speech"])
@pytest.mark.parametrize("case", sorted(MODEL_CASES))
def test_encoder_and_adapter_match_nemo(nemo_results, case, kind):
    frontend, (model, (signal, lengths), ref) = _result(nemo_results, case, kind)
    with torch.no_grad():
        mel, mel_lengths = model.features(torch.from_numpy(signal), torch.from_numpy(lengths))
        encoder_out, encoder_lengths = model.encoder(mel, mel_lengths)
        encoded, encoded_lengths = model.encode(mel, mel_lengths)
    np.testing.assert_array_equal(encoder_lengths.numpy(), ref["encoder_lengths"])
    np.testing.assert_array_equal(encoded_lengths.numpy(), ref["encoded_lengths"])
    assert encoded.shape == ref["encoded"].shape
    error = rel_error(valid(encoder_out.numpy(), encoder_lengths.numpy(), 2),
                      valid(ref["encoder_out"], ref["encoder_lengths"], 2))
    assert error < REL_TOLERANCE, f"{frontend} encoder relative error {error:.2e}"
    error = rel_error(valid(encoded.numpy(), encoded_lengths.numpy(), 1),
                      valid(ref["encoded"], ref["encoded_lengths"], 1))
    assert error < REL_TOLERANCE, f"{frontend} encoder+adapter+proj relative error {error:.2e}"


def test_nemo25_frontend_is_batch_invariant():
    """A clip alone equals the same clip inside a padded batch, over its valid frames (NeMo >= 2.5 behaviour)."""
    model = AudioPerception.from_config(tiny_salm_perception_cfg(80), frontend="nemo-2.5")
    randomize_(model, seed=3)
    signal, lengths = noise_batch()
    batch_mel, batch_mel_len = model.features(torch.from_numpy(signal), torch.from_numpy(lengths))
    batch_out, batch_len = model.encode(batch_mel, batch_mel_len)
    for row, length in enumerate(lengths):
        alone = torch.from_numpy(signal[row : row + 1, :length])
        mel, mel_len = model.features(alone, torch.tensor([length]))
        out, out_len = model.encode(mel, mel_len)
        assert out_len.item() == batch_len[row].item()
        n = mel_len.item()
        torch.testing.assert_close(mel[0, :, :n], batch_mel[row, :, :n], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out[0, : out_len.item()], batch_out[row, : out_len.item()], rtol=1e-4, atol=1e-5)


def test_frontends_differ_as_the_reference_says():
    """10.0 s: 1001 mel frames either way; valid 1001 (<= 2.4) vs 1000 (>= 2.5); 126 vs 125 encoder frames."""
    signal = torch.from_numpy(noise_batch()[0][:1, :1].repeat(160000, axis=1))
    expected = {"nemo-2.4": (1001, 126), "nemo-2.5": (1000, 125)}
    for frontend, (frames, tokens) in expected.items():
        cfg = tiny_salm_perception_cfg(80)
        model = AudioPerception.from_config(cfg, frontend=frontend)
        mel, mel_len = model.features(signal, torch.tensor([160000]))
        assert mel.shape[-1] == 1001 and mel_len.item() == frames
        assert model.encode(mel, mel_len)[1].item() == tokens


def test_frontend_choice():
    cfg = tiny_salm_perception_cfg(80)
    assert AudioPerception.from_config(cfg).frontend == "nemo-2.5"
    assert AudioPerception.from_config(cfg | {"frontend": "nemo-2.4"}).frontend == "nemo-2.4"
    assert AudioPerception.from_config(cfg | {"frontend": "nemo-2.4"}, frontend="nemo-2.5").frontend == "nemo-2.5"
    with pytest.raises(AudioPerceptionError, match="nemo-2.4, nemo-2.5"):
        AudioPerception.from_config(cfg, frontend="nemo-1.23")


def test_stored_filterbank_and_window_are_used():
    """`fb` / `window` from the checkpoint replace the computed ones (canary-qwen stores them bf16-rounded)."""
    cfg = tiny_salm_perception_cfg(80)
    cfg["preprocessor"]["normalize"] = "NA"
    model = AudioPerception.from_config(cfg)
    weights = randomize_(model, seed=1)
    signal, lengths = (torch.from_numpy(a) for a in noise_batch())
    plain_mel, _ = model.features(signal, lengths)
    computed_fb = model.preprocessor.featurizer.fb.clone()
    stored = dict(weights)
    stored["preprocessor.featurizer.fb"] = 2.0 * computed_fb
    stored["preprocessor.featurizer.window"] = model.preprocessor.featurizer.window.to(torch.bfloat16)
    model.load_state_dict(stored)
    mel, mel_len = model.features(signal, lengths)
    n = mel_len[0].item()
    # log(2·P + 2^-24) vs log(P + 2^-24): log 2 apart wherever the power is well above the guard
    loud = plain_mel[0, :, :n] > -5
    torch.testing.assert_close(mel[0, :, :n][loud] - plain_mel[0, :, :n][loud],
                               torch.full_like(mel[0, :, :n][loud], math.log(2.0)), rtol=0, atol=2e-2)
    assert model.preprocessor.featurizer.window.dtype == torch.float32


def test_biases_absent_from_weights_are_dropped():
    """Checkpoints trained with use_bias false whose config omits it: the weights decide."""
    cfg = tiny_salm_perception_cfg(80)
    no_bias = copy.deepcopy(cfg)
    no_bias["encoder"]["use_bias"] = False
    reference = AudioPerception.from_config(no_bias)
    weights = randomize_(reference, seed=5)
    model = AudioPerception.from_config(cfg)
    model.load_state_dict(weights)
    assert model.encoder.layers[0].self_attn.linear_q.bias is None
    assert model.encoder.layers[0].conv.depthwise_conv.bias is None
    assert model.modality_adapter.layers[0].feed_forward1.linear1.bias is not None
    signal, lengths = (torch.from_numpy(a) for a in noise_batch())
    torch.testing.assert_close(model(signal, lengths)[0], reference(signal, lengths)[0])


def test_pooling_mlp_cat_adapter_follows_the_formula():
    """PoolingMLPConnectors 'cat': drop T % k trailing frames, concat k frames, Linear, then MLP (Linear, relu,
    Linear); lengths floor(len / k); no proj (the config has output_dim)."""
    cfg = tiny_salm_perception_cfg(80)
    cfg["modality_adapter"] = {"_target_": "nemo.collections.multimodal.speech_llm.modules.PoolingMLPConnectors",
                               "input_dim": 32, "hidden_dim": 24, "output_dim": 48, "num_layers": 2,
                               "activation": "relu", "pooling": "cat", "pooling_factor": 3}
    model = AudioPerception.from_config(cfg)
    weights = randomize_(model, seed=2)
    assert {k for k in weights if k.startswith("modality_adapter.")} == {
        "modality_adapter.preprocess.1.weight", "modality_adapter.preprocess.1.bias",
        "modality_adapter.mlp.layer0.weight", "modality_adapter.mlp.layer0.bias",
        "modality_adapter.mlp.layer2.weight", "modality_adapter.mlp.layer2.bias"}
    signal, lengths = (torch.from_numpy(a) for a in noise_batch())
    mel, mel_len = model.features(signal, lengths)
    enc, enc_len = model.encoder(mel, mel_len)
    out, out_len = model.encode(mel, mel_len)
    frames = enc.transpose(1, 2)
    groups = frames.shape[1] // 3
    stacked = frames[:, : 3 * groups].reshape(frames.shape[0], groups, 3 * 32)
    hidden = stacked @ weights["modality_adapter.preprocess.1.weight"].T + weights["modality_adapter.preprocess.1.bias"]
    hidden = torch.relu(hidden @ weights["modality_adapter.mlp.layer0.weight"].T
                        + weights["modality_adapter.mlp.layer0.bias"])
    expected = hidden @ weights["modality_adapter.mlp.layer2.weight"].T + weights["modality_adapter.mlp.layer2.bias"]
    torch.testing.assert_close(out, expected)
    assert out_len.tolist() == [n // 3 for n in enc_len.tolist()]


@pytest.mark.parametrize(
    "section, change, message",
    [
        ("modality_adapter", {"_target_": "nemo.collections.asr.modules.ConvASRDecoder"}, "ConvASRDecoder"),
        ("modality_adapter", {"_target_": "x.PoolingMLPConnectors", "pooling": "mean", "hidden_dim": 8}, "pooling"),
        ("encoder", {"self_attention_model": "abs_pos"}, "self_attention_model"),
        ("encoder", {"subsampling": "vggnet"}, "vggnet"),
        ("preprocessor", {"window": "kaiser"}, "window"),
        ("preprocessor", {"n_window_size": 400}, "window_size"),
    ],
)
def test_unsupported_configs_are_refused_by_name(section, change, message):
    cfg = tiny_salm_perception_cfg(80)
    cfg[section] = cfg[section] | change if section != "modality_adapter" else change
    with pytest.raises(AudioPerceptionError, match=message):
        AudioPerception.from_config(cfg)


def test_slaney_filterbank_properties():
    """Slaney scale: filter edges linear below 1 kHz; area normalisation: each filter's weights sum to about
    2 / (bandwidth in Hz) per Hz of bin spacing."""
    fb = slaney_mel_filterbank(16000, 512, 80, 0.0, 8000.0)
    assert fb.shape == (80, 257) and (fb >= 0).all()
    peaks = fb.argmax(dim=1)
    assert (peaks[1:] >= peaks[:-1]).all()
    unnormalised = slaney_mel_filterbank(16000, 512, 80, 0.0, 8000.0, norm=None)
    assert unnormalised.max() <= 1.0 + 1e-6


@pytest.mark.parametrize("n_mels", [80, 128])
def test_onnx_export_matches_pytorch(n_mels, tmp_path):
    """encoder + adapter + proj through ONNX Runtime for two batch sizes and two lengths, any mel count."""
    import onnxruntime

    cfg = tiny_salm_perception_cfg(n_mels)
    cfg["modality_adapter"] = encoder_cfg(32, n_layers=1, subsampling_factor=2)
    model = AudioPerception.from_config(cfg)
    randomize_(model, seed=4)
    path = export_audio_onnx(model, tmp_path / "perception_encoder.onnx")
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    generator = torch.Generator().manual_seed(0)
    for batch, frames in [(1, 64), (3, 517)]:
        mel = torch.randn(batch, n_mels, frames, generator=generator)
        mel_len = torch.tensor([frames - 37 * i for i in range(batch)])
        with torch.no_grad():
            expected, expected_len = model.encode(mel, mel_len)
        encoded, encoded_len = session.run(
            None, {"processed_signal": mel.numpy(), "processed_signal_length": mel_len.numpy().astype(np.int32)})
        np.testing.assert_array_equal(encoded_len, expected_len.numpy())
        assert encoded_len.dtype == np.int32 and encoded.shape == tuple(expected.shape)
        error = rel_error(valid(encoded, encoded_len, 1), valid(expected.numpy(), expected_len.numpy(), 1))
        assert error < 1e-5
