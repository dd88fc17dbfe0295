"""Programmatic dependent launch (`exporter.llm.triton_launch`): the decode step's Triton kernels compute the same
launched as dependents (their weight reads before the wait, the rest after it) as launched plainly.

On the CPU the kernels run under Triton's interpreter (a child pytest) with their dependent-launch code on and
off: the outputs must be equal bit for bit (the interpreter has no grid controls; the code around them is what
runs). On a CUDA GPU of compute capability 9 or later (skipped elsewhere): the compiled kernels hold the grid
controls, and a captured chain of products, norms and attention gives the same bits launched either way.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from exporter.llm import fused_triton, gemv, paged_triton, triton_launch
from exporter.llm.config import QuantConfig
from exporter.llm.quant import kernels
from exporter.llm.quant.formats import QuantLayout, quantize
from support.kernels import TRITON_INTERPRETED, run_under_triton_interpreter

HOPPER = (torch.cuda.is_available() and kernels.triton is not None
          and torch.cuda.get_device_capability()[0] >= 9)


def test_kernels_under_the_triton_interpreter():
    pytest.importorskip("triton")
    run_under_triton_interpreter(__file__)


@pytest.fixture
def interpreted():
    if not TRITON_INTERPRETED:
        pytest.skip("runs in the child pytest (TRITON_INTERPRET=1)")
    yield
    triton_launch.set_dependent_launch(None)


def _both_ways(run: Callable[[], torch.Tensor | tuple]) -> None:
    """``run()`` with dependent launches off, then on: the same bits."""
    results = []
    for on in (False, True):
        triton_launch.set_dependent_launch(on)
        assert triton_launch.dependent_launch(torch.device("cuda" if HOPPER else "cpu")) == on
        out = run()
        results.append(out if isinstance(out, tuple) else (out,))
    triton_launch.set_dependent_launch(None)
    for plain, dependent in zip(*results):
        assert torch.equal(plain, dependent)


def _stored(method: str, n: int, k: int, dtype: torch.dtype, device: str = "cpu"):
    generator = torch.Generator(device).manual_seed(n + k)
    weight = torch.randn(n, k, generator=generator, device=device) / k**0.5
    layout = QuantLayout.of(QuantConfig(method), n, k)
    stored = quantize(weight.to(dtype), layout)
    return layout, (stored["weight"], stored["weight_scale"], stored.get("weight_zero"))


def test_kernels_launch_as_dependents_where_the_gpu_has_them_unless_turned_off(monkeypatch):
    """On by default where the GPU has them; off when turned off (the environment variable or
    `set_dependent_launch`); never on the CPU outside the interpreter, even when asked; under the interpreter only
    when `set_dependent_launch` asks."""
    monkeypatch.delenv(triton_launch.ENVIRONMENT, raising=False)
    device = torch.device("cuda" if HOPPER else "cpu")
    assert triton_launch.dependent_launch(device) == (HOPPER and not TRITON_INTERPRETED)
    assert not triton_launch.dependent_launch(torch.device("cpu"))
    triton_launch.set_dependent_launch(False)
    try:
        assert not triton_launch.dependent_launch(device)
        triton_launch.set_dependent_launch(True)
        assert triton_launch.dependent_launch(torch.device("cpu")) == TRITON_INTERPRETED
        assert triton_launch.dependent_launch(device) == (HOPPER or TRITON_INTERPRETED)
    finally:
        triton_launch.set_dependent_launch(None)
    monkeypatch.setenv(triton_launch.ENVIRONMENT, "0")
    assert not triton_launch.dependent_launch(device)
    monkeypatch.setenv(triton_launch.ENVIRONMENT, "1")
    assert triton_launch.dependent_launch(device) == (HOPPER and not TRITON_INTERPRETED)


@pytest.mark.parametrize("k, gated", [(300, False), (300, True), (100, False)])
def test_the_one_row_kernel(interpreted, k, gated):
    """bfloat16 one-row products: several K tiles, the gate computed as x is read, K within the first tile."""
    weight = (torch.randn(70, k) / k**0.5).to(torch.bfloat16)
    x = torch.randn((2 if gated else 1) * k, dtype=torch.bfloat16)

    def run() -> torch.Tensor:
        out = torch.empty(70, dtype=torch.bfloat16)
        pdl = triton_launch.dependent_launch(x.device)
        gemv._gemv_kernel[(gemv.triton.cdiv(70, 16),)](x, weight, weight, out, 70, k, HAS_BIAS=False, GATED=gated,
                                                       BLOCK_N=16, BLOCK_K=128, PDL=pdl)
        return out

    _both_ways(run)


@pytest.mark.parametrize("method", ["int8_wo", "int4_wo"])
def test_the_quantized_kernels(interpreted, method):
    """FMA tiles of one and three rows, whole K and split (a split past K reads nothing), tensor-core tiles
    (float16: the interpreter's tl.dot lacks bfloat16) and for int4 the packed kernel, on an unaligned shape."""
    for dtype, rows, options in ((torch.bfloat16, 1, {"BLOCK_N": 8, "BLOCK_K": 64, "SPLIT_K": 1}),
                                 (torch.bfloat16, 1, {"BLOCK_N": 8, "BLOCK_K": 64, "SPLIT_K": 8}),
                                 (torch.bfloat16, 3, {"BLOCK_N": 16, "BLOCK_K": 64, "SPLIT_K": 2}),
                                 (torch.float16, 20, {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "SPLIT_K": 2})):
        layout, tensors = _stored(method, 40, 300, dtype)
        x = torch.randn(rows, 300, dtype=dtype, generator=torch.Generator().manual_seed(rows))
        _both_ways(lambda: kernels.fused_linear(x, layout, *tensors, config=options, dot="BLOCK_M" in options))
        if layout.int4 and "BLOCK_M" in options:
            packed = options | {"BLOCK_K": 8 * layout.group, "SPLIT_K": 1}
            _both_ways(lambda: kernels.packed_linear(x, layout, *tensors, config=packed))


def test_the_elementwise_kernels(interpreted):
    """The residual add and RMSNorm, the heads' split with RoPE and the cache write, SwiGLU."""
    generator = torch.Generator().manual_seed(0)
    x, delta = torch.randn(3, 64, generator=generator), torch.randn(3, 64, generator=generator)
    gamma = torch.randn(64, generator=generator)
    _both_ways(lambda: fused_triton.norm(x, delta, gamma, None, 1e-5, False))
    qkv = torch.randn(3, 2 * (2 + 2) * 16, generator=generator)
    angles = torch.randn(3, 16, generator=generator)
    positions = torch.tensor([0, 1, 2])

    def split() -> tuple:
        cache = torch.zeros(2, 1, 4, 2, 16)
        q, kv = fused_triton.split_heads(qkv, angles.cos(), angles.sin(), cache, torch.zeros(3, dtype=torch.long),
                                         positions, None, 2, 2, 16)
        return q, kv, cache

    _both_ways(split)
    h = torch.randn(3, 2 * 50, generator=generator)
    _both_ways(lambda: fused_triton.activate(h, "swiglu", True, "none"))


def test_the_attention_kernels(interpreted):
    """Decode rows with splits merged in place, and a prompt chunk, over a paged cache."""
    generator = torch.Generator().manual_seed(0)
    blocks, block_size, groups, dim = 9, 4, 2, 16
    k = torch.randn(blocks, block_size, groups, dim, generator=generator)
    v = torch.randn(blocks, block_size, groups, dim, generator=generator)
    tables = (torch.arange(8, dtype=torch.int32) + 1).view(2, 4)
    q = torch.randn(2, 4, dim, generator=generator)
    counters = torch.zeros(8, dtype=torch.int32)
    _both_ways(lambda: paged_triton.decode(q, k, v, tables, torch.tensor([5, 14]), None, 3, None, counters))
    tiles = torch.tensor([[0, 0, 6, 3], [1, 6, 4, 10]], dtype=torch.int32)
    chunk = torch.randn(10, 4, dim, generator=generator)
    _both_ways(lambda: paged_triton.chunk(chunk, k, v, tables, tiles, None, None))


@pytest.mark.skipif(not HOPPER, reason="needs a CUDA GPU of compute capability 9 or later and Triton")
@torch.inference_mode()
def test_a_captured_chain_gives_the_same_bits_launched_as_dependents():
    """bfloat16 on LLaVA's layer shapes: norm, qkv, o, the gated fc1 -> fc2 and an int8 product, captured in one
    CUDA graph each way; the compiled kernels hold the grid controls."""
    torch.manual_seed(0)
    device = torch.device("cuda")
    weights = [torch.randn(n, k, device=device, dtype=torch.bfloat16) / k**0.5
               for n, k in ((12288, 4096), (4096, 4096), (22016, 4096))]
    fc2 = torch.randn(4096, 11008, device=device, dtype=torch.bfloat16) / 11008**0.5
    layout, (w8, s8, _) = _stored("int8_wo", 4096, 4096, torch.bfloat16, "cuda")
    gamma = torch.randn(4096, device=device, dtype=torch.bfloat16)
    x = torch.randn(1, 4096, device=device, dtype=torch.bfloat16)

    def chain() -> torch.Tensor:
        _, h = fused_triton.norm(x, None, gamma, None, 1e-5, False)
        qkv = gemv._gemv(h, weights[0], None)
        o = gemv._gemv(qkv[:, :4096].contiguous(), weights[1], None)
        up = gemv._gemv(o, weights[2], None)
        down = gemv._gemv(up, fc2, None, gated=True)
        return kernels.fused_linear(down, layout, w8, s8)

    outputs = []
    for on in (False, True):
        triton_launch.set_dependent_launch(on)
        chain()  # compiled and tuned outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain()
        graph.replay()
        torch.cuda.synchronize()
        outputs.append(out.clone())
    triton_launch.set_dependent_launch(None)
    assert torch.equal(outputs[0], outputs[1])
    out = torch.empty(4096, device=device, dtype=torch.bfloat16)
    compiled = gemv._gemv_kernel[(256,)](x, weights[1], weights[1], out, 4096, 4096, HAS_BIAS=False, GATED=False,
                                        BLOCK_N=16, BLOCK_K=512, PDL=True, launch_pdl=True)
    assert compiled.metadata.launch_pdl
    assert "griddepcontrol.wait" in compiled.asm["ptx"] and "griddepcontrol.launch_dependents" in compiled.asm["ptx"]
