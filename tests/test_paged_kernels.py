"""The paged-attention Triton kernels, run on the CPU by Triton's interpreter, against the gather + SDPA reference.

Triton takes `TRITON_INTERPRET=1` into account only if it is set before Triton is imported, so in an ordinary test
run this file has one test, which runs this file again in a child pytest with the variable set; there the kernel
checks below are collected. The interpreter cannot multiply bfloat16: float32 and float16 here, bfloat16 in
`test_paged_gpu.py`. Skipped without Triton.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from exporter.llm import paged_attention  # noqa: E402
from exporter.llm.paged_attention import FP8_DTYPE, Chunk, PagedBatch, PagedKVCache  # noqa: E402
from support.kernels import TRITON_INTERPRETED, run_under_triton_interpreter  # noqa: E402


@pytest.fixture(scope="module")
def kernels():
    if not TRITON_INTERPRETED:
        pytest.skip("runs in the child pytest (TRITON_INTERPRET=1)")
    from exporter.llm import paged_triton

    return paged_triton


@pytest.fixture(params=[False, True], ids=["rows first", "KV heads first"])
def decode_order(kernels, request):
    """The decode kernels run with their first configuration of this grid order (the interpreter cannot time
    configurations: it runs one; float8 MHA: one with key rows a lane)."""
    tuned = (kernels._decode_tuned, kernels._decode_tuned_fp8, kernels._decode_tuned_mha_fp8)
    saved = [(kernel.configs, kernel.cache) for kernel in tuned]
    for kernel, configs in zip(tuned, (kernels._DECODE_CONFIGS, kernels._DECODE_FP8_CONFIGS, kernels._LANES_CONFIGS)):
        kernel.configs = [next(c for c in configs if c.kwargs["GROUP_MAJOR"] == request.param)]
        kernel.cache = {}
    yield request.param
    for kernel, (configs, cache) in zip(tuned, saved):
        kernel.configs, kernel.cache = configs, cache


@pytest.fixture(params=[64, 128], ids=["64-query programs", "128-query programs"])
def chunk_rows(kernels, request):
    """The chunk kernel runs with this many queries a program (half a tile, as its configurations have, or a
    whole one, which the kernel supports too)."""
    tuned = kernels._chunk_tuned
    saved = tuned.configs, tuned.cache
    first = kernels._CHUNK_CONFIGS[0]
    tuned.configs = [triton.Config({**first.kwargs, "BLOCK_M": request.param}, num_warps=first.num_warps,
                                   num_stages=first.num_stages)]
    tuned.cache = {}
    yield request.param
    tuned.configs, tuned.cache = saved


def test_kernels_under_the_triton_interpreter():
    run_under_triton_interpreter(__file__)


def _cache(dtype: torch.dtype, groups: int, dim: int, block_size: int, blocks: int, fp8: bool = False,
           seed: int = 0) -> PagedKVCache:
    """One layer of random keys and values, stored head-major as the engine's pool is (a view with the block's
    positions before its KV heads); float8 ones stored as value / scale."""
    generator = torch.Generator().manual_seed(seed)
    data = torch.randn(1, 2, blocks, groups, block_size, dim, generator=generator).transpose(3, 4)
    if not fp8:
        return PagedKVCache(data.to(dtype))
    scales = torch.rand(1, 2, groups, generator=generator) * 0.05 + 0.01
    stored = (data / scales[:, :, None, None, :, None]).clamp(-448, 448).to(FP8_DTYPE)
    return PagedKVCache(stored, scales)


def _tables(rows: int, width: int, blocks: int, seed: int) -> torch.Tensor:
    """Each row's table: distinct blocks in a shuffled order (block 0, the null block, never)."""
    order = torch.randperm(blocks - 1, generator=torch.Generator().manual_seed(seed))[: rows * width] + 1
    return order.view(rows, width).to(torch.int32)


# (dtype, KV heads, query heads per KV head, head size, block size, float8): MHA, GQA, MQA, head sizes that are
# not powers of two or below 16, a block size of 1
SHAPES = [
    (torch.float32, 2, 2, 16, 4, False),
    (torch.float16, 4, 1, 32, 16, False),
    (torch.float32, 1, 4, 8, 4, False),
    (torch.float16, 2, 3, 24, 1, False),
    (torch.float32, 2, 2, 16, 8, True),
    (torch.float16, 2, 2, 24, 8, True),  # 16-bit queries over float8 blocks: scores computed in float16
    (torch.float16, 2, 1, 32, 8, True),  # MHA over float8 blocks (key rows a lane): values summed in float16
    (torch.float32, 2, 1, 16, 4, True),  # the same with float32 queries: in float32
]


@pytest.mark.parametrize("dtype, groups, per_group, dim, block_size, fp8", SHAPES)
@pytest.mark.parametrize("splits, window, merged_in_place", [(1, None, False), (3, None, False), (4, 9, False),
                                                             (3, None, True), (5, 9, True)])
def test_decode_kernel_matches_the_reference(kernels, decode_order, dtype, groups, per_group, dim, block_size, fp8,
                                             splits, window, merged_in_place):
    """With splits, merged by a second kernel or by each (row, KV head)'s last split (its tickets left at zero,
    so the next call merges too; splits past a short row's positions hold no key); either grid order."""
    rows, width = 4, -(-48 // block_size)
    cache = _cache(dtype, groups, dim, block_size, blocks=rows * width + 1, fp8=fp8)
    tables = _tables(rows, width, cache.num_blocks, seed=1)
    positions = torch.tensor([0, 5, 30, 47])[:rows]
    query = torch.randn(rows, groups * per_group, dim, generator=torch.Generator().manual_seed(2)).to(dtype)
    batch = PagedBatch(cache, rows=rows, tables=tables, positions=positions, span=48, splits=splits)
    k, v, scales = cache.layer(0)
    expected = paged_attention._decode_reference(query, k, v, batch, scales, window)
    counters = cache.counters if merged_in_place else None
    tolerance = 1e-5 if dtype == torch.float32 else 2e-3
    for _ in range(2 if merged_in_place else 1):
        got = kernels.decode(query, k, v, tables, positions, scales, splits, window, counters)
        torch.testing.assert_close(got.float(), expected.float(), rtol=tolerance, atol=tolerance)
    assert not cache.counters.any()


@pytest.mark.parametrize("dtype, groups, per_group, dim, block_size, fp8", SHAPES)
@pytest.mark.parametrize("splits, window, merged_in_place", [(1, None, False), (1, 11, False), (3, None, False),
                                                             (4, 11, False), (3, None, True), (4, 11, True)])
def test_chunk_kernel_matches_the_reference(kernels, chunk_rows, dtype, groups, per_group, dim, block_size, fp8,
                                            splits, window, merged_in_place):
    """Three sequences of one chunk, two starting after cached positions (one past two whole key tiles, which the
    kernel reads unmasked), with padding after them; the tiles as the step builds them (at most CHUNK_TILE queries
    each: a whole one and a short one, one unused), each taken by one program or two (the second of a short tile
    idle); with splits, each tile's keys cut into parts merged after, by a second kernel or by each program's last
    part (some parts without a key)."""
    width = -(-(kernels.CHUNK_TILE + 160) // block_size)
    cache = _cache(dtype, groups, dim, block_size, blocks=3 * width + 1, fp8=fp8)
    tables = _tables(3, width, cache.num_blocks, seed=3)
    long = kernels.CHUNK_TILE + 22
    # (first query, count, first position)
    sequences = ((0, long, 9), (long, 41, 0), (long + 41, 20, kernels.CHUNK_TILE + 130))
    tile = kernels.CHUNK_TILE
    tiles = [[index, first + offset, min(tile, count - offset), start + offset]
             for index, (first, count, start) in enumerate(sequences) for offset in range(0, count, tile)]
    tiles = torch.tensor(tiles + [[-1, 0, 0, 0]], dtype=torch.int32)
    covered = long + 61
    query = torch.randn(covered + 9, groups * per_group, dim, generator=torch.Generator().manual_seed(4)).to(dtype)
    chunk = Chunk(tables=tables, blocks=None, offsets=None, tiles=tiles, sequences=sequences)
    k, v, scales = cache.layer(0)
    expected = paged_attention._chunk_reference(query, k, v, chunk, scales, window)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-3
    for _ in range(2 if merged_in_place else 1):
        got = kernels.chunk(query, k, v, tables, tiles, scales, window, splits,
                            cache.counters if merged_in_place else None)
        torch.testing.assert_close(got.float(), expected.float(), rtol=tolerance, atol=tolerance)
        assert not got[covered:].any()  # padding queries no tile covers
    assert not cache.counters.any()


def test_the_configurations_are_timed_once_per_kind_of_call_on_representative_work(monkeypatch):
    """Whatever the autotuner timed before (a capture's empty work) is timed again, once per kind of call, on the
    representative work, and kept beside the other keys' timings; not on a pool small enough to stay in cache."""
    from exporter.llm import paged_triton

    monkeypatch.setattr(paged_triton, "_INTERPRETED", False)
    monkeypatch.setattr(paged_triton, "_tuned", set())
    kernels = (paged_triton._decode_tuned, paged_triton._decode_tuned_fp8, paged_triton._decode_tuned_mha_fp8,
               paged_triton._chunk_tuned)
    for kernel in kernels:
        monkeypatch.setattr(kernel, "cache", {("timed on empty work",): "first"})
    timed = []

    def representative():
        assert all(kernel.cache == {} for kernel in kernels)  # the autotuner times its configurations again
        paged_triton._decode_tuned.cache[("timed on empty work",)] = "representative"
        timed.append(True)

    paged_triton._tune_first(("decode", 1), paged_triton.TUNE_MIN_BLOCKS - 1, representative)
    assert not timed
    for _ in range(2):
        paged_triton._tune_first(("decode", 1), paged_triton.TUNE_MIN_BLOCKS, representative)
    assert timed == [True]
    assert paged_triton._decode_tuned.cache == {("timed on empty work",): "representative"}
    assert paged_triton._chunk_tuned.cache == {("timed on empty work",): "first"}


def test_the_representative_work_stays_within_the_pool_and_the_tables(kernels):
    """The work the configurations are timed on: tables over distinct real blocks, a chunk after cached positions
    within a row's blocks; the kernels on it match the reference."""
    from exporter.llm import paged_triton

    width, block_size = 12, 4
    cache = _cache(torch.float32, 2, 16, block_size, blocks=20)
    k, v, _ = cache.layer(0)
    tables = paged_triton._spread_tables(torch.zeros(3, width, dtype=torch.int32), cache.num_blocks)
    assert tables.min() >= 1 and tables.max() < cache.num_blocks
    tiles = paged_triton._prefix_tiles(100, 3, width * block_size, torch.device("cpu"))
    used = tiles[tiles[:, 0] >= 0]
    assert used[:, 2].sum() == 48 and used[-1, 3] + used[-1, 2] == width * block_size  # the row's last position
    query = torch.randn(100, 4, 16, generator=torch.Generator().manual_seed(5))
    chunk = Chunk(tables=tables, blocks=None, offsets=None, tiles=tiles,
                  sequences=((0, 48, int(used[0, 3])),))
    expected = paged_attention._chunk_reference(query, k, v, chunk, None, None)
    got = kernels.chunk(query, k, v, tables, tiles, None, None, 2, cache.counters)
    torch.testing.assert_close(got[:48], expected[:48], rtol=1e-5, atol=1e-5)
