"""How a quantized product's kernel is chosen: the candidates each (method, rows, gated fc2) product has, fc2's
activation-first candidates (`act+<name>`: the activation kernel, then the plain kernel) and the choice among them.

The timer needs CUDA: here it is replaced by a table (`gemv.measure_ms`); the kernels' numbers run under Triton's
interpreter in a child pytest (`TRITON_INTERPRET=1`), and on a GPU `tests/test_quant_gpu.py` times for real.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from exporter.llm import gemv  # noqa: E402
from exporter.llm.config import QuantConfig  # noqa: E402
from exporter.llm.quant import kernels  # noqa: E402
from exporter.llm.quant.formats import QuantLayout, dequantize, quantize  # noqa: E402
from support.decoding import relative_error  # noqa: E402
from support.kernels import TRITON_INTERPRETED, run_under_triton_interpreter  # noqa: E402

HOPPER = (9, 0)


def _silu_gated(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def _stored(method: str, n: int, k: int, dtype: torch.dtype) -> tuple[QuantLayout, tuple]:
    generator = torch.Generator().manual_seed(n + k)
    weight = torch.randn(n, k, generator=generator) / k**0.5
    layout = QuantLayout.of(QuantConfig(method), n, k)
    channel = torch.rand(k, generator=generator) + 0.5 if method == "int4_awq" else None
    stored = quantize(weight.to(dtype), layout, channel)
    return layout, (stored["weight"], stored["weight_scale"], stored.get("weight_zero"), stored.get("input_scale"))


def _names(method: str, rows: int, gated: bool) -> set[str]:
    layout, tensors = _stored(method, 64, 256, torch.bfloat16)
    x = torch.zeros(rows, 512 if gated else 256, dtype=torch.bfloat16)
    return set(kernels.candidates(x, layout, *tensors, None, HOPPER, _silu_gated if gated else None))


def test_each_product_has_the_candidates_that_can_win_it():
    """int4: the packed kernel up to 64 rows, the word-tile kernel only as 2-to-8-row tensor-core tiles, tinygemm
    up to 8 rows, dequantize + cuBLAS alone above 64; gated fc2: each Triton kernel also after the activation."""
    assert _names("int4_wo", 1, False) == {"dequant", "packed", "packed_split", "tinygemm"}
    assert _names("int4_wo", 8, False) == {"dequant", "fused_mma", "split_mma", "packed", "packed_split", "tinygemm"}
    assert _names("int4_awq", 32, False) == {"dequant", "packed", "packed_split"}
    assert _names("int4_wo", 608, False) == {"dequant"}
    assert _names("int4_wo", 32, True) == {"dequant", "packed", "packed_split", "act+packed", "act+packed_split"}
    assert _names("int8_wo", 1, True) == {"dequant", "fused", "split", "act+fused", "act+split"}
    assert _names("int8_wo", 608, True) == {"dequant", "fused", "act+fused"}
    assert _names("fp8", 32, True) == {"dequant", "fused", "split", "act+fused", "act+split", "scaled_mm"}


@pytest.fixture
def timings(monkeypatch):
    """No choices made yet, and a timer reading each candidate's time from a table (by the name it returns)."""
    monkeypatch.setattr(gemv, "_CHOICES", {})
    monkeypatch.setattr(gemv, "_KNOWN", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # a CPU build cannot ask
    table: dict[str, float] = {}
    timed: list[str] = []

    def fake_measure(run):
        name = run()
        timed.append(name)
        return table[name]

    monkeypatch.setattr(gemv, "measure_ms", fake_measure)
    return table, timed


def _named(names: set[str]) -> dict:
    return {name: (lambda name=name: name) for name in names}


def test_gated_fc2_takes_the_activation_kernel_first_where_that_is_faster(timings):
    table, timed = timings
    names = _names("int8_wo", 32, True)
    table.update({"dequant": 0.09, "fused": 0.05, "split": 0.045, "act+fused": 0.04, "act+split": 0.035})
    assert gemv.fastest(("int8_wo", 4096, 11008, "a"), _named(names), "dequant") == "act+split"
    table.update({"split": 0.03})  # computing the gate in the kernel is faster: taken
    assert gemv.fastest(("int8_wo", 4096, 11008, "b"), _named(names), "dequant") == "split"
    assert sorted(timed) == sorted(2 * list(names))
    assert gemv.choices() == {"int8_wo 4096 11008 a": "act+split", "int8_wo 4096 11008 b": "split"}


def test_a_lone_candidate_is_not_timed(timings):
    _, timed = timings
    assert gemv.fastest(("int4_wo", 4096, 4096, 608), _named(_names("int4_wo", 608, False)), "dequant") == "dequant"
    assert timed == []


@pytest.mark.parametrize(("copy", "choice", "kept"), [("packed", "act+packed_split", True),
                                                     ("scaled_mm", "scaled_mm", True), ("scaled_mm", "fused", False)])
def test_a_copy_stays_where_a_reader_won(monkeypatch, copy, choice, kept):
    """`act+packed_split` reads the packed copy as `packed_split` does, `scaled_mm` its float32 scales: the copy
    made while timing stays where its reader was chosen and goes where another candidate was."""
    weight = torch.zeros(4, 8, dtype=torch.uint8)
    key = ("int4_wo", 4, 16, 32, torch.bfloat16, 1, "gated")
    monkeypatch.setattr(gemv, "_CHOICES", {key: choice})
    monkeypatch.setitem(kernels._COPIES, copy, type(kernels._COPIES[copy])())
    monkeypatch.setitem(kernels._COPIES_KEPT, copy, type(kernels._COPIES_KEPT[copy])())
    kernels._COPIES[copy][weight] = ("copy",)
    kernels._settle_copies(weight, key)
    assert (weight in kernels._COPIES[copy]) is kept and (weight in kernels._COPIES_KEPT[copy]) is kept


def test_kernels_under_the_triton_interpreter():
    run_under_triton_interpreter(__file__)


@pytest.mark.parametrize("method", ["int8_wo", "int4_awq"])
def test_activation_first_candidates_equal_the_gated_kernels(method):
    """Under the interpreter (one tile shape each: it cannot autotune): each kernel after the activation equals the
    same kernel computing the gate, and float32 dequantize-then-matmul of the activation rounded to h's dtype."""
    if not TRITON_INTERPRETED:
        pytest.skip("runs in the child pytest (TRITON_INTERPRET=1)")
    dtype = torch.float16  # the interpreter's tl.dot lacks bfloat16
    layout, tensors = _stored(method, 40, 200, dtype)
    options = dict(layout=layout, weight=tensors[0], scale=tensors[1], zero=tensors[2], input_scale=tensors[3])
    products = {"split": lambda x, gated=False: kernels.fused_linear(
        x, **options, config={"BLOCK_N": 16, "BLOCK_K": 64, "SPLIT_K": 2}, dot=False, gated=gated)}
    if layout.int4:
        products["packed_dot"] = lambda x, gated=False: kernels.packed_linear(
            x, **options, config={"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 8 * layout.group}, gated=gated)
    else:
        products["dot"] = lambda x, gated=False: kernels.fused_linear(
            x, **options, config={"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64}, dot=True, gated=gated)
    for rows in (1, 20):
        h = torch.randn(rows, 400, dtype=dtype, generator=torch.Generator().manual_seed(rows)) * 2
        x = _silu_gated(h.float()).to(dtype).float()
        if tensors[3] is not None:
            x = x * tensors[3].float()
        reference = F.linear(x, dequantize(layout, *tensors[:3]))
        first = gemv.activation_first(products, h, _silu_gated)
        for name, product in products.items():
            gated, after = product(h, gated=True), first[gemv.ACTIVATION_FIRST + name]()
            assert after.shape == gated.shape == (rows, 40)
            assert relative_error(after, reference) < 1e-2, name
            assert relative_error(after, gated) < 1e-2, name
