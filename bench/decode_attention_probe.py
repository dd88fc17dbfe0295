"""The paged decode-attention kernel alone, bfloat16 against float8 KV: how near the copy bandwidth it reads the cache.

Issue 14 asks a 64- and a 128-row decode step for at least 80% of its roofline (weights plus the KV bytes its rows
attend), and float8 KV for a 128-row step at least 30% shorter than with bfloat16 KV. A step's attention reads
each row's keys and values once. This probe times `paged_triton.decode` alone on LLaVA-7B's layer (32 heads of 128,
blocks of 32 positions, the pool head-major as the engine's), every row at `--context` positions (672: a
608-position image prompt halfway through 128 new tokens), at each row count:

- with the engine's split count (`cuda_graphs.decode_splits`) and the merge in place (the cache's counters);
- its configurations autotuned as the engine's first call of that kind tunes them;
- timed as the engine times its candidates (`gemv.measure_ms`: replayed from a CUDA graph, the L2 cache evicted
  by a read before each call).

Each row of the table: microseconds a call, the cache bytes read over that time as a share of the copy bandwidth
measured in the same run, float8's time against bfloat16's, the configuration kept, and float8's largest error
against bfloat16's output (the same values stored as e4m3 with one scale per (keys or values, head), as the
engine's calibration makes them). Writes ``$OUT/decode_attention_probe.json``.

    python bench/decode_attention_probe.py                           # CUDA (float8 from sm_89); under a minute
    python bench/decode_attention_probe.py --rows 16 --context 16000
    python bench/decode_attention_probe.py --rows 64 128 --splits 1 2 4   # other split counts than the engine's
    python bench/decode_attention_probe.py --tiny     # tiny float32 shapes on the CPU under Triton's interpreter
"""

from __future__ import annotations

import os
import sys

if "--tiny" in sys.argv:  # Triton reads this only when first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import torch  # noqa: E402
from llava_bench import copy_bandwidth, save_result  # noqa: E402
from torch import Tensor  # noqa: E402

from exporter.llm import paged_triton  # noqa: E402
from exporter.llm.gemv import measure_ms  # noqa: E402
from exporter.llm.paged_attention import FP8_DTYPE, PagedKVCache, kv_scales_from_amax  # noqa: E402
from exporter.runtime.cuda_graphs import decode_splits  # noqa: E402

ROWS = (1, 16, 64, 128)
CONTEXT = 672


@dataclass(frozen=True)
class Shape:
    """One layer's attention: query heads, KV heads, head size, positions a block, the queries' dtype."""

    heads: int
    kv_heads: int
    dim: int
    block_size: int
    dtype: torch.dtype


LLAVA = Shape(heads=32, kv_heads=32, dim=128, block_size=32, dtype=torch.bfloat16)
TINY = Shape(heads=4, kv_heads=2, dim=16, block_size=4, dtype=torch.float32)


def make_caches(shape: Shape, blocks: int, fp8: bool, device: torch.device) -> dict[str, PagedKVCache]:
    """One layer of random keys and values over ``blocks`` blocks, stored head-major as the engine's pool is: in
    the queries' dtype, and (``fp8``) the same values as e4m3 over per-(keys or values, head) scales."""
    generator = torch.Generator(device).manual_seed(0)
    values = torch.randn(1, 2, blocks, shape.kv_heads, shape.block_size, shape.dim, device=device,
                         generator=generator, dtype=shape.dtype)
    caches = {str(shape.dtype).removeprefix("torch."): PagedKVCache(values.transpose(3, 4))}
    if fp8:
        scales = kv_scales_from_amax(values.abs().amax(dim=(2, 4, 5)))  # [1, 2, kv_heads]
        stored = (values.float() / scales[:, :, None, :, None, None]).to(FP8_DTYPE)
        caches["float8"] = PagedKVCache(stored.transpose(3, 4), scales)
    return caches


def decode_inputs(shape: Shape, rows: int, context: int, blocks: int,
                  device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """Queries ``[rows, heads, dim]``, block tables (each row's own blocks, shuffled over the pool) and positions
    (the last of ``context``)."""
    generator = torch.Generator().manual_seed(rows)
    per_row = -(-context // shape.block_size)
    tables = (torch.randperm(blocks - 1, generator=generator)[: rows * per_row] + 1).view(rows, per_row)
    q = torch.randn(rows, shape.heads, shape.dim, generator=generator).to(device, shape.dtype)
    positions = torch.full((rows,), context - 1, dtype=torch.long)
    return q, tables.to(device, torch.int32), positions.to(device)


def kept_config(shape: Shape, fp8: bool) -> str:
    """The configuration the decode kernel's autotuner kept last (its only one under the interpreter)."""
    tuned = paged_triton.decode_kernel(fp8, shape.heads // shape.kv_heads)
    config = getattr(tuned, "best_config", None) or tuned.configs[0]
    return " ".join(f"{name}={value}" for name, value in config.kwargs.items()) + \
        f" warps={config.num_warps} stages={config.num_stages}"


def probe(shape: Shape, rows_list: list[int], context: int, tiny: bool, split_counts: list[int] | None = None) -> dict:
    device = torch.device("cpu" if tiny else "cuda")
    fp8 = tiny or torch.cuda.get_device_capability(device) >= (8, 9)  # the interpreter loads float8 too
    per_row = -(-context // shape.block_size)
    blocks = max(max(rows_list) * per_row, paged_triton.TUNE_MIN_BLOCKS) + 1
    caches = make_caches(shape, blocks, fp8, device)
    copy_gbps = copy_bandwidth(device, 1 << 20 if tiny else 1 << 28) * 1e3
    results = []
    for rows, splits in [(rows, splits) for rows in rows_list
                         for splits in split_counts or [decode_splits(rows, shape.kv_heads, device)]]:
        q, tables, positions = decode_inputs(shape, rows, context, blocks, device)
        outputs = {}
        for name, cache in caches.items():
            k, v, scales = cache.layer(0)

            def call(k=k, v=v, scales=scales, cache=cache) -> Tensor:
                return paged_triton.decode(q, k, v, tables, positions, scales, splits, None, cache.counters)

            outputs[name] = call().float()
            if tiny:
                began = time.perf_counter()
                call()
                us = (time.perf_counter() - began) * 1e6
            else:
                us = measure_ms(call) * 1e3
            read = 2 * rows * context * shape.kv_heads * shape.dim * k.element_size()
            results.append(dict(kv=name, rows=rows, context=context, splits=splits, us=round(us, 2),
                                GBps=round(read / us / 1e3, 1), copy_fraction=round(read / us / 1e3 / copy_gbps, 3),
                                config=kept_config(shape, scales is not None)))
        if "float8" in outputs:
            reference = outputs[str(shape.dtype).removeprefix("torch.")]
            error = (outputs["float8"] - reference).abs().max().item() / reference.abs().max().item()
            results[-1]["error_vs_16bit"] = round(error, 5)
            results[-1]["time_vs_16bit"] = round(results[-1]["us"] / results[-2]["us"], 3)
    return dict(device=torch.cuda.get_device_name(device) if not tiny else "cpu (interpreter)",
                copy_GBps=round(copy_gbps, 1), shape=str(shape), rows=results)


def report(result: dict) -> str:
    lines = [f"{result['device']}, copy {result['copy_GBps']} GB/s",
             f"{'kv':<9}{'rows':>5}{'context':>8}{'splits':>7}{'us':>10}{'GB/s':>9}{'copy':>6}{'vs 16-bit':>10}"
             f"{'error':>9}  config"]
    for row in result["rows"]:
        lines.append(f"{row['kv']:<9}{row['rows']:>5}{row['context']:>8}{row['splits']:>7}{row['us']:>10.2f}"
                     f"{row['GBps']:>9.1f}{row['copy_fraction']:>6.2f}{row.get('time_vs_16bit', ''):>10}"
                     f"{row.get('error_vs_16bit', ''):>9}  {row['config']}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rows", nargs="+", type=int, default=list(ROWS))
    parser.add_argument("--context", type=int, default=CONTEXT, help="positions of every row")
    parser.add_argument("--splits", nargs="+", type=int,
                        help="split counts to time at each row count (default: the engine's, decode_splits)")
    parser.add_argument("--tiny", action="store_true", help="tiny float32 shapes on the CPU under Triton's interpreter")
    arguments = parser.parse_args()
    tiny = arguments.tiny
    result = probe(TINY if tiny else LLAVA, [1, 3] if tiny else arguments.rows, 10 if tiny else arguments.context,
                   tiny, arguments.splits)
    print(report(result))
    save_result("decode_attention_probe", result)


if __name__ == "__main__":
    main()
