"""On CUDA (skipped elsewhere): the quantized products' GPU candidates and the quantized decoder under CUDA graphs.

Each candidate `kernels.quantized_linear` may pick (the fused kernel, the packed int4 kernel, dequantize + cuBLAS, and for FP8
`torch._scaled_mm`) against float32 dequantize-then-matmul on LLaVA-1.5-7B's layer shapes and unaligned ones, at
decode and prefill row counts; a quantized decoder's float32 greedy tokens through the scheduler (captured decode
steps) equal the CPU reference path's; its bfloat16 logits stay close to float32's.
"""

from __future__ import annotations

import pytest
import torch

from exporter.llm.config import QUANT_METHODS, DecoderConfig, QuantConfig
from exporter.llm.generate import SamplingParams
from exporter.llm.model import Decoder, select_llm_weights
from exporter.llm.quant import kernels
from exporter.llm.quant.convert import quantize_decoder_weights
from exporter.llm.quant.formats import QuantLayout, dequantize, quantize
from exporter.runtime.scheduler import Scheduler, generate
from support.decoders import make_tiny_gpt_weights
from support.decoding import captured_decode_logits, relative_error

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or kernels.triton is None,
                                reason="needs a CUDA GPU and Triton")
LLAVA = ((12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008))
UNALIGNED = ((4097, 1000), (333, 4000), (1000, 90))
VOCAB = 128
CONFIG = {
    "num_layers": 3, "hidden_size": 128, "ffn_hidden_size": 224, "num_attention_heads": 4, "num_query_groups": 2,
    "activation": "fast-swiglu", "normalization": "rmsnorm", "bias": False, "position_embedding_type": "rope",
    "share_embeddings_and_output_weights": False, "layernorm_epsilon": 1e-5, "max_position_embeddings": 256,
}


@pytest.mark.parametrize("method", QUANT_METHODS)
@torch.inference_mode()
def test_every_candidate_equals_dequantize_then_matmul(method):
    """Within 1e-2 relative error, except `_scaled_mm`, whose activations are rounded to FP8 as well (5e-2). The
    fused kernel runs one fixed tile shape on every shape, unsplit and with K split in 3, and with tensor-core tiles
    for a few rows (autotuning each would
    compile for minutes); tinygemm (int4, where this torch has it) its own kernel; the autotuned choice runs on
    LLaVA's shapes at the rows the benchmark uses."""
    generator = torch.Generator("cuda").manual_seed(0)
    fp8_gpu = torch.cuda.get_device_capability() >= (8, 9)
    for n, k in LLAVA + UNALIGNED:
        weight = torch.randn(n, k, device="cuda", generator=generator, dtype=torch.bfloat16) / k**0.5
        layout = QuantLayout.of(QuantConfig(method), n, k)
        channel = torch.rand(k, device="cuda", generator=generator) + 0.5 if method == "int4_awq" else None
        stored = quantize(weight, layout, channel)
        tensors = (stored["weight"], stored["weight_scale"], stored.get("weight_zero"), stored.get("input_scale"))
        dense = dequantize(layout, *tensors[:3])
        for rows in (1, 3, 8, 32, 608):
            x = torch.randn(rows, k, device="cuda", generator=generator, dtype=torch.bfloat16)
            scaled = x.float() * tensors[3].float() if tensors[3] is not None else x.float()
            reference = scaled @ dense.T
            outputs = {"dequant": kernels._dequant_linear(x, layout, *tensors, None)}
            if method != "fp8" or fp8_gpu:
                tile = {"BLOCK_N": 16, "BLOCK_K": 256} if rows <= 8 else {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 128}
                outputs["fused"] = kernels.fused_linear(x, layout, *tensors, config=tile)
                outputs["split"] = kernels.fused_linear(x, layout, *tensors, config=tile | {"SPLIT_K": 3})
                if 1 < rows <= 8:  # the tensor-core candidates of a few rows
                    mma = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128}
                    outputs["fused_mma"] = kernels.fused_linear(x, layout, *tensors, config=mma, dot=True)
                    outputs["split_mma"] = kernels.fused_linear(x, layout, *tensors, config=mma | {"SPLIT_K": 2},
                                                                dot=True)
            if layout.int4 and rows <= kernels.SPLIT_ROWS:  # the packed tensor-core kernel, whole-K and split
                packed = {"BLOCK_M": 16 if rows <= 16 else 32, "BLOCK_N": 64, "BLOCK_K": 8 * layout.group}
                outputs["packed"] = kernels.packed_linear(x, layout, *tensors, config=packed)
                outputs["packed_split"] = kernels.packed_linear(x, layout, *tensors, config=packed | {"SPLIT_K": 3})
            if kernels._tinygemm_fits(layout, x):
                outputs["tinygemm"] = kernels._tinygemm_linear(x, layout, *tensors, None)
            if method == "fp8" and fp8_gpu and n % 16 == 0 and k % 16 == 0:
                outputs["scaled_mm"] = kernels._fp8_scaled_mm(x, stored["weight"], stored["weight_scale"], None)
            if (n, k) in LLAVA and rows in (1, 32, 608):
                outputs["chosen"] = kernels.quantized_linear(x, layout, *tensors)
            for name, out in outputs.items():
                limit = 5e-2 if name in ("scaled_mm", "chosen") and method == "fp8" else 1e-2
                error = relative_error(out, reference)
                assert error < limit, f"{name}: {n}x{k}, {rows} rows: relative error {error:.2e}"


@torch.inference_mode()
def test_fp8_row_quantization_rounds_as_torch():
    """The fused per-row amax + scale + e4m3 cast on the GPU equals the same steps in torch (both round to
    nearest), on LLaVA's input widths and an unaligned one."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 e4m3 needs sm_89+")
    generator = torch.Generator("cuda").manual_seed(1)
    for rows, k in ((1, 4096), (608, 4096), (32, 11008), (3, 1000)):
        x = torch.randn(rows, k, device="cuda", generator=generator, dtype=torch.bfloat16) * 3
        quantized, scales = kernels.quantize_rows_fp8(x)
        expected_scales = x.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 448.0
        expected = (x.float() / expected_scales).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        torch.testing.assert_close(scales, expected_scales, rtol=1e-6, atol=0)
        mismatched = (quantized.float() != expected.float()).float().mean().item()
        assert mismatched < 1e-3, f"{rows}x{k}: {mismatched:.2%} of the values differ"


@torch.inference_mode()
def test_a_split_product_replayed_from_a_graph_gives_the_same_bits_and_leaves_its_tickets_at_zero():
    """fc2's shape at one and 32 rows, K split in 8 (the engine's split at one row): each replay of a captured
    product finishes every tile from its slices' partials in slice order (the same bits every replay, no zeroing
    kernel in the graph) and sets every ticket counter back to zero."""
    n, k = LLAVA[3]
    generator = torch.Generator("cuda").manual_seed(2)
    weight = torch.randn(n, k, device="cuda", generator=generator, dtype=torch.bfloat16) / k**0.5
    layout = QuantLayout.of(QuantConfig("int8_wo"), n, k)
    stored = quantize(weight, layout)
    tensors = (stored["weight"], stored["weight_scale"])
    for rows, tile in ((1, {"BLOCK_N": 4, "BLOCK_K": 512}), (32, {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 128})):
        x = torch.randn(rows, k, device="cuda", generator=generator, dtype=torch.bfloat16)
        run = lambda: kernels.fused_linear(x, layout, *tensors, config=tile | {"SPLIT_K": 8})  # noqa: E731
        eager = run()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = run()
        replays = []
        for _ in range(3):
            graph.replay()
            replays.append(captured.clone())
        assert all(torch.equal(eager, out) for out in replays)
        assert relative_error(eager, x.float() @ dequantize(layout, *tensors).T) < 1e-2
        assert not kernels._TICKETS[stored["weight"]][-1].any()


def _decoder(method: str, device: str, dtype: torch.dtype, quantized_from: torch.dtype = torch.float32) -> Decoder:
    """The tiny decoder quantized from weights in `quantized_from` (its scales are exact in that dtype), loaded in
    `dtype` on `device`."""
    weights = {k: v * 0.3 for k, v in make_tiny_gpt_weights(CONFIG, vocab=VOCAB, seed=3).items()
               if not k.endswith(".bias")}
    weights = {k: v.to(quantized_from) for k, v in select_llm_weights(weights).items()}
    config = DecoderConfig.from_nemo(CONFIG, vocab_size=VOCAB)
    calibration = torch.randint(3, VOCAB, (2, 64), generator=torch.Generator().manual_seed(1))
    config = quantize_decoder_weights(config, weights, QuantConfig(method), calibration)
    return Decoder.from_state_dict(config, weights, dtype=dtype, device=device)


@torch.inference_mode()
def test_int4_awq_quantized_on_the_gpu_stores_what_the_cpu_does():
    """On CUDA fc2 computes SwiGLU as it reads fc1's `[gate; up]`: calibrating and quantizing there (what an
    export on a GPU does) gives the CPU's stored tensors, up to float32 rounding of the search."""
    weights = {k: v * 0.3 for k, v in select_llm_weights(make_tiny_gpt_weights(CONFIG, vocab=VOCAB, seed=3)).items()
               if not k.endswith(".bias")}
    config = DecoderConfig.from_nemo(CONFIG, vocab_size=VOCAB)
    calibration = torch.randint(3, VOCAB, (2, 64), generator=torch.Generator().manual_seed(1))
    stored = {device: dict(weights) for device in ("cpu", "cuda")}
    for device, tensors in stored.items():
        quantize_decoder_weights(config, tensors, QuantConfig("int4_awq"), calibration, device)
    name = "decoder.layers.0.mlp.linear_fc2.input_scale"
    assert stored["cuda"][name].shape == (CONFIG["ffn_hidden_size"],)
    for key, tensor in stored["cpu"].items():
        torch.testing.assert_close(stored["cuda"][key].float(), tensor.float(), rtol=1e-3, atol=1e-3, msg=key)


@pytest.mark.parametrize("method", QUANT_METHODS)
@torch.inference_mode()
def test_float32_greedy_tokens_through_captured_steps_equal_the_cpu(method):
    cpu, gpu = _decoder(method, "cpu", torch.float32), _decoder(method, "cuda", torch.float32)
    prompts = [torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 9, 14)]
    params = SamplingParams(max_output_len=16)
    expected = [generate(cpu, [cpu.embed(p)], [p.tolist()], [params])[0][0] for p in prompts]
    for prompt, tokens in zip(prompts, expected):  # well-posed: no near-tie on the CPU's greedy path
        logits = cpu(cpu.embed(torch.tensor(prompt.tolist() + tokens)[None]))[0, len(prompt) - 1: -1]
        top2 = logits.topk(2).values
        assert (top2[:, 0] - top2[:, 1]).min() > 1e-3  # checked on the CPU: the smallest gap is 0.004
    scheduler = Scheduler(gpu, max_slots=4, max_seq_len=64, eos_id=None, use_cuda_graphs=True)
    handles = [scheduler.submit(gpu.embed(p.cuda()), p.tolist(), params) for p in prompts]
    while scheduler.step():
        pass
    assert [h.result() for h in handles] == expected
    assert scheduler.forward.graph_count > 0


@pytest.mark.parametrize("method", QUANT_METHODS)
@torch.inference_mode()
def test_bfloat16_logits_within_2e_2_of_float32(method):
    """A prefill, then captured decode steps fed the same tokens: the same stored weights (quantized from bf16, so
    both dtypes hold their scales exactly), activations in float32 and in bfloat16. On the CPU the same comparison
    gives 1.3 to 1.5% (1.6% for the float model)."""
    ids = torch.randint(3, VOCAB, (2, 24), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    logits = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = _decoder(method, "cuda", dtype, quantized_from=torch.bfloat16)
        decoded, _ = captured_decode_logits(model, ids, 16)
        logits[dtype] = torch.cat([model(model.embed(ids[:, :16])), decoded], dim=1)
    limit = 5e-2 if method == "fp8" else 2e-2  # FP8 prefill may round activations too (`_scaled_mm`)
    error = relative_error(logits[torch.bfloat16], logits[torch.float32])
    assert error < limit, f"relative error {error:.3e}"


def test_the_candidate_timer_reads_from_memory_without_launch_overhead():
    """`gemv.measure_ms` as the engine times candidates: reading 32 MB (within an H100's 50 MB L2 cache) takes at
    least its time at 5 TB/s (above any HBM's bandwidth here: the cache was evicted before the run), about twice
    reading 16 MB, and a graph of one tiny kernel costs microseconds, not a launch's host time."""
    from exporter.llm import gemv

    small, large = (torch.ones(n, device="cuda") for n in (4 << 20, 8 << 20))  # 16 and 32 MB of float32
    large_ms, small_ms = gemv.measure_ms(large.sum), gemv.measure_ms(small.sum)
    assert large_ms >= (32 << 20) / 5e12 * 1e3, large_ms
    assert 1.3 < large_ms / small_ms < 2.6, (large_ms, small_ms)
    assert gemv.measure_ms(lambda: small[:1].add_(1)) < 0.05
    held = torch.cuda.memory_allocated()
    gemv.release_timing_buffers()  # freed; a later timing makes its buffer again
    assert held - torch.cuda.memory_allocated() >= 2 * (64 << 20) and gemv._EVICT == {}
    assert gemv.measure_ms(large.sum) >= (32 << 20) / 5e12 * 1e3 and len(gemv._EVICT) == 1
