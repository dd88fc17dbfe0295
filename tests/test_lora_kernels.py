"""The per-row LoRA update (`exporter.llm.lora_layers.LoraSlots`): the batched products on the CPU and the Triton
kernels under Triton's interpreter, against a plain per-row loop of NeMo's `scale · B (A x)`.

Triton takes `TRITON_INTERPRET=1` into account only if it is set before Triton is imported, so the kernel checks
run in a child pytest of this file with the variable set (as in test_quant_kernels.py). Shapes: LLaVA-1.5-7B's
projections scaled down by 16 (QKV, dense, fc1 `[gate; up]`, fc2) and unaligned ones; rows mix slots of different
ranks with rows without an adapter.
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


@pytest.mark.parametrize("ranks", (RANKS, WIDE_RANKS))
@pytest.mark.parametrize("dtype", (torch.float32, torch.float16))
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_kernels_match_the_per_row_loop(interpreted, shape, dtype, ranks):
    """One token per row (decode); the kernels read each row's slot up to its rank; float16 rounds A x to
    float16 between the products, as NeMo's linear_in output is."""
    in_features, out_features = shape
    slots, adapters = _bank(in_features, out_features, dtype, seed=out_features, ranks=ranks)
    x = torch.randn(len(ROWS), 1, in_features).to(dtype)
    y = torch.randn(len(ROWS), 1, out_features).to(dtype)
    got = slots.kernels(y, x, torch.tensor(ROWS))
    assert got.dtype == dtype and got.shape == y.shape
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), _reference(y, x, ROWS, adapters), rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(got, slots.batched(y, x, torch.tensor(ROWS)), rtol=tolerance, atol=tolerance)
    assert torch.equal(got[0], y[0]) and torch.equal(got[5], y[5])


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
