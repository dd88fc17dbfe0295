"""Quantized LLM weights on the CPU: storage formats, the decoder built on them, export options and their errors."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from exporter import TensorRTMMExporter
from exporter.llm.config import QUANT_METHODS, DecoderConfig, QuantConfig
from exporter.llm.model import MLP, Decoder, select_llm_weights
from exporter.llm.quant import QuantLinear, dequantize, quantize
from exporter.llm.quant.calibrate import awq_scales
from exporter.llm.quant.convert import quantize_decoder_weights
from exporter.llm.quant.formats import QuantLayout, group_size_for
from exporter.llm.quant.kernels import quantized_linear, tinygemm_nibbles, tinygemm_scales_and_zeros
from support.decoders import make_tiny_gpt_weights
from support.demo import DEMO_NEMO

REPO = Path(__file__).resolve().parents[1]
CONFIG = {
    "num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 80, "num_attention_heads": 4, "num_query_groups": 2,
    "activation": "fast-swiglu", "normalization": "rmsnorm", "bias": True, "position_embedding_type": "rope",
    "share_embeddings_and_output_weights": False, "layernorm_epsilon": 1e-5, "max_position_embeddings": 128,
}


def test_int4_group_is_the_largest_that_divides_the_input_width():
    assert [group_size_for(k, 128) for k in (4096, 11008, 192, 96, 100, 90)] == [128, 128, 64, 32, 32, 32]
    assert group_size_for(4096, 64) == 64
    layout = QuantLayout.of(QuantConfig("int4_wo"), out_features=7, in_features=100)
    assert (layout.group, layout.padded_in_features, layout.groups) == (32, 128, 4)
    assert layout.shapes()["weight"] == ((7, 64), torch.uint8)


def test_int4_packs_two_columns_per_byte_low_nibble_first():
    # one group of 32 columns holding 0, 1, ..., 15, 0, 1, ...: min 0 and max 15 make scale 1 and zero 0
    weight = (torch.arange(32) % 16).float()[None].repeat(2, 1)
    layout = QuantLayout.of(QuantConfig("int4_wo"), 2, 32)
    stored = quantize(weight, layout)
    assert stored["weight"][0, :3].tolist() == [0 | 1 << 4, 2 | 3 << 4, 4 | 5 << 4]
    assert stored["weight_scale"].tolist() == [[1.0], [1.0]] and stored["weight_zero"].tolist() == [[0.0], [0.0]]
    torch.testing.assert_close(dequantize(layout, stored["weight"], stored["weight_scale"], stored["weight_zero"]),
                               weight, rtol=0, atol=0)


@pytest.mark.parametrize("method", QUANT_METHODS)
def test_each_method_rounds_within_its_step(method):
    """Every dequantized value is within half a quantization step of the weight (fp8: within its relative
    precision, 2^-4, plus half its smallest step near zero)."""
    weight = torch.randn(48, 100, generator=torch.Generator().manual_seed(0))
    layout = QuantLayout.of(QuantConfig(method), 48, 100)
    channel_scale = torch.rand(100, generator=torch.Generator().manual_seed(1)) + 0.5
    stored = quantize(weight, layout, channel_scale if method == "int4_awq" else None)
    restored = dequantize(layout, stored["weight"], stored["weight_scale"], stored.get("weight_zero"))
    if method == "int4_awq":
        restored = restored * stored["input_scale"]  # the input scale undoes the channel scaling
    error = (restored - weight).abs()
    if method == "int8_wo":
        assert (error <= stored["weight_scale"][:, None] / 2 * 1.0001).all()
    elif method == "fp8":
        assert (error <= weight.abs() * 2.0**-4 + stored["weight_scale"][:, None] * 2.0**-10).all()
    else:
        step = stored["weight_scale"].repeat_interleave(layout.group, dim=1)[:, :100]
        if method == "int4_awq":
            step = step * stored["input_scale"]
        assert (error <= step / 2 * 1.0001).all()
        assert error.max() > 0  # really 4-bit: not lossless


def test_quant_config_rejects_what_it_cannot_store():
    with pytest.raises(ValueError, match="quantization 'int3' is not supported; supported values: int8_wo, "):
        QuantConfig("int3")
    with pytest.raises(ValueError, match="group_size 100 is not supported; supported values: 128, 64, 32"):
        QuantConfig("int4_awq", group_size=100)
    with pytest.raises(ValueError, match="fp8 takes no group_size"):
        QuantConfig("fp8", group_size=128)
    assert QuantConfig("int4_wo").group_size == 128
    config = DecoderConfig.from_nemo(CONFIG, vocab_size=64)
    quantized = dataclasses.replace(config, quantization=QuantConfig("int4_awq", 64))
    assert DecoderConfig.from_dict(json.loads(json.dumps(quantized.to_dict()))) == quantized


def _tiny(method: str, dtype: torch.dtype = torch.float32):
    weights = {k: v * 0.2 for k, v in select_llm_weights(make_tiny_gpt_weights(CONFIG, vocab=64, seed=2)).items()}
    weights = {k: v.to(dtype) for k, v in weights.items()}
    config = DecoderConfig.from_nemo(CONFIG, vocab_size=64)
    float_model = Decoder.from_state_dict(config, dict(weights))
    calibration = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(0))
    quantized_config = quantize_decoder_weights(config, weights, QuantConfig(method), calibration)
    return float_model, quantized_config, weights


@pytest.mark.parametrize("method", QUANT_METHODS)
def test_quantized_decoder_is_one_load_and_the_reference_product(method):
    float_model, config, weights = _tiny(method)
    prefix = "decoder.layers.1.mlp.linear_fc2."
    assert weights[prefix + "weight"].dtype == {"int8_wo": torch.int8, "fp8": torch.float8_e4m3fn}.get(method,
                                                                                                        torch.uint8)
    assert (prefix + "input_scale" in weights) == (method == "int4_awq")
    model = Decoder.from_state_dict(config, weights, dtype=torch.bfloat16)
    fc2 = model.decoder.layers[1].mlp.linear_fc2
    assert isinstance(fc2, QuantLinear) and fc2.weight.dtype == weights[prefix + "weight"].dtype  # not cast
    assert fc2.weight_scale.dtype == torch.bfloat16 and fc2.bias.dtype == torch.bfloat16
    assert type(model.output_layer).__name__ == "Linear" and model.output_layer.weight.dtype == torch.bfloat16
    x = torch.randn(3, 80, dtype=torch.bfloat16)
    reference = torch.nn.functional.linear(
        x * fc2.input_scale if fc2.input_scale is not None else x,
        dequantize(fc2.layout, fc2.weight, fc2.weight_scale, fc2.weight_zero, torch.bfloat16), fc2.bias)
    torch.testing.assert_close(fc2(x), reference, rtol=0, atol=0)
    assert torch.equal(quantized_linear(x, fc2.layout, fc2.weight, fc2.weight_scale, fc2.weight_zero,
                                        fc2.input_scale, fc2.bias), reference)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        model32 = Decoder.from_state_dict(config, weights)
        error = (model32(model32.embed(ids)) - float_model(float_model.embed(ids))).norm()
    assert 0 < error / float_model(float_model.embed(ids)).norm() < 0.2  # quantized, and close to the float model


def test_awq_searches_fc2_on_its_activated_input_where_fc2_computes_the_activation(monkeypatch):
    """On CUDA fc2 of a SwiGLU MLP is given fc1's `[gate; up]` and computes silu(gate) * up itself: the AWQ
    search still sees fc2's product input (here that route is taken on the CPU, where fc2's product is the same)."""
    weights = select_llm_weights(make_tiny_gpt_weights(CONFIG, vocab=64, seed=2))
    model = Decoder.from_state_dict(DecoderConfig.from_nemo(CONFIG, vocab_size=64), weights)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    apart = awq_scales(model, ids, QuantConfig("int4_awq"))
    monkeypatch.setattr(MLP, "fuses_activation", lambda self, h, adapters: True)
    fused = awq_scales(model, ids, QuantConfig("int4_awq"))
    assert fused.keys() == apart.keys()
    assert fused["decoder.layers.0.mlp.linear_fc2"].shape == (CONFIG["ffn_hidden_size"],)
    for key in apart:
        torch.testing.assert_close(fused[key], apart[key], rtol=1e-5, atol=1e-6)


def test_a_quantized_state_dict_missing_a_scale_names_it():
    _, config, weights = _tiny("int8_wo")
    del weights["decoder.layers.0.self_attention.linear_qkv.weight_scale"]
    with pytest.raises(ValueError, match=r"missing keys \(1\): \['decoder.layers.0.self_attention.linear_qkv."
                                         r"weight_scale'\]"):
        Decoder.from_state_dict(config, weights)


def test_export_stores_and_records_the_method_and_serves_from_the_directory(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("What shape is this?\n\nWhat color is the shape?\nA red circle on a white background.\n")
    exporter = TensorRTMMExporter(tmp_path / "engine", device="cpu")
    exporter.export(DEMO_NEMO, model_type="neva", dtype="bfloat16", max_batch_size=2, max_input_len=256,
                    max_output_len=4, max_multimodal_len=128, quantization="int4_awq", calib_data=prompts)
    manifest = json.loads((tmp_path / "engine" / "manifest.json").read_text())
    llm_config = json.loads((tmp_path / "engine" / "llm_engine" / "config.json").read_text())
    assert manifest["quantization"] == llm_config["quantization"] == {"method": "int4_awq", "group_size": 128}
    with safe_open(tmp_path / "engine" / "llm_engine" / "model.safetensors", "pt") as stored:
        dtypes = {name: stored.get_slice(name).get_dtype() for name in stored.keys()}
    assert dtypes["decoder.layers.0.self_attention.linear_qkv.weight"] == "U8"
    assert dtypes["decoder.layers.0.self_attention.linear_qkv.input_scale"] == "BF16"
    assert dtypes["output_layer.weight"] == dtypes["embedding.word_embeddings.weight"] == "BF16"
    assert not any(name.startswith("embedding.word_embeddings.vision") for name in dtypes)
    served = TensorRTMMExporter(tmp_path / "engine", device="cpu")  # the directory alone
    assert isinstance(served.engine.decoder.decoder.layers[0].mlp.linear_fc1, QuantLinear)
    assert served.forward("What shape is this?", str(REPO / "demo" / "images" / "red_circle.png"),
                          max_output_len=4) == [["circle"]]


@pytest.mark.parametrize("arguments, message", [
    ({"quantization": "int3"}, "quantization 'int3' is not supported; supported values: int8_wo, int4_wo, "
                               "int4_awq, fp8"),
    ({"quantization": "int8_wo", "calib_data": "prompts.txt"}, "calib_data is used by quantization int4_awq only"),
    ({"calib_data": "prompts.txt"}, "calib_data is used by quantization int4_awq only"),
    ({"quantization": "int4_awq", "calib_data": "absent.txt"}, "absent.txt is not a file"),
    ({"quantization": "int4_awq", "calib_data": "empty.txt"}, "empty.txt holds no prompts"),
])
def test_export_refuses_bad_quantization_options_before_reading(tmp_path, monkeypatch, arguments, message):
    monkeypatch.chdir(tmp_path)
    Path("prompts.txt").write_text("hello\n")
    Path("empty.txt").write_text("\n  \n")
    exporter = TensorRTMMExporter(tmp_path / "engine", device="cpu")
    with pytest.raises(ValueError, match=message):
        exporter.export(tmp_path / "no_such.nemo", model_type="neva", **arguments)


def test_deploy_script_takes_quantization_flags():
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import deploy_triton
    finally:
        sys.path.pop(0)
    settings = deploy_triton.parse_settings(["-tmn", "m", "-mt", "neva", "-vc", "x.nemo", "--quantization",
                                             "int4_awq", "--calib_data", "prompts.txt"])
    arguments = deploy_triton._export_arguments(settings)
    assert (arguments["quantization"], arguments["calib_data"]) == ("int4_awq", "prompts.txt")
    assert "quantization" not in deploy_triton._export_arguments(
        deploy_triton.parse_settings(["-tmn", "m", "-mt", "neva", "-vc", "x.nemo"]))
    with pytest.raises(ValueError, match="apply to an export: give -vc/--visual_checkpoint"):
        deploy_triton.parse_settings(["-tmn", "m", "--quantization", "fp8"])
    with pytest.raises(ValueError, match="quantization 'int2' is not supported; supported values: int8_wo, "):
        deploy_triton.parse_settings(["-tmn", "m", "-mt", "neva", "-vc", "x.nemo", "--quantization", "int2"])


def test_without_triton_the_reference_runs_and_the_interpreter_test_skips(tmp_path):
    """A CPU-only install without Triton: the products fall back to the reference and the kernel tests skip."""
    script = (
        "import sys; sys.modules['triton'] = None\n"  # `import triton` now raises ImportError
        "import torch, pytest\n"
        "from exporter.llm.config import QuantConfig\n"
        "from exporter.llm.quant import QuantLinear, kernels\n"
        "assert kernels.triton is None\n"
        "layer = QuantLinear(40, 24, False, QuantConfig('int4_wo'))\n"
        "layer.weight.random_(0, 256); layer.weight_scale.fill_(0.01); layer.weight_zero.fill_(8.0)\n"
        "assert layer(torch.ones(2, 40)).shape == (2, 24)\n"
        "sys.exit(pytest.main(['-q', '-rs', '-p', 'no:cacheprovider', 'tests/test_quant_kernels.py']))\n"
    )
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    child = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=environment, capture_output=True, text=True,
                           timeout=300)
    assert child.returncode == pytest.ExitCode.NO_TESTS_COLLECTED, child.stdout[-3000:] + child.stderr[-3000:]
    assert "1 skipped" in child.stdout and "could not import 'triton'" in child.stdout


def test_mixture_of_experts_is_refused_with_a_clear_error():
    config = dataclasses.replace(_tiny("int8_wo")[1], quantization=None, bias=False, num_moe_experts=4)
    with pytest.raises(ValueError, match="mixtures of 4 experts; export it without quantization"):
        quantize_decoder_weights(config, {}, QuantConfig("int8_wo"))


@pytest.mark.parametrize("method", ["int4_wo", "int4_awq"])
def test_tinygemm_repacking_stands_for_the_stored_weight(method):
    """The `tinygemm` candidate's inputs, unpacked as torch's int4 kernel reads them (even column in the high
    nibble, weight `(q - 8) * s + o` per group), give `formats.dequantize`'s weight: exactly but for the offsets'
    one bfloat16 rounding."""
    n, k = 24, 384
    generator = torch.Generator().manual_seed(4)
    layout = QuantLayout.of(QuantConfig(method), n, k)
    channel = torch.rand(k, generator=generator) + 0.5 if method == "int4_awq" else None
    stored = quantize((torch.randn(n, k, generator=generator) / 20).to(torch.bfloat16), layout, channel)
    nibbles = tinygemm_nibbles(stored["weight"])
    q = torch.stack([nibbles >> 4, nibbles & 15], dim=-1).view(n, k).float()
    scales_and_offsets = tinygemm_scales_and_zeros(stored["weight_scale"], stored["weight_zero"])
    assert scales_and_offsets.shape == (layout.groups, n, 2) and scales_and_offsets.dtype == torch.bfloat16
    scale, offset = (scales_and_offsets[..., i].float().T.repeat_interleave(layout.group, dim=1) for i in (0, 1))
    theirs = (q - 8) * scale + offset
    ours = dequantize(layout, stored["weight"], stored["weight_scale"], stored["weight_zero"])
    assert (theirs - ours).abs().max() <= (offset.abs() * 2.0**-8).max()  # half a bfloat16 step of the offset
    assert (theirs - ours).norm() / ours.norm() < 5e-3


def test_a_repacked_copy_stays_only_where_a_product_chose_it():
    """The repacked copy made while timing is dropped when the product chose another candidate, and kept once one
    product of the weight chose tinygemm (a captured graph may read it), whatever later products choose."""
    from exporter.llm import gemv
    from exporter.llm.quant import kernels

    lost, won = torch.zeros(4, 8, dtype=torch.uint8), torch.zeros(4, 8, dtype=torch.uint8)
    keys = [("int4_wo", 4, 16, 32, torch.bfloat16, rows, "test") for rows in (1, 2, 4)]
    try:
        gemv._CHOICES.update({keys[0]: "fused", keys[1]: "tinygemm", keys[2]: "dequant"})
        kernels._COPIES["tinygemm"][lost], kernels._COPIES["tinygemm"][won] = ("copy",), ("copy",)
        kernels._settle_copies(lost, keys[0])
        assert lost not in kernels._COPIES["tinygemm"]
        kernels._settle_copies(won, keys[1])
        kernels._settle_copies(won, keys[2])
        assert kernels._COPIES["tinygemm"][won] == ("copy",) and won in kernels._COPIES_KEPT["tinygemm"]
        gemv._CHOICES[keys[0]] = "packed_split"  # the packed kernel's copy: kept for either of its readers
        kernels._COPIES["packed"][lost] = ("words",)
        kernels._settle_copies(lost, keys[0])
        assert kernels._COPIES["packed"][lost] == ("words",) and lost in kernels._COPIES_KEPT["packed"]
    finally:
        for key in keys:
            gemv._CHOICES.pop(key, None)
        for name, weight in (("tinygemm", won), ("packed", lost)):
            kernels._COPIES[name].pop(weight, None)
            kernels._COPIES_KEPT[name].pop(weight, None)
