"""The per-row LoRA update (`exporter.llm.lora_layers.LoraSlots`): the batched products on the CPU and the Triton
kernels under Triton's interpreter, against a plain per-row loop of NeMo's `scale · B (A x)`.

Triton takes `TRITON_INTERPRET=1` into account only if it is set before Triton is imported, so the kernel checks
run in a child pytest of this file with the variable set (as in test_quant_kernels.py). Shapes: LLaVA-1.5-7B's
projections scaled down by 16 (QKV, dense, fc1 `[gate; up]`, fc2) and unaligned ones; rows mix slots of different
ranks with rows without an adapter. The kernels are also compiled for the H100 (sm_90) here, without a GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from exporter.llm.lora_layers import LoraSlots

SHAPES = ((256, 768), (256, 256), (256, 1376), (688, 256), (100, 37), (1030, 300))  # (in, out)
RANKS = (8, 3, 5)  # slots 1..3 of a bank of rank 8
WIDE_RANKS = (64, 17, 40)  # a bank of rank 64: other tile sizes
ROWS = (0, 1, 2, 3, 1, 0, 2)
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _bank(in_features: int, out_features: int, dtype: torch.dtype, seed: int, ranks: tuple[int, ...] = RANKS):
    """Slots filled with random adapters of `ranks`, and the adapters themselves: slot -> (A, B, scale)."""
    generator = torch.Generator().manual_seed(seed)
    slots = LoraSlots(len(ranks), max(ranks), in_features, out_features, dtype, torch.device("cpu"))
    adapters = {}
    for slot, rank in enumerate(ranks, start=1):
        a = torch.randn(rank, in_features, generator=generator) / in_features**0.5
        b = torch.randn(out_features, rank, generator=generator)
        scale = 2.0 / slot
        slots.write(slot, a.to(dtype), b.to(dtype), scale)
        adapters[slot] = (a.to(dtype).float(), b.to(dtype).float(), scale)
    return slots, adapters


def _reference(y: torch.Tensor, x: torch.Tensor, rows: tuple[int, ...], adapters) -> torch.Tensor:
    """Row by row, in float64: y + scale · B (A x) for the row's adapter, y alone for slot 0."""
    out = y.double().clone()
    for row, slot in enumerate(rows):
        if slot:
            a, b, scale = adapters[slot]
            out[row] += scale * (b.double() @ (a.double() @ x[row].double().T)).T
    return out


@pytest.mark.parametrize("shape", SHAPES)
def test_batched_products_match_the_per_row_loop(shape):
    in_features, out_features = shape
    slots, adapters = _bank(in_features, out_features, torch.float32, seed=in_features)
    tokens = 3  # a prefill: every token of a row takes the row's adapter
    x = torch.randn(len(ROWS), tokens, in_features)
    y = torch.randn(len(ROWS), tokens, out_features)
    got = slots(y, x, torch.tensor(ROWS))
    torch.testing.assert_close(got.double(), _reference(y, x, ROWS, adapters), rtol=1e-5, atol=1e-5)
    assert torch.equal(got[0], y[0]) and torch.equal(got[5], y[5])  # no adapter: unchanged


def test_a_cleared_slot_adds_nothing():
    slots, _ = _bank(64, 32, torch.float32, seed=1)
    slots.write(2)
    x, y = torch.randn(2, 1, 64), torch.randn(2, 1, 32)
    assert torch.equal(slots(y, x, torch.tensor([2, 0])), y) and int(slots.ranks[2]) == 0


@pytest.fixture(scope="module")
def interpreted():
    if not INTERPRETED:
        pytest.skip("runs in the child pytest (TRITON_INTERPRET=1)")


@pytest.mark.parametrize("ranks", (RANKS, WIDE_RANKS, (16, 9, 16)))
@pytest.mark.parametrize("dtype", (torch.float32, torch.float16))
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_kernels_match_the_per_row_loop(interpreted, shape, dtype, ranks):
    """One token per row (decode); the kernels read each row's slot up to its rank and add into y in place;
    float16 rounds A x to float16 between the products, as NeMo's linear_in output is."""
    in_features, out_features = shape
    slots, adapters = _bank(in_features, out_features, dtype, seed=out_features, ranks=ranks)
    x = torch.randn(len(ROWS), 1, in_features).to(dtype)
    y = torch.randn(len(ROWS), 1, out_features).to(dtype)
    expected = _reference(y, x, ROWS, adapters)
    batched = slots.batched(y, x, torch.tensor(ROWS))
    base = y.clone()
    got = slots.kernels(y, x, torch.tensor(ROWS))
    assert got is y and got.dtype == dtype and got.shape == base.shape
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), expected, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(got, batched, rtol=tolerance, atol=tolerance)
    assert torch.equal(got[0], base[0]) and torch.equal(got[5], base[5])


@pytest.mark.parametrize("rows", (1, 17, 70))
def test_triton_kernels_over_row_blocks_and_tokens(interpreted, rows):
    """Blocks of rows (70 rows: two blocks of 64, the second partly empty), several tokens a row (a prefill,
    each token takes its row's slot), a block whose rows have no adapter left untouched."""
    slots, adapters = _bank(96, 200, torch.float32, seed=rows)
    chosen = tuple((row // 3) % 4 if row < 64 else 0 for row in range(rows))
    tokens = 2 if rows < 70 else 1
    x, y = torch.randn(rows, tokens, 96), torch.randn(rows, tokens, 200)
    expected = _reference(y, x, chosen, adapters)
    got = slots.kernels(y.clone(), x, torch.tensor(chosen))
    torch.testing.assert_close(got.double(), expected, rtol=1e-4, atol=1e-4)
    assert all(torch.equal(got[row], y[row]) for row, slot in enumerate(chosen) if not slot)


def test_triton_kernels_leave_rows_without_adapters_alone(interpreted):
    slots, _ = _bank(64, 48, torch.float16, seed=3)
    y = torch.randn(5, 1, 48).half()
    before = y.clone()
    assert torch.equal(slots.kernels(y, torch.randn(5, 1, 64).half(), torch.zeros(5, dtype=torch.long)), before)


def test_kernels_under_the_triton_interpreter():
    pytest.importorskip("triton")
    if INTERPRETED:
        pytest.skip("this is the child run")
    root = Path(__file__).resolve().parents[1]
    environment = {**os.environ, "TRITON_INTERPRET": "1",
                   "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    child = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__, "-k",
                            "triton_kernels"], cwd=root, env=environment, capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stdout[-6000:] + child.stderr[-2000:]
    assert " passed" in child.stdout and "failed" not in child.stdout and "skipped" not in child.stdout


@pytest.mark.parametrize("tokens", (1, 32, 544))
@pytest.mark.parametrize("rank", (16, 64))
def test_kernels_compile_for_the_h100(tokens, rank):
    """Both kernels build for sm_90 in bfloat16 at LLaVA-7B's widest projections (no GPU needed: Triton's own
    ptxas), with the block sizes `tiles` picks and the specialization a decode launch gets (one token a row,
    16-aligned pointers and sizes), so the CUDA path cannot fail to compile on the server; the shrink streams its
    inputs through shared memory (cp.async), and the expand issues the next slot's B during this slot's product."""
    pytest.importorskip("triton")
    if INTERPRETED:
        pytest.skip("compiles in the parent run")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler import compile as compile_kernel

    from exporter.llm.lora_kernels import _expand_kernel, _shrink_kernel, tiles

    target = GPUTarget("cuda", 90, 32)
    for depth, width in ((4096, 22016), (11008, 4096)):
        sizes = tiles(tokens, depth, rank)
        splits = -(-depth // sizes["K_PER_PROGRAM"])
        assert splits <= 8 and sizes["BLOCK_R"] >= rank
        shrink = {"T": 1, **{name: sizes[name] for name in ("BLOCK_M", "BLOCK_R", "BLOCK_K", "K_PER_PROGRAM")}}
        expand = {"T": 1, "SPLITS": splits, **{name: sizes[name] for name in ("BLOCK_M", "BLOCK_R", "BLOCK_N")}}
        for kernel, warps, arguments, constants in (
                (_shrink_kernel, sizes["shrink_warps"],
                 ("x_ptr:*bf16", "a_ptr:*bf16", "slot_ptr:*i64", "rank_ptr:*i32", "part_ptr:*fp32", "M:i32",
                  "K:i32", "T:i32", "R:i32"), shrink),
                (_expand_kernel, sizes["expand_warps"],
                 ("y_ptr:*bf16", "part_ptr:*fp32", "b_ptr:*bf16", "slot_ptr:*i64", "M:i32", "N:i32", "T:i32",
                  "R:i32", "S:i32"), expand)):
            signature = {name: "constexpr" if name in constants else kind
                         for name, kind in (argument.split(":") for argument in arguments)}
            signature.update({name: "constexpr" for name in constants})
            aligned = {(index,): [["tt.divisibility", 16]] for index, kind in enumerate(signature.values())
                       if kind != "constexpr" and list(signature)[index] != "S"}  # S: 4 slots
            built = compile_kernel(ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=aligned),
                                   target=target, options={"num_warps": warps})
            assert built.metadata.num_warps == warps and built.asm["cubin"]
            ptx = built.asm["ptx"]
            assert "cp.async" in ptx and ("mma.sync" in ptx or "wgmma" in ptx), (kernel, tokens, rank, depth)
