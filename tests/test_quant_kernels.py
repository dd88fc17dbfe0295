"""The quantized Triton kernels, run on the CPU by Triton's interpreter, against dequantize-then-matmul.

Triton takes `TRITON_INTERPRET=1` into account only if it is set before Triton is imported, so in an ordinary
test run this file has one test, which runs this file again in a child pytest with the variable set; there the
kernel checks below are collected. Shapes: LLaVA-1.5-7B's layer shapes scaled down by 16, and unaligned ones
(odd N, K not a multiple of the group, K not a multiple of 32). Skipped without Triton.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from exporter.llm.config import QUANT_METHODS, QuantConfig  # noqa: E402
from exporter.llm.quant.formats import QuantLayout, dequantize, quantize  # noqa: E402
from support.decoding import relative_error  # noqa: E402
from support.kernels import TRITON_INTERPRETED, run_under_triton_interpreter  # noqa: E402

# (N, K): LLaVA's qkv, proj, fc1 [gate; up], fc2 over 16; then unaligned
LLAVA_SCALED = ((768, 256), (256, 256), (1376, 256), (256, 688))
UNALIGNED = ((37, 100), (33, 90), (65, 160))


@pytest.fixture(scope="module")
def kernels():
    if not TRITON_INTERPRETED:
        pytest.skip("runs in the child pytest (TRITON_INTERPRET=1)")
    from exporter.llm.quant import kernels

    return kernels


def test_kernels_under_the_triton_interpreter():
    run_under_triton_interpreter(__file__)


def _stored(method: str, n: int, k: int, dtype: torch.dtype, seed: int):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=generator) / k**0.5
    layout = QuantLayout.of(QuantConfig(method), n, k)
    channel_scale = torch.rand(k, generator=generator) * 4 + 0.25 if method == "int4_awq" else None
    stored = quantize(weight.to(dtype), layout, channel_scale)
    return layout, stored


def _reference(x: torch.Tensor, layout: QuantLayout, stored: dict, bias: torch.Tensor | None) -> torch.Tensor:
    """float32 dequantize-then-matmul, AWQ's input scale applied to x."""
    weight = dequantize(layout, stored["weight"], stored["weight_scale"], stored.get("weight_zero"))
    if "input_scale" in stored:
        x = x.float() * stored["input_scale"].float()
    return torch.nn.functional.linear(x.float(), weight, None if bias is None else bias.float())


def _tensors(stored: dict) -> tuple:
    return stored["weight"], stored["weight_scale"], stored.get("weight_zero"), stored.get("input_scale")


@pytest.mark.parametrize("method", QUANT_METHODS)
@pytest.mark.parametrize("shape", LLAVA_SCALED + UNALIGNED, ids=lambda s: f"{s[0]}x{s[1]}")
def test_decode_kernel_equals_dequantize_then_matmul(kernels, method, shape):
    """1..8 rows (FMA accumulation), unsplit and with K split over 2 or 3 programs (float32 partial sums, added
    by the slice that finishes last), bfloat16 activations, bias on the unaligned shapes."""
    n, k = shape
    layout, stored = _stored(method, n, k, torch.bfloat16, seed=n + k)
    bias = torch.randn(n, dtype=torch.bfloat16) if shape in UNALIGNED else None
    for rows, block_k, split in ((1, 128, 1), (3, 64, 1), (8, 256, 1), (1, 64, 3), (5, 32, 2)):
        x = torch.randn(rows, k, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(rows))
        config = {"BLOCK_N": 64, "BLOCK_K": block_k, "SPLIT_K": split}
        out = kernels.fused_linear(x, layout, *_tensors(stored), bias, config=config)
        assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
        error = relative_error(out, _reference(x, layout, stored, bias))
        assert error < 1e-2, f"{rows} rows: relative error {error:.2e}"


@pytest.mark.parametrize("method", QUANT_METHODS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_tensor_core_kernel_equals_dequantize_then_matmul(kernels, method, dtype):
    """Tensor-core tiles (tl.dot): more than 8 rows, and 3 (the `fused_mma` candidate), whole-K and split. The
    interpreter's tl.dot mishandles bfloat16 (numpy has none), so it is
    checked here in float32 and float16; tests/test_quant_gpu.py checks bfloat16 on the GPU."""
    for n, k in ((256, 688), (37, 100)):
        layout, stored = _stored(method, n, k, dtype, seed=k)
        bias = torch.randn(n, dtype=dtype)
        for rows, split in ((3, 1), (9, 1), (40, 1), (40, 3)):
            x = torch.randn(rows, k, dtype=dtype, generator=torch.Generator().manual_seed(rows))
            config = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128, "SPLIT_K": split}
            out = kernels.fused_linear(x, layout, *_tensors(stored), bias, config=config, dot=True)
            error = relative_error(out, _reference(x, layout, stored, bias))
            assert error < (1e-5 if dtype == torch.float32 else 1e-2), f"{n}x{k}, {rows} rows: {error:.2e}"


def test_a_split_product_finishes_in_one_kernel_and_leaves_its_tickets_at_zero(kernels):
    """K split over 3 slices: the slice that finishes a tile last adds the three partials (with the bias) in slice
    order, so two runs give the same bits; every ticket counter is back at zero after the product (a captured graph
    replays it with no zeroing kernel), and a product with more tiles grows the weight's counters, keeping the
    smaller ones (graphs captured earlier read them)."""
    layout, stored = _stored("int8_wo", 65, 160, torch.float32, seed=7)
    weight, bias = stored["weight"], torch.randn(65)
    x = torch.randn(2, 160, generator=torch.Generator().manual_seed(4))
    split = {"BLOCK_N": 16, "BLOCK_K": 32, "SPLIT_K": 3}
    first = kernels.fused_linear(x, layout, *_tensors(stored), bias, config=split)
    assert torch.equal(first, kernels.fused_linear(x, layout, *_tensors(stored), bias, config=split))
    assert relative_error(first, _reference(x, layout, stored, bias)) < 1e-5
    held = kernels._TICKETS[weight]
    assert len(held) == 1 and held[0].numel() >= 5 and not held[0].any()  # 5 output tiles of 16 rows
    kernels.fused_linear(x, layout, *_tensors(stored), bias, config=split | {"BLOCK_N": 1})
    assert [t.numel() >= n for t, n in zip(held, (5, 65), strict=True)] == [True, True]
    assert not held[1].any()


@pytest.mark.parametrize("method", QUANT_METHODS)
def test_device_dequantize_equals_the_reference(kernels, method):
    """Exact in float32; in bfloat16 within one rounding (the interpreter truncates where the GPU rounds)."""
    for n, k in ((256, 688), (33, 90)):
        layout, stored = _stored(method, n, k, torch.bfloat16, seed=3)
        weight, scale, zero, _ = _tensors(stored)
        for dtype, tolerance in ((torch.float32, 0.0), (torch.bfloat16, 2.0**-7)):
            ours = kernels.dequantize_on_device(layout, weight, scale, zero, dtype)
            reference = dequantize(layout, weight, scale, zero, dtype)
            torch.testing.assert_close(ours, reference, rtol=tolerance, atol=0)


def test_every_tile_shape_of_the_search_space_computes_the_same(kernels):
    """The autotuner may pick any configuration its pruning keeps: each one must be right (int4, where tiles meet
    groups and reach past the last one)."""
    layout, stored = _stored("int4_awq", 65, 160, torch.float16, seed=5)
    x = torch.randn(2, 160, dtype=torch.float16, generator=torch.Generator().manual_seed(2))
    reference = _reference(x, layout, stored, None)
    for split in (False, True):
        candidates = kernels._fits_registers(kernels._TUNED_KERNELS[False, split].configs, {}, BLOCK_M=2)
        assert len(candidates) > 5
        for config in candidates:
            out = kernels.fused_linear(x, layout, *_tensors(stored), None, config=dict(config.kwargs))
            assert relative_error(out, reference) < 1e-2, config
    x = torch.randn(20, 160, dtype=torch.float32, generator=torch.Generator().manual_seed(3))
    layout, stored = _stored("int4_wo", 65, 160, torch.float32, seed=6)
    reference = _reference(x, layout, stored, None)
    for config in kernels._TUNED_KERNELS[True, False].configs + kernels._TUNED_KERNELS[True, True].configs:
        out = kernels.fused_linear(x, layout, *_tensors(stored), None, config=dict(config.kwargs))
        assert relative_error(out, reference) < 1e-5, config


def test_packed_words_hold_each_group_in_one_nibble(kernels):
    """`pack_int4_words`: chunk c's word j holds column 8Gc + Gi + j in nibble i; the padding past K is zeros."""
    layout, stored = _stored("int4_wo", 5, 300, torch.float16, seed=1)  # group 32 (K padded to 320), chunks of 256
    q = torch.stack([stored["weight"] & 15, stored["weight"] >> 4], dim=-1).view(5, 320).int()
    words = kernels.pack_int4_words(layout, stored["weight"])
    assert words.dtype == torch.int32 and words.shape == (5, 512 // 8)
    nibbles = torch.stack([(words >> (4 * i)) & 15 for i in range(8)], dim=-1)  # [5, words, i]
    for c, i, j in ((0, 0, 0), (0, 7, 31), (1, 0, 5), (1, 1, 31), (0, 3, 17)):
        column = 256 * c + 32 * i + j
        assert nibbles[:, 32 * c + j, i].tolist() == (q[:, column] if column < 320 else torch.zeros(5)).tolist()
    assert nibbles[:, 32:, 2:].eq(0).all()  # columns 320 and on


@pytest.mark.parametrize("method", ["int4_wo", "int4_awq"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_packed_kernel_equals_dequantize_then_matmul(kernels, method, dtype):
    """The packed int4 tensor-core kernel (1 row padded to 16, 3 and 40 rows, whole-K and split, groups of 128, 64
    and 32, K not a multiple of a chunk or of the group) with a bias. bfloat16 is checked on the GPU
    (tests/test_quant_gpu.py): the interpreter's tl.dot mishandles it."""
    for n, k in LLAVA_SCALED[2:] + UNALIGNED[:2] + ((40, 1100),):
        layout, stored = _stored(method, n, k, dtype, seed=n * k)
        bias = torch.randn(n, dtype=dtype)
        for rows, split in ((1, 1), (1, 3), (3, 2), (40, 1), (40, 4)):
            x = torch.randn(rows, k, dtype=dtype, generator=torch.Generator().manual_seed(rows))
            config = {"BLOCK_M": 16 if rows < 40 else 32, "BLOCK_N": 32, "BLOCK_K": 8 * layout.group,
                      "SPLIT_K": split}
            out = kernels.packed_linear(x, layout, *_tensors(stored), bias, config=config)
            assert out.dtype == dtype and out.shape == (rows, n)
            error = relative_error(out, _reference(x, layout, stored, bias))
            assert error < (1e-5 if dtype == torch.float32 else 1e-2), f"{n}x{k}, {rows} rows, {split}: {error:.2e}"


def test_every_packed_tile_shape_of_the_search_space_computes_the_same(kernels):
    """Each configuration the pruning keeps for a group of 32 (chunks of 256 columns: several a tile)."""
    layout, stored = _stored("int4_wo", 65, 600, torch.float32, seed=7)
    x = torch.randn(20, 600, dtype=torch.float32, generator=torch.Generator().manual_seed(4))
    reference = _reference(x, layout, stored, None)
    for split in (False, True):
        configs = kernels._fits_packed(kernels._TUNED_PACKED[split].configs, {"G": layout.group}, M_BUCKET=32)
        assert len(configs) > 5
        for config in configs:
            out = kernels.packed_linear(x, layout, *_tensors(stored), None, config=dict(config.kwargs))
            assert relative_error(out, reference) < 1e-5, config
    # a group of 128: only whole chunks of 1024 columns
    assert all(config.kwargs["BLOCK_K"] % 1024 == 0
               for config in kernels._fits_packed(kernels._TUNED_PACKED[True].configs, {"G": 128}, M_BUCKET=32))


@pytest.mark.parametrize("shape", [(3, 4096), (2, 11008), (5, 100)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_fp8_row_quantization_equals_torch(kernels, shape):
    """The fused amax + scale kernel against the same steps in torch: equal scales and equal scaled values (taken
    before the e4m3 cast, which the interpreter does inexactly; tests/test_quant_gpu.py checks the cast)."""
    x = torch.randn(*shape, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(shape[1])) * 3
    x[0, 7] = 40.0  # one large value: the first row's scale comes from it
    scaled, scales = kernels.quantize_rows_fp8(x, torch.float32)
    expected_scales = x.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 448.0
    assert scales.shape == (shape[0], 1) and scaled[0, 7] == 448.0
    torch.testing.assert_close(scales, expected_scales, rtol=1e-6, atol=0)
    torch.testing.assert_close(scaled, (x.float() / expected_scales).clamp(-448.0, 448.0), rtol=1e-6, atol=0)


# (INT4, weight pointer type, DOT, SPLIT_K, BLOCK_M, BLOCK_N, BLOCK_K): one-row and 8-row FMA tiles, tensor-core tiles
HOPPER_CASES = [(True, "*i32", False, 1, 1, 16, 256), (True, "*i32", False, 4, 8, 4, 512),
                (True, "*i32", True, 2, 32, 64, 128), (False, "*i8", False, 1, 1, 8, 512),
                (False, "*fp8e4nv", True, 4, 32, 128, 128), (False, "*i8", True, 1, 32, 64, 256)]


@pytest.mark.parametrize("case", HOPPER_CASES, ids=lambda c: "-".join(map(str, c[:5])))
@pytest.mark.parametrize("dependent", [False, True], ids=["plain launch", "dependent launch"])
def test_kernel_compiles_for_hopper(case, dependent):
    """Compiled for sm_90 without a GPU (Triton's own ptxas): the GPU build, which the interpreter never runs,
    succeeds; an int8 or fp8 tensor-core tile multiplies on wgmma; an int4 tile's words keep the layout they are
    loaded in (no conversion inside the K loop) where the accumulator is 2-D; an int8 tile converts its weights
    by inline PTX, in byte pairs (tensor-core tiles) or in words (FMA tiles); launched as a dependent
    (`triton_launch`), its programs signal the next kernel and wait for the one before."""
    if TRITON_INTERPRETED:
        pytest.skip("compiles in the parent run")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from exporter.llm.quant import kernels

    int4, weight_type, dot, split, block_m, block_n, block_k = case
    pointers = {"x_ptr": "*bf16", "w_ptr": weight_type, "s_ptr": "*bf16", "z_ptr": "*bf16", "xs_ptr": "*bf16",
                "b_ptr": "*bf16", "y_ptr": "*bf16", "p_ptr": "*fp32", "c_ptr": "*i32"}
    sizes = dict.fromkeys(("M", "N", "K", "W_STRIDE", "NG", "M_BUCKET"), "i32")
    constants = {"INT4": int4, "G": 128 if int4 else 1, "HAS_INPUT_SCALE": int4, "HAS_BIAS": True,
                 "GATED": split == 4, "DOT": dot, "PRECISION": "tf32", "INT8_PTX": weight_type == "*i8",
                 "BLOCK_M": block_m, "BLOCK_N": block_n,
                 "BLOCK_K": block_k, "SPLIT_K": split, "PDL": dependent}
    signature = pointers | sizes | dict.fromkeys(constants, "constexpr")
    aligned = [i for i, name in enumerate(signature) if name.endswith("_ptr") or name in ("N", "K", "W_STRIDE")]
    source = ASTSource(fn=kernels._qlinear_kernel, signature=signature, constexprs=constants,
                       attrs={(i,): [["tt.divisibility", 16]] for i in aligned})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 3})
    assert ".entry _qlinear_kernel" in compiled.asm["ptx"]
    assert ("griddepcontrol.wait" in compiled.asm["ptx"]) == dependent
    assert ("griddepcontrol.launch_dependents" in compiled.asm["ptx"]) == dependent
    if dot and not int4:  # the weight tile is wgmma's register operand (`W x^T`), not mma.sync's
        assert "wgmma.mma_async" in compiled.asm["ptx"] and "mma.sync" not in compiled.asm["ptx"]
    if weight_type == "*i8":  # by byte pairs into bfloat16 (tensor cores) or by words into float32 (FMA)
        assert ("xor.b32 t, t, 0x8080;" if dot else "xor.b32 t, %r") in compiled.asm["ptx"]
        assert ("0x80808080" in compiled.asm["ptx"]) != dot
    if int4 and (dot or block_m == 1):
        loop = compiled.asm["ttgir"].split("scf.for", 1)[1].split("scf.yield", 1)[0]
        assert "xi32" not in "".join(line for line in loop.splitlines() if "convert_layout" in line)


@pytest.mark.parametrize("split, block_m, block_n", [(1, 16, 64), (4, 16, 64), (2, 32, 64)])
def test_packed_kernel_compiles_for_hopper(split, block_m, block_n):
    """The packed kernel compiled for sm_90 (the gate computed as x is read in one case): tensor-core products
    within the shared memory, and no layout conversion of the weight inside the K loop (each shifted word tile is the dot operand as loaded; AWQ's input scale vector may be converted)."""
    if TRITON_INTERPRETED:
        pytest.skip("compiles in the parent run")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from exporter.llm.quant import kernels

    pointers = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*bf16", "xs_ptr": "*bf16",
                "b_ptr": "*bf16", "y_ptr": "*bf16", "p_ptr": "*fp32", "c_ptr": "*i32"}
    sizes = dict.fromkeys(("M", "N", "K", "WORDS", "NG", "M_BUCKET"), "i32")
    constants = {"G": 128, "HAS_INPUT_SCALE": True, "HAS_BIAS": True, "GATED": split == 2, "PRECISION": "tf32",
                 "BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": 1024, "SPLIT_K": split, "PDL": True}
    signature = pointers | sizes | dict.fromkeys(constants, "constexpr")
    aligned = [i for i, name in enumerate(signature) if name.endswith("_ptr") or name in ("N", "K", "WORDS")]
    source = ASTSource(fn=kernels._packed_kernel, signature=signature, constexprs=constants,
                       attrs={(i,): [["tt.divisibility", 16]] for i in aligned})
    stages = 2 if block_m == 32 else 3  # 32 rows (and the gate's two loads) fill shared memory at 3 stages
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": 4, "num_stages": stages})
    assert "mma.sync" in compiled.asm["ptx"] and compiled.metadata.shared <= 228 * 1024
    loop = compiled.asm["ttgir"].split("scf.for", 1)[1].split("scf.yield", 1)[0]
    converted = [line for line in loop.splitlines() if "convert_layout" in line]
    assert not [line for line in converted if "xi32" in line or f"{block_n}x128x" in line or f"128x{block_n}x" in line]
