"""The paged chunk kernel alone at 1, 2, 4 and 8 key splits: how many splits a prompt chunk's attention should take.

`paged_triton.chunk` (a prompt chunk's attention over the paged KV cache) cuts the keys of each (query tile, head)
program into `splits` parts, merged after; the engine picks the count in `cuda_graphs.decode_splits` from the
chunk bucket's tiles (issue 14). For each chunk of queries after a cached prefix (LLaVA-7B's layer: 32 heads of
128, blocks of 32 positions, bf16, stored head-major as the engine's pool) this probe times the kernel as a step's
graph calls it: over the tile room the step's graph has (`_tile_capacity` of the chunk's bucket, the tiles past
the chunk unused), merged in place with the cache's counters, its configurations autotuned as in the engine (each
split count timed on its first call's representative work, in the order the engine's warm-up meets them: chunk
buckets ascending). A CUDA graph of `--calls` calls, the median of `--replays` replays, microseconds a call. Prints
each split count's time, the fastest, and the engine's choice for the chunk's bucket with its ratio to the
fastest; each split's output is checked against one split's. Writes ``$OUT/chunk_splits_probe.json``.

    python bench/chunk_splits_probe.py                  # about 2 minutes on an H100 (mostly compiles and tuning)
    python bench/chunk_splits_probe.py --cases 85@614 384@16000 --splits 1 2 4
    python bench/chunk_splits_probe.py --layers 10      # each call of a graph over another layer's blocks
    python bench/chunk_splits_probe.py --tiny           # tiny float32 shapes on the CPU under Triton's interpreter
"""

from __future__ import annotations

import os
import sys

if "--tiny" in sys.argv:  # Triton reads this only when first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import torch  # noqa: E402
from llava_bench import save_result  # noqa: E402
from torch import Tensor  # noqa: E402

from exporter.llm import paged_triton  # noqa: E402
from exporter.llm.paged_attention import PagedKVCache  # noqa: E402
from exporter.llm.paged_triton import CHUNK_TILE  # noqa: E402
from exporter.runtime.cuda_graphs import MAX_PIECES, _tile_capacity, chunk_bucket_sizes, decode_splits  # noqa: E402
from exporter.runtime.scheduler import DEFAULT_MAX_NUM_TOKENS  # noqa: E402

# queries@cached positions before them: the eleventh run's second question, a few tiles after a long prefix,
# an image prompt, and a whole bucket of the longest chunk at the start and after 14k positions
CASES = ["85@614", "120@16000", "384@16000", "602@96", "2048@0", "2048@14336"]
TINY_CASES = ["5@7", "40@100"]


@dataclass(frozen=True)
class Shape:
    """One layer's attention: heads (as many KV heads), head size, positions a block, dtype, the largest chunk."""

    heads: int
    dim: int
    block_size: int
    dtype: torch.dtype
    max_chunk: int


LLAVA = Shape(heads=32, dim=128, block_size=32, dtype=torch.bfloat16, max_chunk=DEFAULT_MAX_NUM_TOKENS)
TINY = Shape(heads=2, dim=16, block_size=4, dtype=torch.float32, max_chunk=64)


def parse_case(text: str) -> tuple[int, int]:
    """``"85@614"``: 85 queries after 614 cached positions."""
    queries, start = (int(part) for part in text.split("@"))
    if queries < 1 or start < 0:
        raise argparse.ArgumentTypeError(f"{text}: queries >= 1 after >= 0 positions")
    return queries, start


def bucket(queries: int, shape: Shape) -> int:
    """The padded chunk size the engine's step graph takes ``queries`` in."""
    return next(size for size in chunk_bucket_sizes(shape.max_chunk) if size >= queries)


def engine_splits(queries: int, shape: Shape, device: torch.device) -> int:
    """The split count the engine gives a chunk of ``queries`` (`ForwardStep`: its bucket's whole query tiles)."""
    return decode_splits(-(-bucket(queries, shape) // CHUNK_TILE), shape.heads, device)


def make_cache(shape: Shape, blocks: int, layers: int, device: torch.device) -> PagedKVCache:
    """``layers`` layers of random keys and values over ``blocks`` blocks, stored head-major as the engine's pool is
    (viewed with a block's positions before its heads)."""
    data = torch.randn(layers, 2, blocks, shape.heads, shape.block_size, shape.dim, dtype=shape.dtype,
                       device=device)
    return PagedKVCache(data.transpose(3, 4))


def chunk_inputs(queries: int, start: int, shape: Shape, width: int, blocks: int,
                 device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """The step graph's chunk inputs for one piece: queries ``[bucket, heads, dim]``, block tables
    ``[MAX_PIECES, width]`` (the piece's distinct blocks, shuffled, in row 0) and the tile room
    ``[_tile_capacity(bucket), 4]`` (the piece's tiles first, the rest unused)."""
    padded = bucket(queries, shape)
    generator = torch.Generator().manual_seed(queries * 100003 + start)
    q = torch.randn(padded, shape.heads, shape.dim, generator=generator).to(device, shape.dtype)
    used = -(-(start + queries) // shape.block_size)
    tables = torch.zeros(MAX_PIECES, width, dtype=torch.int32)
    tables[0, :used] = (torch.randperm(blocks - 1, generator=generator)[:used] + 1).to(torch.int32)
    tiles = torch.full((_tile_capacity(padded), 4), -1, dtype=torch.int32)
    for index, offset in enumerate(range(0, queries, CHUNK_TILE)):
        tiles[index] = torch.tensor([0, offset, min(CHUNK_TILE, queries - offset), start + offset])
    return q, tables.to(device), tiles.to(device)


def tune_in_engine_order(cache: PagedKVCache, splits: list[int], shape: Shape, width: int,
                         device: torch.device) -> None:
    """The first call of each split count (``splits`` and the engine's choices), in the order the engine's warm-up
    meets them (chunk buckets ascending, each at its own split count; counts no bucket takes last):
    `paged_triton.chunk` times its configurations then, on its representative work, and keeps them for every
    chunk at that split count."""
    first = {}
    for size in chunk_bucket_sizes(shape.max_chunk):
        first.setdefault(engine_splits(size, shape, device), size)
    k, v, _ = cache.layer(0)
    for count in sorted(set(splits) | set(first), key=lambda count: (count not in first, first.get(count, 0))):
        q, tables, tiles = chunk_inputs(first.get(count, shape.max_chunk), 0, shape, width, cache.num_blocks,
                                        device)
        paged_triton.chunk(q, k, v, tables, tiles, None, None, count, cache.counters if count > 1 else None)


def chosen_configs() -> dict[str, str]:
    """The configuration the autotuner keeps per split count (its key's ``SPLITS``); with one candidate, it."""
    tuned = paged_triton._chunk_tuned
    if len(tuned.configs) == 1:
        return {"all": str(tuned.configs[0])}
    splits_at = tuned.keys.index("SPLITS")
    return {str(key[splits_at]): str(config) for key, config in tuned.cache.items()}


def graph_us(calls: list, replays: int) -> float:
    """Microseconds a call: ``calls`` captured in one CUDA graph, the median of ``replays`` replays."""
    for call in calls[:3]:
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    times = []
    for _ in range(replays):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) * 1e3 / len(calls))
    return statistics.median(times)


def probe_case(cache: PagedKVCache, queries: int, start: int, splits: list[int], shape: Shape, width: int,
               calls: int, replays: int, tiny: bool) -> dict:
    """One chunk's row: microseconds a call per split count (``--tiny``: one call's wall time), the fastest, the
    engine's choice, and each split's largest difference from one split's output."""
    device = cache.data.device
    q, tables, tiles = chunk_inputs(queries, start, shape, width, cache.num_blocks, device)
    layers = cache.data.shape[0]

    def call(count: int, layer: int = 0) -> Tensor:
        k, v, _ = cache.layer(layer)
        return paged_triton.chunk(q, k, v, tables, tiles, None, None, count, cache.counters if count > 1 else None)

    reference = call(1)[:queries].float()
    chosen = engine_splits(queries, shape, device)
    timed, errors = {}, {}
    for count in sorted(set(splits) | {chosen}):
        errors[count] = (call(count)[:queries].float() - reference).abs().max().item()
        if errors[count] > (1e-4 if tiny else 3e-2) * max(1.0, reference.abs().max().item()):
            raise AssertionError(f"{queries}@{start}, {count} splits: off one split's output by {errors[count]:.3g}")
        if tiny:
            began = time.perf_counter()
            call(count)
            timed[count] = (time.perf_counter() - began) * 1e6
        else:
            timed[count] = graph_us([lambda c=count, i=i: call(c, i % layers) for i in range(calls)], replays)
    fastest = min(timed, key=timed.get)
    padded = bucket(queries, shape)
    return dict(queries=queries, start=start, bucket=padded, tile_room=_tile_capacity(padded),
                merged_in_place=paged_triton._merges_in_place(cache.counters, tiles.shape[0], shape.heads),
                us={str(count): round(us, 2) for count, us in timed.items()}, fastest=fastest,
                engine_splits=chosen, engine_ratio=round(timed[chosen] / timed[fastest], 3),
                max_error={str(count): error for count, error in errors.items()})


def probe(cases: list[tuple[int, int]], splits: list[int], shape: Shape, layers: int, calls: int, replays: int,
          budget_s: float, tiny: bool) -> dict:
    device = torch.device("cpu" if tiny else "cuda")
    # a row long enough for the longest case and for the tuning's representative work (the largest chunk after
    # `TUNE_PREFIX` positions); the pool: the null block, a row's, and at least what the tuning needs
    longest = max([start + queries for queries, start in cases] + [paged_triton.TUNE_PREFIX + shape.max_chunk])
    width = -(-longest // shape.block_size)
    blocks = max(width + 1, paged_triton.TUNE_MIN_BLOCKS + 1)
    torch.manual_seed(0)
    cache = make_cache(shape, blocks, layers, device)
    deadline = time.time() + budget_s
    if not tiny:  # the interpreter runs one configuration
        tune_in_engine_order(cache, splits, shape, width, device)
    configs = chosen_configs()
    if configs:
        print("configurations chosen: " + "; ".join(f"splits {count}: {config}" for count, config in configs.items()))
    results = []
    for queries, start in cases:
        if time.time() > deadline:
            print(f"budget spent: {queries}@{start} and the cases after it not run", flush=True)
            break
        row = probe_case(cache, queries, start, splits, shape, width, calls, replays, tiny)
        results.append(row)
        times = "  ".join(f"{count}: {us:7.1f}" for count, us in row["us"].items())
        print(f"{queries:5d}@{start:<6d} bucket {row['bucket']:5d}, room {row['tile_room']:3d} tiles | {times} us | "
              f"fastest {row['fastest']} | engine {row['engine_splits']} ({row['engine_ratio']:.2f}x)", flush=True)
    name = "cpu (Triton's interpreter)" if tiny else torch.cuda.get_device_name(device)
    slots = None if tiny else 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return dict(device=name, program_slots=slots, shape=dict(heads=shape.heads, dim=shape.dim,
                block_size=shape.block_size, dtype=str(shape.dtype), max_chunk=shape.max_chunk), layers=layers,
                calls=calls, replays=replays, configs=configs, results=results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=parse_case, nargs="+", help="queries@cached positions (default: the list "
                        f"{' '.join(CASES)})")
    parser.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--layers", type=int, default=1, help="a graph's calls cycle over this many layers' blocks")
    parser.add_argument("--calls", type=int, default=10, help="calls in one CUDA graph")
    parser.add_argument("--replays", type=int, default=10)
    parser.add_argument("--config-first", action="store_true", help="the kernel's first configuration, untimed")
    parser.add_argument("--budget-s", type=float, default=400.0, help="stop starting new cases after this")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (Triton's interpreter)")
    args = parser.parse_args()
    shape = TINY if args.tiny else LLAVA
    cases = args.cases or [parse_case(case) for case in (TINY_CASES if args.tiny else CASES)]
    if any(queries > shape.max_chunk for queries, _ in cases):
        parser.error(f"a chunk takes at most {shape.max_chunk} queries")
    if args.config_first:
        paged_triton._chunk_tuned.configs = paged_triton._chunk_tuned.configs[:1]
    splits = [1, 2] if args.tiny and args.splits == [1, 2, 4, 8] else args.splits
    result = probe(cases, splits, shape, args.layers, args.calls, args.replays, args.budget_s, args.tiny)
    save_result("chunk_splits_probe", result)


if __name__ == "__main__":
    main()
