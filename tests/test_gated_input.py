"""fc2's products reading a SwiGLU MLP's `[gate; up]` and computing `silu(gate) * up` themselves (no activation
kernel of its own on CUDA): `gemv.linear` and `quantized_linear` with `gated_silu`.

On the CPU: the reference paths apply `gated_silu`, and the kernels run under Triton's interpreter (a child pytest,
as tests/test_quant_kernels.py) against the activation computed apart, then the product. On CUDA (skipped
elsewhere): every candidate in bfloat16, and a SwiGLU decoder's float32 greedy tokens through captured steps.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from exporter.llm import gemv
from exporter.llm.config import QuantConfig
from exporter.llm.quant import kernels
from exporter.llm.quant.formats import QuantLayout, dequantize, quantize
from support.decoding import relative_error
from support.kernels import TRITON_INTERPRETED, run_under_triton_interpreter

CUDA = torch.cuda.is_available() and kernels.triton is not None


def _silu_gated(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def _stored(method: str, n: int, k: int, dtype: torch.dtype, device: str = "cpu"):
    generator = torch.Generator(device).manual_seed(n + k)
    weight = torch.randn(n, k, generator=generator, device=device) / k**0.5
    layout = QuantLayout.of(QuantConfig(method), n, k)
    channel = torch.rand(k, generator=generator, device=device) + 0.5 if method == "int4_awq" else None
    stored = quantize(weight.to(dtype), layout, channel)
    return layout, (stored["weight"], stored["weight_scale"], stored.get("weight_zero"), stored.get("input_scale"))


def _reference(h: torch.Tensor, layout: QuantLayout, tensors: tuple, bias: torch.Tensor | None) -> torch.Tensor:
    """float32: the activation rounded to h's dtype (as the activation kernel's output), then the product."""
    x = _silu_gated(h.float()).to(h.dtype).float()
    if tensors[3] is not None:
        x = x * tensors[3].float()
    return F.linear(x, dequantize(layout, *tensors[:3]), None if bias is None else bias.float())


def test_reference_paths_apply_the_activation():
    """Off CUDA both entry points compute `F.linear(gated_silu(h))`, the eager MLP's result exactly."""
    h = torch.randn(3, 2, 40)
    weight = torch.randn(8, 20)
    torch.testing.assert_close(gemv.linear(h, weight, None, _silu_gated), F.linear(_silu_gated(h), weight),
                               rtol=0, atol=0)
    layout, tensors = _stored("int4_wo", 8, 20, torch.float32)
    ours = kernels.quantized_linear(h, layout, *tensors, None, gated_silu=_silu_gated)
    theirs = kernels.quantized_linear(_silu_gated(h), layout, *tensors, None)
    assert ours.shape == (3, 2, 8)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_kernels_under_the_triton_interpreter():
    pytest.importorskip("triton")
    run_under_triton_interpreter(__file__)


@pytest.fixture
def interpreted():
    if not TRITON_INTERPRETED:
        pytest.skip("runs in the child pytest (TRITON_INTERPRET=1)")


@pytest.mark.parametrize("method", ["int8_wo", "int4_wo", "int4_awq"])
def test_quantized_kernels_compute_the_gate(interpreted, method):
    """The FMA tiles (1 and 5 rows, whole-K and split), the tensor-core tiles (float16: the interpreter's tl.dot
    lacks bfloat16) and for int4 the packed kernel, on an unaligned fc2-like shape with a bias."""
    for dtype, rows_list in ((torch.bfloat16, (1, 5)), (torch.float16, (3, 20))):
        layout, tensors = _stored(method, 40, 200, dtype)
        bias = torch.randn(40, dtype=dtype)
        for rows in rows_list:
            h = torch.randn(rows, 400, dtype=dtype, generator=torch.Generator().manual_seed(rows)) * 2
            reference = _reference(h, layout, tensors, bias)
            runs = {}
            if dtype == torch.bfloat16:
                for split in (1, 3):
                    config = {"BLOCK_N": 16, "BLOCK_K": 64, "SPLIT_K": split}
                    runs[f"fma split {split}"] = kernels.fused_linear(h, layout, *tensors, bias, config=config,
                                                                      gated=True)
            else:
                config = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "SPLIT_K": 2}
                runs["dot"] = kernels.fused_linear(h, layout, *tensors, bias, config=config, dot=True, gated=True)
                if layout.int4:
                    config = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 8 * layout.group, "SPLIT_K": 1}
                    runs["packed"] = kernels.packed_linear(h, layout, *tensors, bias, config=config, gated=True)
            for name, out in runs.items():
                assert out.shape == (rows, 40)
                error = relative_error(out, reference)
                assert error < 1e-2, f"{name}, {rows} rows: {error:.2e}"


def test_gemv_kernel_computes_the_gate(interpreted):
    """Triton's one-row kernel (one tile shape: the interpreter cannot autotune) against the activation apart."""
    h = torch.randn(1, 2 * 300, dtype=torch.bfloat16) * 2
    weight = (torch.randn(70, 300) / 300**0.5).to(torch.bfloat16)
    bias = torch.randn(70, dtype=torch.bfloat16)
    out = torch.empty(1, 70, dtype=torch.bfloat16)
    gemv._gemv_kernel[(gemv.triton.cdiv(70, 16),)](h.reshape(-1), weight, bias, out, 70, 300, HAS_BIAS=True,
                                                   GATED=True, BLOCK_N=16, BLOCK_K=128)
    reference = F.linear(_silu_gated(h.float()).to(torch.bfloat16).float(), weight.float(), bias.float())
    assert relative_error(out, reference) < 1e-2


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU and Triton")
@torch.inference_mode()
@pytest.mark.parametrize("method", [None, "int8_wo", "fp8", "int4_wo"])
def test_every_gated_candidate_on_the_gpu(method):
    """bfloat16 on LLaVA's fc2 (4096 x 11008) at 1 and 32 rows: each candidate with the gate within 1e-2 of the
    activation apart, then the float32 product (fp8's `_scaled_mm` 5e-2); bf16 weights through `gemv.linear`."""
    k, n = 11008, 4096
    generator = torch.Generator("cuda").manual_seed(0)
    for rows in (1, 32):
        h = torch.randn(rows, 2 * k, device="cuda", dtype=torch.bfloat16, generator=generator)
        if method is None:
            weight = (torch.randn(n, k, device="cuda", generator=generator) / k**0.5).to(torch.bfloat16)
            reference = F.linear(_silu_gated(h.float()).to(torch.bfloat16).float(), weight.float())
            outputs = {"linear": gemv.linear(h, weight, None, _silu_gated)}
            if rows == 1:
                outputs["triton"] = gemv._gemv(h, weight, None, True)
        else:
            layout, tensors = _stored(method, n, k, torch.bfloat16, "cuda")
            reference = _reference(h, layout, tensors, None)
            found = kernels.candidates(h, layout, *tensors, None, torch.cuda.get_device_capability(), _silu_gated)
            outputs = {name: run() for name, run in found.items()  # with the gate and after the activation
                       if name.removeprefix(gemv.ACTIVATION_FIRST) not in ("fused", "split", "packed_split")
                       or rows == 1}  # the autotuned FMA/split spaces compile for minutes: one row only
            outputs["chosen"] = kernels.quantized_linear(h, layout, *tensors, gated_silu=_silu_gated)
        for name, out in outputs.items():
            limit = 5e-2 if method == "fp8" and name in ("scaled_mm", "chosen") else 1e-2
            error = relative_error(out, reference)
            assert error < limit, f"{method} {name}, {rows} rows: {error:.2e}"
