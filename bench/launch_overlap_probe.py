"""Does a one-row float8 product lose its time to each kernel's start, and does overlapping the starts win it back?

A batch-1 decode step runs four weight products a layer (qkv 12288x4096, o 4096x4096, fc1 22016x4096, fc2
4096x11008). On an H200 the small ones read their float8 weights at half the copy bandwidth. This probe replays
from a CUDA graph a chain of one-row float8 products shaped as the engine's (32 layers, each product reading the
previous one's output), with a plain Triton kernel of the engine's one-row kind, and times it:

- ``plain``: one kernel after the other, as the engine's captured steps run them;
- ``pdl``: launched with programmatic dependent launch, each kernel waiting for the previous one
  (``gdc_wait``) before it reads anything, so only the launch overlaps;
- ``pdl+early``: the same, each kernel letting the next one start as soon as it starts;
- ``pdl+early+prefetch``: and each program first asks the L2 cache for its weight rows (one bulk prefetch), before
  waiting for the previous kernel's output.

For the o-shaped chain it also tries tile shapes that put more of a program's bytes in flight at once. Each row:
the step's microseconds, per kernel, GB/s of weights and the share of the copy bandwidth measured in the same run,
and the largest difference from the plain chain's output (whose own error against torch's float32 products, relative
to the output's largest value, is recorded too). Writes ``$OUT/launch_overlap_probe.json``.

    python bench/launch_overlap_probe.py          # CUDA, sm_90 for the pdl modes; about 25 s on an H200
    python bench/launch_overlap_probe.py --tiny   # tiny shapes on the CPU under Triton's interpreter (plain only)
"""

from __future__ import annotations

import os
import sys

if "--tiny" in sys.argv:  # Triton reads this only when first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from llava_bench import copy_bandwidth, save_result  # noqa: E402

from exporter.llm.gemv import measure_ms  # noqa: E402

LAYERS = 32
LAYER_SHAPES = ((12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008))
TINY_SHAPES = ((96, 64), (64, 64), (160, 64), (64, 80))
DEFAULT_TILE = (4, 512, 4, 3)  # BLOCK_N, BLOCK_K, warps, stages: the engine's pick for fp8's o at one row (H200)
O_TILES = (DEFAULT_TILE, (2, 2048, 8, 3), (4, 2048, 8, 2), (2, 4096, 8, 1), (1, 4096, 4, 1), (8, 1024, 8, 2))
MODES = {"plain": (False, False, False), "pdl": (True, False, False), "pdl+early": (True, True, False),
         "pdl+early+prefetch": (True, True, True)}


@triton.jit
def _prefetch_to_l2(pointer, size):
    """One thread of the program asks the L2 cache for ``size`` bytes from ``pointer`` (16-byte aligned)."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .b32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [pointer, size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _row_product(x_ptr, w_ptr, y_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
                 EARLY: tl.constexpr, PREFETCH: tl.constexpr):
    """y[n] = sum_k W[n, k] x[k] for BLOCK_N rows, float32 FMAs (the engine's one-row kind)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    if PREFETCH:
        _prefetch_to_l2(w_ptr + tl.program_id(0) * BLOCK_N * K, BLOCK_N * K)
    if PDL:
        if EARLY:
            tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        col_ok = cols < K
        w = tl.load(w_ptr + rows[:, None] * K + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0,
                    eviction_policy="evict_first")
        x = tl.load(x_ptr + cols, mask=col_ok, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    tl.store(y_ptr + rows, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty), mask=row_ok)


def chain(weights: Sequence[torch.Tensor], x: torch.Tensor, tile: tuple, mode: str) -> tuple[Callable, list]:
    """A run of the products in order, each reading the previous output (its first K values), and the outputs."""
    block_n, block_k, warps, stages = tile
    pdl, early, prefetch = MODES[mode]
    outputs = [torch.empty(w.shape[0], device=x.device, dtype=x.dtype) for w in weights]
    launch = {"launch_pdl": True} if pdl else {}

    def run() -> None:
        h = x
        for w, y in zip(weights, outputs):
            n, k = w.shape
            _row_product[(triton.cdiv(n, block_n),)](h, w, y, n, k, BLOCK_N=block_n, BLOCK_K=block_k, PDL=pdl,
                                                     EARLY=early, PREFETCH=prefetch, num_warps=warps,
                                                     num_stages=stages, **launch)
            h = y
    return run, outputs


def step_us(run: Callable, device: torch.device) -> float:
    """Microseconds of one run as the engine times its candidates (`gemv.measure_ms`: replayed from a CUDA graph,
    the L2 cache evicted by a read before each), or 0 after one eager run on the CPU."""
    if device.type != "cuda":
        run()
        return 0.0
    return measure_ms(run) * 1e3


def run(tiny: bool) -> dict:
    device = torch.device("cpu" if tiny or not torch.cuda.is_available() else "cuda")
    pdl_ok = device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)
    modes = [mode for mode in MODES if mode == "plain" or pdl_ok]
    layers = 2 if tiny else LAYERS
    shapes = TINY_SHAPES if tiny else LAYER_SHAPES
    storage = torch.float32 if tiny else torch.float8_e4m3fn  # the interpreter has no float8 loads
    generator = torch.Generator(device).manual_seed(0)

    def weights(shape_list) -> list[torch.Tensor]:
        return [(torch.randn(n, k, device=device, generator=generator) / k**0.5).to(storage)
                for _ in range(layers) for n, k in shape_list]

    chains = {"o": (weights(shapes[1:2]), O_TILES[:2] if tiny else O_TILES),
              "layer": (weights(shapes), (DEFAULT_TILE,))}
    copy_gbps = copy_bandwidth(device, 1 << 20 if tiny else 1 << 28) * 1e3
    x = torch.randn(max(k for _, k in shapes), device=device, dtype=torch.float32 if tiny else torch.bfloat16,
                    generator=generator)
    rows = []
    for name, (chain_weights, tiles) in chains.items():
        weight_bytes = sum(w.numel() * w.element_size() for w in chain_weights)
        plain_run, plain_out = chain(chain_weights, x, DEFAULT_TILE, "plain")
        plain_run()
        reference = x.float()
        for w in chain_weights:
            reference = w.float() @ reference[: w.shape[1]].to(x.dtype).float()
        scale = reference.abs().max().item()
        reference_error = (plain_out[-1].float() - reference).abs().max().item() / scale
        for tile in tiles:
            for mode in modes:
                product, outputs = chain(chain_weights, x, tile, mode)
                us = step_us(product, device)
                difference = (outputs[-1].float() - plain_out[-1].float()).abs().max().item()
                rows.append({"chain": name, "kernels": len(chain_weights), "tile": tile, "mode": mode, "us": us,
                             "us_per_kernel": us / len(chain_weights),
                             "GBps": weight_bytes / us / 1e3 if us else 0.0,
                             "copy_fraction": weight_bytes / us / 1e3 / copy_gbps if us else 0.0,
                             "max_difference": difference, "plain_error_vs_torch": reference_error})
    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)",
            "triton": triton.__version__, "torch": torch.__version__, "copy_GBps": copy_gbps, "rows": rows}


def report(result: dict) -> str:
    lines = [f"{result['device']}, triton {result['triton']}, copy {result['copy_GBps']:.0f} GB/s",
             f"{'chain':6} {'tile (N, K, warps, stages)':27} {'mode':19} {'us':>8} {'us/kernel':>9} {'GB/s':>6} "
             f"{'copy':>5}  max diff"]
    for row in result["rows"]:
        lines.append(f"{row['chain']:6} {str(tuple(row['tile'])):27} {row['mode']:19} {row['us']:8.1f} "
                     f"{row['us_per_kernel']:9.2f} {row['GBps']:6.0f} {row['copy_fraction']:5.2f}  "
                     f"{row['max_difference']:.3g}")
    errors = {row["chain"]: row["plain_error_vs_torch"] for row in result["rows"]}
    lines.append("plain chain against torch's float32 products (largest error / largest value): "
                 + ", ".join(f"{name} {error:.1e}" for name, error in errors.items()))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU under Triton's interpreter")
    result = run(parser.parse_args().tiny)
    save_result("launch_overlap_probe", result)
    print(report(result))


if __name__ == "__main__":
    main()
