"""Every candidate kernel of the quantized products, on each LLaVA-1.5-7B linear shape, timed alone.

For each method (int8_wo, fp8, int4_wo, int4_awq), each weight shape (qkv 12288x4096, o 4096x4096, fc1
22016x4096, fc2 4096x11008, lm_head 32000x4096) and rows in (1, 8, 32, 608): the milliseconds of bf16 cuBLAS
(the baseline), of every candidate `exporter.llm.quant.kernels.quantized_linear` chooses among (`fused`, `split`,
`fused_mma`, `split_mma`, `packed`, `packed_split`, `dequant`, `tinygemm`, `scaled_mm`, those that apply), and of the fastest three tile shapes of each autotuned
kernel (from its own tuning run), each as ms, GB/s (stored weight bytes over the time) and the fraction of the
copy bandwidth measured in the same run; each candidate's relative error against float32 dequantize-then-matmul
too. Timings replay a CUDA graph of the product (launch overhead left out, as in the engine's captured decode
steps). Prints a table and writes ``$OUT/quant_kernel_probe.json``.

    python bench/quant_kernel_probe.py                   # on a CUDA GPU: everything (about 3 minutes on an H100)
    python bench/quant_kernel_probe.py --methods int4_wo --rows 1 32
    python bench/quant_kernel_probe.py --tiny            # tiny shapes on the CPU under Triton's interpreter

A time budget (``--budget-s``, 220 s by default) stops the run early, keeping what was measured, so it ends
unattended in time.
"""

from __future__ import annotations

import os
import sys

if "--tiny" in sys.argv:  # Triton reads this only when first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse  # noqa: E402
import functools  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from llava_bench import copy_bandwidth, save_result  # noqa: E402

from exporter.llm import gemv  # noqa: E402
from exporter.llm.config import QUANT_METHODS, QuantConfig  # noqa: E402
from exporter.llm.model import _activate  # noqa: E402
from exporter.llm.quant import kernels  # noqa: E402
from exporter.llm.quant.formats import QuantLayout, dequantize, quantize  # noqa: E402

SHAPES = {"qkv": (12288, 4096), "o": (4096, 4096), "fc1": (22016, 4096), "fc2": (4096, 11008),
          "fc2_gated": (4096, 11008), "lm_head": (32000, 4096)}
# shapes whose input is a SwiGLU MLP's `[gate; up]` (twice K wide): fc2 as the engine runs it, its candidates
# computing silu(gate) * up as they read it and (`act+` names) after the activation kernel
GATED = {"fc2_gated"}
ROWS = (1, 8, 32, 608)
TINY_SHAPES = {"qkv": (96, 64), "fc2": (40, 100), "fc2_gated": (40, 100)}
TINY_ROWS = (1, 9)
TOP_CONFIGS = 3
# candidate -> rows -> the autotuned kernel it runs
TUNED = {"fused": lambda rows: kernels._TUNED_KERNELS[rows > kernels.DECODE_ROWS, False],
         "split": lambda rows: kernels._TUNED_KERNELS[rows > kernels.DECODE_ROWS, True],
         "fused_mma": lambda rows: kernels._TUNED_KERNELS[True, False],
         "split_mma": lambda rows: kernels._TUNED_KERNELS[True, True],
         "packed": lambda rows: kernels._TUNED_PACKED[False], "packed_split": lambda rows: kernels._TUNED_PACKED[True]}


def gated_silu(h: torch.Tensor) -> torch.Tensor:
    """The engine's SwiGLU activation kernel on `[gate; up]` rows."""
    return _activate(h, "swiglu", True, "none")


def candidates(x, layout, tensors, gated: bool) -> dict:
    """The products `quantized_linear` chooses among for this input, by name (`gated`: x is `[gate; up]`). Under
    the interpreter (which cannot autotune: it times nothing) the reference and the fused kernel whole-K and
    split, and for int4 the packed kernel whole-K and split, at their spaces' first tile shape (gated: each also
    after the activation, as `act+<name>`)."""
    activation = gated_silu if gated else None
    if x.is_cuda:
        return kernels.candidates(x, layout, *tensors, None, torch.cuda.get_device_capability(x.device), activation)
    products = {}
    for name, split in (("fused", False), ("split", True)):
        config = dict(kernels._TUNED_KERNELS[x.shape[0] > kernels.DECODE_ROWS, split].configs[0].kwargs)
        products[name] = functools.partial(kernels.fused_linear, layout=layout, weight=tensors[0], scale=tensors[1],
                                           zero=tensors[2], input_scale=tensors[3], config=config, split=split)
    if layout.int4:
        for name, split in (("packed", False), ("packed_split", True)):
            config = dict(kernels._TUNED_PACKED[split].configs[0].kwargs)
            products[name] = functools.partial(kernels.packed_linear, layout=layout, weight=tensors[0],
                                               scale=tensors[1], zero=tensors[2], input_scale=tensors[3],
                                               config=config, split=split)
    found = {"dequant": lambda: kernels.reference_linear(gated_silu(x) if gated else x, layout, *tensors)}
    found.update({name: functools.partial(product, x, gated=gated) for name, product in products.items()})
    if gated:
        found.update(gemv.activation_first(products, x, gated_silu))
    return found


def timed_ms(run, device: torch.device) -> float:
    """Milliseconds of one run: on CUDA as the engine times its candidates (`gemv.measure_ms`: replayed from a CUDA
    graph, the L2 cache overwritten before each run, after one eager run, which tunes and packs), on the CPU one
    wall-clock run."""
    if device.type == "cuda":
        return gemv.measure_ms(run)
    start = time.perf_counter()
    run()
    return (time.perf_counter() - start) * 1e3


def tuned_configs(kernel) -> list[dict]:
    """The fastest tile shapes of the autotuned kernel's most recent tuning run (its timings of each config)."""
    timings = getattr(kernel, "configs_timings", None) or {}
    ranked = sorted(timings.items(), key=lambda item: _first(item[1]))[:TOP_CONFIGS]
    return [{"config": {**config.kwargs, "warps": config.num_warps, "stages": config.num_stages},
             "ms": _first(times)} for config, times in ranked]


def _first(times) -> float:
    return float(times[0] if isinstance(times, (list, tuple)) else times)


def probe_shape(method: str, name: str, n: int, k: int, rows_list, device, dtype, copy_gbps: float,
                generator) -> list[dict]:
    layout = QuantLayout.of(QuantConfig(method), n, k)
    weight = torch.randn(n, k, device=device, dtype=dtype, generator=generator) / k**0.5
    channel = torch.rand(k, device=device, generator=generator) + 0.5 if method == "int4_awq" else None
    stored = quantize(weight, layout, channel)
    tensors = (stored["weight"], stored["weight_scale"], stored.get("weight_zero"), stored.get("input_scale"))
    weight_bytes = sum(t.numel() * t.element_size() for t in stored.values())
    dense = dequantize(layout, *tensors[:3])
    rows_out = []
    gated = name in GATED
    for rows in rows_list:
        x = torch.randn(rows, 2 * k if gated else k, device=device, dtype=dtype, generator=generator)
        activated = gated_silu(x) if gated else x
        scaled = activated.float() * tensors[3].float() if tensors[3] is not None else activated.float()
        reference = scaled @ dense.T
        row = {"method": method, "shape": name, "N": n, "K": k, "rows": rows, "weight_MB": weight_bytes / 1e6,
               "candidates": {}}
        bf16_weight = weight.to(dtype)
        row["bf16_cublas_ms"] = timed_ms(lambda: F.linear(gated_silu(x) if gated else x, bf16_weight), device)
        for candidate, run in candidates(x, layout, tensors, gated).items():
            ms = timed_ms(run, device)
            error = ((run().float() - reference).norm() / reference.norm()).item()
            entry = {"ms": ms, "GBps": weight_bytes / ms / 1e6, "copy_fraction": weight_bytes / ms / 1e6 / copy_gbps,
                     "relative_error": error}
            tuned = candidate.removeprefix(gemv.ACTIVATION_FIRST)
            if tuned in TUNED:
                entry["best_configs"] = tuned_configs(TUNED[tuned](rows))
            row["candidates"][candidate] = entry
        best = min(row["candidates"], key=lambda c: row["candidates"][c]["ms"])
        row["best"], row["best_ms"] = best, row["candidates"][best]["ms"]
        rows_out.append(row)
    return rows_out


def run(tiny: bool, methods: list[str], rows_list: list[int], budget_s: float) -> dict:
    device = torch.device("cpu" if tiny or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16  # the interpreter's tl.dot lacks bfloat16
    copy_gbps = copy_bandwidth(device, 1 << 20 if tiny else 1 << 28) * 1e3
    shapes = TINY_SHAPES if tiny else SHAPES
    rows_list = TINY_ROWS if tiny else rows_list
    start, results, skipped = time.perf_counter(), [], []
    generator = torch.Generator(device).manual_seed(0)
    for method in methods:
        for name, (n, k) in shapes.items():
            if time.perf_counter() - start > budget_s:
                skipped.append(f"{method} {name}")
                continue
            results.extend(probe_shape(method, name, n, k, rows_list, device, dtype, copy_gbps, generator))
    return {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (Triton interpreter)",
            "dtype": str(dtype), "copy_GBps": copy_gbps, "rows": list(rows_list), "results": results,
            "skipped_over_budget": skipped, "seconds": time.perf_counter() - start}


def report(summary: dict) -> str:
    lines = [f"quantized kernel probe on {summary['device']} ({summary['dtype']}), copy bandwidth "
             f"{summary['copy_GBps']:.0f} GB/s; per candidate: ms / GB/s / fraction of copy bandwidth",
             f"{'method':9} {'shape':8} {'rows':>4} {'bf16 ms':>8}  candidates (best first)"]
    for row in summary["results"]:
        ranked = sorted(row["candidates"].items(), key=lambda item: item[1]["ms"])
        cells = "  ".join(f"{name} {c['ms']:.4f}/{c['GBps']:.0f}/{c['copy_fraction']:.0%}" for name, c in ranked)
        lines.append(f"{row['method']:9} {row['shape']:8} {row['rows']:>4} {row['bf16_cublas_ms']:>8.4f}  {cells}")
    for method in dict.fromkeys(row["method"] for row in summary["results"]):
        for rows in summary["rows"]:
            chosen = [r for r in summary["results"] if r["method"] == method and r["rows"] == rows]
            lines.append(f"{method} at {rows} rows: one step's products (32 layers' qkv+o+fc1+fc2 (gated where "
                         f"measured), lm_head) "
                         f"{_step_ms(chosen):.3f} ms best vs {_step_ms(chosen, 'bf16_cublas_ms'):.3f} ms bf16")
    errors: dict[str, float] = {}
    for row in summary["results"]:
        for name, candidate in row["candidates"].items():
            errors[name] = max(errors.get(name, 0.0), candidate["relative_error"])
    lines.append("largest relative error against float32 dequantize-then-matmul: "
                 + ", ".join(f"{name} {error:.1e}" for name, error in errors.items()))
    if summary["skipped_over_budget"]:
        lines.append(f"not measured (over the time budget): {', '.join(summary['skipped_over_budget'])}")
    lines.append(f"{summary['seconds']:.0f} s")
    return "\n".join(lines)


def _step_ms(rows: list[dict], field: str = "best_ms") -> float:
    """A decode step's products from the per-shape times: 32 layers of the four quantized ones (fc2 reading
    `[gate; up]` where it was measured, as the engine runs it), and the output head once in bf16 (the engine does
    not quantize it)."""
    shapes = {r["shape"] for r in rows}
    left_out = {"fc2"} if GATED & shapes else set()
    return sum(r["bf16_cublas_ms"] if r["shape"] == "lm_head" else r[field] * 32
               for r in rows if r["shape"] not in left_out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU under Triton's interpreter")
    parser.add_argument("--methods", nargs="+", choices=QUANT_METHODS, default=list(QUANT_METHODS))
    parser.add_argument("--rows", nargs="+", type=int, default=list(ROWS))
    parser.add_argument("--budget-s", type=float, default=220.0, help="stop starting new shapes after this")
    args = parser.parse_args()
    if kernels.triton is None:
        raise SystemExit("the probe needs Triton")
    summary = run(args.tiny, args.methods, args.rows, args.budget_s)
    save_result("quant_kernel_probe", summary)
    print(report(summary))


if __name__ == "__main__":
    main()
