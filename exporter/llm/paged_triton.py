"""Attention over a paged KV cache on CUDA: Triton kernels for decode rows and for prompt chunks.

The cache of one layer is `k, v [blocks, block_size, kv_heads, head_dim]`; a row's key at position `p` sits in block
`tables[row, p // block_size]` at offset `p % block_size`. Both kernels read each row's block table and lengths
from tensors (no host value), so they can be captured in CUDA graphs, keep the softmax online in float32, and
dequantize float8 blocks (value = stored * scale, one scale per KV head) as they load them: the stored e4m3 values
are converted once, to float16 (one packed instruction per two values; to bfloat16 it takes three), with bfloat16
or float16 queries multiplied in float16 (`_compute_q`), and the scales are folded into the score scale and the
final output, never applied per element. A float8 cache's decode tiles take twice the positions of a 16-bit one's
(the same bytes per iteration).

- `decode`: one query token per row. A program takes one (row, KV head, split): it loads each key and value
  block once for all the query heads of that KV head (GQA), over its share of the row's positions. Over a float8
  cache with one query head a KV head (MHA) its candidates also include programs that give each key row to a
  group of threads (a "lane": its own online softmax, merged with the others' at the end) on the CUDA cores: no
  16-row tensor-core tile padding one query, and no shared memory, so more programs run at once. With
  `splits > 1` the row's positions are cut into that many parts (split-K: enough programs to keep every SM
  reading at small batch and long context) whose partial results the last part to finish merges, told so by a
  ticket it takes from the cache's counters (one kernel a layer: a merge kernel after it costs a launch a layer,
  some 2 µs of a batch-1 step each).
- `chunk`: query tiles of consecutive prompt positions of one row (a `tiles` table: sequence, first query, count,
  first position; the host cuts them `CHUNK_TILE` queries long), each attending causally to the row's blocks up to
  its own position; its key splits (a few tiles over a long prefix) merged the same way, per (tile, head). A
  program takes `BLOCK_M` queries of a tile (a configuration's; 64: a tile is two programs).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
from torch import Tensor

from .gemv import register_tuned, time_candidate
from .parallel_compile import compiling_only
from .triton_launch import INTERPRETED as _INTERPRETED
from .triton_launch import dependent_launch

try:
    import triton
    import triton.language as tl

    from .triton_launch import start_dependents, wait_for_producers
except ImportError:  # no Triton: the reference path in exporter.llm.paged_attention runs
    triton = None

CHUNK_TILE = 128  # query positions per chunk tile (the host cuts sequences into tiles of at most this size)
TUNE_CONTEXT = 1024  # the positions of each decode row while the decode kernel's configurations are timed
TUNE_PREFIX = 4096  # the cached positions before a chunk while the chunk kernel's configurations are timed
TUNE_MIN_BLOCKS = 256  # the smallest pool the configurations are timed over (a smaller one stays in the L2 cache)
_LOG2E = 1.4426950408889634
_tuned: set[str] = set()  # the kinds of call (`_tune_first`, as text) whose configurations were timed


def available() -> bool:
    """Whether the kernels can run (Triton is importable)."""
    return triton is not None


def split_count(programs: int, slots: int, most: int) -> int:
    """How many parts (at most ``most``) to cut the keys of each of ``programs`` kernel programs into, when the GPU
    runs ``slots`` programs at once: the most that still fit in one wave (at least one part). One part more would
    start a second wave, which takes as long as the first: 32 programs over 264 slots take 8 parts (256 programs),
    not 9 (288, a second wave of 24 that doubles the time)."""
    return max(1, min(most, slots // programs))


def _padded(dim: int) -> int:
    """The head size the kernels compute with: a power of two, at least 16 (the extra lanes are masked)."""
    return max(16, triton.next_power_of_2(dim))


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def decode(q: Tensor, k: Tensor, v: Tensor, tables: Tensor, positions: Tensor, scales: Tensor | None,
           splits: int, window: int | None, counters: Tensor | None = None) -> Tensor:
    """Attention of `q [R, heads, d]` (row r's token at `positions[r]`) over keys `[0, positions[r]]` of row r's
    blocks `tables [>= R, max_blocks]` (int32). `scales [2, kv_heads]` for float8 blocks. With `splits > 1` and
    `counters` (int32, zero, at least `R x kv_heads`; left zero) the last split of each (row, KV head) to finish
    merges the splits, else a second kernel does. Returns `[R, heads, d]`. The first call of its kind first times
    the kernel's configurations on rows of up to `TUNE_CONTEXT` positions (`_tune_first`, `_tune_positions`)."""
    q = q.contiguous()
    rows = q.shape[0]
    if rows:
        context = min(TUNE_CONTEXT, tables.shape[1] * k.shape[1])
        _tune_first(("decode", triton.next_power_of_2(rows), q.shape[1:], q.dtype, k.shape[1:], k.dtype, k.stride(),
                     tables.shape[1], tables.dtype, positions.dtype, scales is not None, splits, window is not None,
                     counters is not None and counters.numel() >= rows * k.shape[2], q.device), k.shape[0],
                    lambda: _decode(q, k, v, _spread_tables(tables[:rows], k.shape[0]),
                                    _tune_positions(rows, context, positions.dtype, q.device), scales, splits,
                                    window, counters))
    return _decode(q, k, v, tables, positions, scales, splits, window, counters)


def _tune_positions(rows: int, context: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """The last positions of ``rows`` decode rows timed by `_tune_first`: three quarters into ``context`` (a
    table's width, capped), nearer where a running batch's rows are than its end (H200: configurations timed at
    928 positions, a table's full width, were slower than others in steps over 608-736)."""
    return torch.full((rows,), context * 3 // 4 - 1, dtype=dtype, device=device)


def _decode(q: Tensor, k: Tensor, v: Tensor, tables: Tensor, positions: Tensor, scales: Tensor | None,
            splits: int, window: int | None, counters: Tensor | None) -> Tensor:
    rows, heads, dim = q.shape
    groups = k.shape[2]
    per_group = heads // groups
    out = torch.empty_like(q)
    if rows == 0:
        return out
    fp8 = scales is not None
    k_scale, v_scale = (scales[0], scales[1]) if fp8 else (q, q)  # unused pointers without float8
    common = dict(QPG=per_group, QP=max(16, triton.next_power_of_2(per_group)), D=dim, DP=_padded(dim),
                  BS=k.shape[1], FP8=fp8, WINDOWED=window is not None, PRECISION=_precision(q.dtype))
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), tables.stride(0))
    scale = _LOG2E / math.sqrt(dim)
    kernel = decode_kernel(fp8, per_group)
    pdl = dependent_launch(q.device)
    common.update(PDL=pdl, launch_pdl=pdl)
    if splits <= 1:
        kernel[_decode_grid(rows, groups, 1)](q, k, v, tables, positions, k_scale, v_scale, out, out, out, out,
                                              *strides, out.stride(0), out.stride(1), 0, tables.shape[1],
                                              window or 0, scale, triton.next_power_of_2(rows), SPLITS=1,
                                              MERGE=False, **common)
        return out
    partial = torch.empty(rows, heads, splits, dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(rows, heads, splits, dtype=torch.float32, device=q.device)
    merge = counters is not None and counters.numel() >= rows * groups
    kernel[_decode_grid(rows, groups, splits)](q, k, v, tables, positions, k_scale, v_scale, partial, lse, out,
                                               counters if merge else out, *strides, partial.stride(0),
                                               partial.stride(1), partial.stride(2), tables.shape[1], window or 0,
                                               scale, triton.next_power_of_2(rows), SPLITS=splits, MERGE=merge,
                                               **common)
    if not merge:
        _merge(partial, lse, out, splits)
    return out


def decode_kernel(fp8: bool, per_group: int):
    """The autotuned decode kernel for a float8 cache or not and ``per_group`` query heads a KV head (float8 MHA:
    its candidates also take key rows a lane on the CUDA cores, which were slower than tensor-core tiles over
    bfloat16 blocks)."""
    if fp8:
        return _decode_tuned_mha_fp8 if per_group == 1 else _decode_tuned_fp8
    return _decode_tuned


def _decode_grid(rows: int, groups: int, splits: int):
    """The decode kernel's grid for the configuration the autotuner runs (its ``GROUP_MAJOR`` order)."""
    return lambda meta: (groups, rows, splits) if meta["GROUP_MAJOR"] else (rows, groups, splits)


def chunk(q: Tensor, k: Tensor, v: Tensor, tables: Tensor, tiles: Tensor, scales: Tensor | None,
          window: int | None, splits: int = 1, counters: Tensor | None = None) -> Tensor:
    """Causal attention of prompt positions `q [C, heads, d]` over their rows' blocks. `tiles [T, 4]` int32: per
    tile (sequence s or -1, first query index, query count <= CHUNK_TILE, position of that first query); sequence
    s reads blocks `tables[s]`. With `splits > 1` each tile's keys are cut into that many parts (a few tiles over a
    long prefix still keep every SM busy), merged as `decode` merges its splits (in place with `counters`, at
    least `T x heads` times the programs a tile may take, `CHUNK_TILE / 64`). Queries no tile covers come back as
    zeros. The first call of its kind first times the kernel's configurations on the chunk's queries after
    `TUNE_PREFIX` cached positions."""
    q = q.contiguous()
    if q.shape[0] and tiles.shape[0]:
        _tune_first(("chunk", q.shape[1:], q.dtype, k.shape[1:], k.dtype, k.stride(), tables.shape[1],
                     tables.dtype, scales is not None, splits, window is not None,
                     _merges_in_place(counters, tiles.shape[0], q.shape[1]), q.device),
                    k.shape[0], lambda: _chunk(q, k, v, _spread_tables(tables, k.shape[0]),
                                   _prefix_tiles(q.shape[0], tiles.shape[0], tables.shape[1] * k.shape[1], q.device),
                                   scales, window, splits, counters))
    return _chunk(q, k, v, tables, tiles, scales, window, splits, counters)


def _chunk(q: Tensor, k: Tensor, v: Tensor, tables: Tensor, tiles: Tensor, scales: Tensor | None,
           window: int | None, splits: int, counters: Tensor | None) -> Tensor:
    tokens, heads, dim = q.shape
    groups = k.shape[2]
    out = torch.zeros_like(q)
    if tokens == 0 or tiles.shape[0] == 0:
        return out
    fp8 = scales is not None
    k_scale, v_scale = (scales[0], scales[1]) if fp8 else (q, q)
    merge = splits > 1 and _merges_in_place(counters, tiles.shape[0], heads)
    if splits <= 1:
        target, lse, target_strides = out, out, (out.stride(0), out.stride(1), 0)
    else:  # every split's partial output; for a merge kernel, queries no tile covers keep no weight (-inf): zeros
        target = torch.empty(tokens, heads, splits, dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(tokens, heads, splits, dtype=torch.float32, device=q.device)
        if not merge:
            lse.fill_(float("-inf"))
        target_strides = (target.stride(0), target.stride(1), target.stride(2))
    count = tiles.shape[0]
    pdl = dependent_launch(q.device)
    _chunk_tuned[lambda meta: (count * (CHUNK_TILE // meta["BLOCK_M"]), heads, splits)](
        q, k, v, tables, tiles, k_scale, v_scale, target, lse, out, counters if merge else out, q.stride(0),
        q.stride(1), k.stride(0), k.stride(1), k.stride(2), tables.stride(0), *target_strides, tables.shape[1],
        window or 0, _LOG2E / math.sqrt(dim), QPG=heads // groups, D=dim, DP=_padded(dim), BS=k.shape[1],
        TILE=CHUNK_TILE, SPLITS=splits, FP8=fp8, WINDOWED=window is not None, PRECISION=_precision(q.dtype),
        MERGE=merge, PDL=pdl, launch_pdl=pdl)
    if splits > 1 and not merge:
        _merge(target, lse, out, splits)
    return out


def _merges_in_place(counters: Tensor | None, tiles: int, heads: int) -> bool:
    """Whether ``counters`` hold a ticket for every (program, head) of a chunk of ``tiles`` tiles, whatever number
    of programs per tile the autotuner picks."""
    return counters is not None and counters.numel() >= tiles * _CHUNK_PARTS * heads


def _tune_first(kind: tuple, pool_blocks: int, representative: Callable[[], object]) -> None:
    """Time the kernel's configurations on ``representative`` (the kernel on work of a typical size, with the
    call's shapes and types) the first time a call of this ``kind`` comes over a pool of at least
    ``TUNE_MIN_BLOCKS`` blocks, whatever the autotuner timed before: it keeps the configuration it timed on the
    first call of each of its keys, and a step graph is captured on idle rows and an empty chunk (one key each,
    where every configuration takes the same launch time), a step's memory measured on a pool of two blocks. Not
    while a graph is being captured, nor under the interpreter (it runs one configuration). Under
    `parallel_compile.compiles_only`, ``representative`` runs on any pool (its kernels compiled) and nothing is
    recorded: the first call after it times."""
    text = repr(kind)
    if text in _tuned or _INTERPRETED or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
        return
    if compiling_only():
        representative()
        return
    if pool_blocks < TUNE_MIN_BLOCKS:
        return
    _tuned.add(text)
    kernels = (_decode_tuned, _decode_tuned_fp8, _decode_tuned_mha_fp8, _chunk_tuned)
    timed_before = [kernel.cache for kernel in kernels]
    for kernel in kernels:
        kernel.cache = {}
    try:
        representative()
    finally:
        for kernel, before in zip(kernels, timed_before):
            kernel.cache = {**before, **kernel.cache}


def tuned_kinds() -> list[str]:
    """The kinds of call whose configurations were timed on representative work so far (`_tune_first`), as text:
    what the kernel cache keeps beside the kernels' autotune results."""
    return sorted(_tuned)


def remember_tuned(kinds: Iterable[str]) -> None:
    """Take kinds of call timed by an earlier run on the same GPU and software (`tuned_kinds`), whose autotune
    results the kernel cache restored with them: they are not timed again."""
    _tuned.update(kinds)


def _spread_tables(like: Tensor, blocks: int) -> Tensor:
    """Block tables shaped and typed as ``like`` over distinct blocks of a pool of ``blocks`` (never the null
    block 0, but in a pool of it alone), wrapping around the pool."""
    spread = torch.arange(like.numel(), device=like.device)
    spread = spread % (blocks - 1) + 1 if blocks > 1 else spread * 0
    return spread.to(like.dtype).view(like.shape)


def _prefix_tiles(tokens: int, count: int, capacity: int, device: torch.device) -> Tensor:
    """``count`` chunk tiles: one sequence of up to ``tokens`` queries after up to ``TUNE_PREFIX`` cached positions
    (within a row's ``capacity``), unused tiles after it."""
    queries = min(tokens, count * CHUNK_TILE, capacity)
    start = max(0, min(TUNE_PREFIX, capacity - queries))
    tiles = torch.full((count, 4), -1, dtype=torch.int32)
    for index, offset in enumerate(range(0, queries, CHUNK_TILE)):
        tiles[index] = torch.tensor([0, offset, min(CHUNK_TILE, queries - offset), start + offset])
    return tiles.to(device)


def _merge(partial: Tensor, lse: Tensor, out: Tensor, splits: int) -> None:
    """`out [N, heads, d]`: each split's partial output `[N, heads, splits, d]` weighted by its softmax mass."""
    rows, heads, dim = out.shape
    _paged_merge_kernel[(rows, heads)](partial, lse, out, partial.stride(0), partial.stride(1), partial.stride(2),
                                       out.stride(0), out.stride(1), SPLITS=splits, SP=triton.next_power_of_2(splits),
                                       D=dim, DP=_padded(dim))


if triton is not None:

    @triton.jit
    def _compute_q(q, FP8: tl.constexpr):
        """The queries in the type the scores are computed in: with a float8 cache, 16-bit queries as float16 (the
        e4m3 keys and values convert to it in one instruction; float16 holds bfloat16's bits but for magnitudes
        over 65504, clamped), float32 ones unchanged; else as they are."""
        if FP8:
            if q.dtype != tl.float32:
                q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
        return q

    @triton.jit
    def _score_scale(scale, k_scale_ptr, group, FP8: tl.constexpr):
        """The score scale, float8 keys' scale folded in."""
        if FP8:
            return scale * tl.load(k_scale_ptr + group)
        return scale

    @triton.jit
    def _softmax_start(scale, k_scale_ptr, group, ROWS: tl.constexpr, DP: tl.constexpr, FP8: tl.constexpr):
        """The score scale (`_score_scale`) and an empty running max, sum and output."""
        return (_score_scale(scale, k_scale_ptr, group, FP8), tl.full((ROWS,), -1e30, dtype=tl.float32),
                tl.zeros((ROWS,), dtype=tl.float32), tl.zeros((ROWS, DP), dtype=tl.float32))

    @triton.jit
    def _softmax_end(acc, total, v_scale_ptr, group, FP8: tl.constexpr):
        """The output: the running output over the running sum (rows with no key: 0), float8 values' scale applied."""
        if FP8:
            acc = acc * tl.load(v_scale_ptr + group)
        return acc / tl.where(total > 0, total, 1.0)[:, None]

    @triton.jit
    def _load_keys_values(k_ptr, v_ptr, tables_ptr, table_row, keys, key_ok, group, max_blocks, stride_kb,
                          stride_kt, stride_kh, d, d_ok, BS: tl.constexpr):
        """The key and value rows at positions `keys` of one KV head of a row, as stored (rows not `key_ok`:
        zeros, their blocks not looked up)."""
        page = tl.minimum(keys // BS, max_blocks - 1)
        block = tl.load(tables_ptr + table_row + page, mask=key_ok, other=0).to(tl.int64)
        offsets = block * stride_kb + (keys % BS).to(tl.int64) * stride_kt + group * stride_kh
        mask = key_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + offsets[:, None] + d[None, :], mask=mask, other=0.0)
        v = tl.load(v_ptr + offsets[:, None] + d[None, :], mask=mask, other=0.0)
        return k, v

    @triton.jit
    def _attend_block(q, k_ptr, v_ptr, tables_ptr, table_row, keys, allowed, group, max_blocks, stride_kb, stride_kt,
                      stride_kh, d, d_ok, qk_scale, m, total, acc, BS: tl.constexpr, FP8: tl.constexpr,
                      PRECISION: tl.constexpr, MASKED: tl.constexpr = True):
        """One online-softmax update of `q`'s rows with the keys and values at positions `keys` of one KV head of a
        row (`allowed`: which (query, key) pairs count; not `MASKED`: every pair, `allowed` unread); returns the
        running max, sum and output."""
        if MASKED:
            key_ok = tl.max(allowed.to(tl.int32), 0) > 0
        else:
            key_ok = keys >= 0
        k, v = _load_keys_values(k_ptr, v_ptr, tables_ptr, table_row, keys, key_ok, group, max_blocks, stride_kb,
                                 stride_kt, stride_kh, d, d_ok, BS)
        if FP8:
            k, v = k.to(q.dtype), v.to(q.dtype)  # e4m3 -> q's compute type (float16, see _compute_q)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        if MASKED:
            s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        total = total * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        return m_new, total, acc

    @triton.jit
    def _attend_lanes(q, k_ptr, v_ptr, tables_ptr, table_row, lo, hi, first_key, group, max_blocks, stride_kb,
                      stride_kt, stride_kh, d, d_ok, qk_scale, BS: tl.constexpr, DP: tl.constexpr,
                      LANES: tl.constexpr, UNROLL: tl.constexpr, HALF: tl.constexpr):
        """One query `q [DP]` (float32) over the keys `[lo, hi)` of one KV head of a row: `LANES` online softmaxes
        side by side, lane l taking the keys l, l + LANES, ... (a key row a lane: no reduction across lanes until
        the end, no tensor-core operand layout, no shared memory), `UNROLL` key rows a lane loaded per iteration.
        With `HALF` (float8 values, 16-bit queries) the values are weighted and summed in float16, two a
        instruction. Returns the merged running max `[1]`, sum `[1]` and output `[1, DP]`."""
        lanes = tl.arange(0, LANES)
        m = tl.full((LANES,), -1e30, dtype=tl.float32)
        total = tl.zeros((LANES,), dtype=tl.float32)
        acc = tl.zeros((LANES, DP), dtype=tl.float16 if HALF else tl.float32)
        for start in range(lo, hi, LANES * UNROLL):
            for part in tl.static_range(UNROLL):
                keys = start + part * LANES + lanes
                key_ok = (keys < hi) & (keys >= first_key)
                k, v = _load_keys_values(k_ptr, v_ptr, tables_ptr, table_row, keys, key_ok, group, max_blocks,
                                         stride_kb, stride_kt, stride_kh, d, d_ok, BS)
                k, v = k.to(tl.float32), v.to(acc.dtype)
                s = tl.where(key_ok, tl.sum(q[None, :] * k, 1) * qk_scale, float("-inf"))
                m_new = tl.maximum(m, s)
                alpha = tl.exp2(m - m_new)
                p = tl.exp2(s - m_new)
                total = total * alpha + p
                acc = acc * alpha.to(acc.dtype)[:, None] + p.to(acc.dtype)[:, None] * v
                m = m_new
        top = tl.max(m, 0)
        weight = tl.exp2(m - top)
        merged_total = tl.sum(total * weight, 0)
        merged = tl.sum(acc.to(tl.float32) * weight[:, None], 0)
        return top + tl.zeros((1,), dtype=tl.float32), merged_total + tl.zeros((1,), dtype=tl.float32), merged[None, :]

    @triton.jit
    def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, positions_ptr, k_scale_ptr, v_scale_ptr, out_ptr,
                             lse_ptr, merged_ptr, counters_ptr, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
                             stride_tr, stride_or, stride_oh, stride_os, max_blocks, window, scale, row_bucket,
                             QPG: tl.constexpr, QP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                             BS: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, FP8: tl.constexpr,
                             WINDOWED: tl.constexpr, PRECISION: tl.constexpr, MERGE: tl.constexpr,
                             GROUP_MAJOR: tl.constexpr, LANES: tl.constexpr = 0, UNROLL: tl.constexpr = 1,
                             PDL: tl.constexpr = False):
        """One (row, KV head, split), the grid ``(rows, KV heads, splits)`` or with ``GROUP_MAJOR`` ``(KV heads,
        rows, splits)``: online softmax over the split's keys for the KV head's query heads. With
        ``MERGE`` the split that finishes last (its ticket from ``counters_ptr``) merges the row's splits into
        ``merged_ptr`` (laid out as ``q``) and sets the ticket back to zero. PDL: launched as a dependent
        (`triton_launch`), it waits first."""
        start_dependents(PDL)
        wait_for_producers(PDL)
        if GROUP_MAJOR:  # programs side by side read the same positions of every KV head: longer runs of bytes
            group, row, groups = tl.program_id(0), tl.program_id(1), tl.num_programs(0)
        else:
            row, group, groups = tl.program_id(0), tl.program_id(1), tl.num_programs(1)
        split = tl.program_id(2)
        position = tl.load(positions_ptr + row).to(tl.int32)
        context = position + 1
        first_key = 0
        if WINDOWED:
            first_key = tl.maximum(position - window, 0)
        first_tile = first_key // BLOCK_N
        per_split = tl.cdiv(tl.cdiv(context, BLOCK_N) - first_tile, SPLITS)
        lo = (first_tile + split * per_split) * BLOCK_N
        hi = tl.minimum(lo + per_split * BLOCK_N, context)
        d = tl.arange(0, DP)
        d_ok = d < D
        table_row = row.to(tl.int64) * stride_tr
        if LANES > 0:  # one query head a KV head: LANES independent softmaxes on the CUDA cores, merged at the end
            lane = tl.arange(0, 1)
            head_ok = lane < 1
            heads = group + lane
            q = tl.load(q_ptr + row.to(tl.int64) * stride_qt + group * stride_qh + d, mask=d_ok,
                        other=0.0).to(tl.float32)
            m, total, acc = _attend_lanes(q, k_ptr, v_ptr, tables_ptr, table_row, lo, hi, first_key, group,
                                          max_blocks, stride_kb, stride_kt, stride_kh, d, d_ok,
                                          _score_scale(scale, k_scale_ptr, group, FP8), BS, DP, LANES, UNROLL,
                                          FP8 and q_ptr.dtype.element_ty != tl.float32)
        else:
            lane = tl.arange(0, QP)
            head_ok = lane < QPG
            heads = group * QPG + lane
            q = tl.load(q_ptr + row.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + d[None, :],
                        mask=head_ok[:, None] & d_ok[None, :], other=0.0)
            q = _compute_q(q, FP8)
            qk_scale, m, total, acc = _softmax_start(scale, k_scale_ptr, group, QP, DP, FP8)
            for start in range(lo, hi, BLOCK_N):
                keys = start + tl.arange(0, BLOCK_N)
                allowed = ((keys < hi) & (keys >= first_key))[None, :] & (lane >= 0)[:, None]
                m, total, acc = _attend_block(q, k_ptr, v_ptr, tables_ptr, table_row, keys, allowed, group,
                                              max_blocks, stride_kb, stride_kt, stride_kh, d, d_ok, qk_scale, m,
                                              total, acc, BS, FP8, PRECISION)
        found = total > 0
        acc = _softmax_end(acc, total, v_scale_ptr, group, FP8)
        out = out_ptr + row.to(tl.int64) * stride_or + heads[:, None] * stride_oh + split * stride_os + d[None, :]
        if SPLITS == 1:
            tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=head_ok[:, None] & d_ok[None, :])
        else:
            tl.store(out, acc, mask=head_ok[:, None] & d_ok[None, :])
            lse = tl.where(found, m + tl.log2(tl.where(found, total, 1.0)), float("-inf"))
            tl.store(lse_ptr + (row * (QPG * groups) + heads) * SPLITS + split, lse, mask=head_ok)
            if MERGE:
                tl.debug_barrier()  # every thread's partial stored before the ticket is taken (released with it)
                slot = row * groups + group
                if tl.atomic_add(counters_ptr + slot, 1, sem="acq_rel") == SPLITS - 1:
                    tl.store(counters_ptr + slot, 0)
                    _merge_splits(out_ptr + row.to(tl.int64) * stride_or + heads[:, None] * stride_oh + d[None, :],
                                  lse_ptr + (row * (QPG * groups) + heads) * SPLITS,
                                  merged_ptr + row.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + d[None, :],
                                  head_ok[:, None] & d_ok[None, :], head_ok, stride_os, 1 if LANES > 0 else QP,
                                  DP, SPLITS)

    @triton.jit
    def _merge_splits(partial_ptrs, lse_ptrs, out_ptrs, mask, rows_ok, stride_os, ROWS: tl.constexpr,
                      DP: tl.constexpr, SPLITS: tl.constexpr):
        """The splits' partial outputs (``partial_ptrs + split * stride_os``, read past the L1 cache: other
        programs wrote them) weighted by their share of the softmax mass (``lse_ptrs + split``), into
        ``out_ptrs``."""
        running = tl.full((ROWS,), -1e30, dtype=tl.float32)
        mass = tl.zeros((ROWS,), dtype=tl.float32)
        acc = tl.zeros((ROWS, DP), dtype=tl.float32)
        for split in tl.static_range(SPLITS):
            lse = tl.load(lse_ptrs + split, mask=rows_ok, other=float("-inf"), cache_modifier=".cg")
            partial = tl.load(partial_ptrs + split * stride_os, mask=mask, other=0.0, cache_modifier=".cg")
            new = tl.maximum(running, lse)
            alpha = tl.exp2(running - new)
            weight = tl.where(lse > float("-inf"), tl.exp2(lse - new), 0.0)
            mass = mass * alpha + weight
            acc = acc * alpha[:, None] + partial * weight[:, None]
            running = new
        tl.store(out_ptrs, (acc / tl.where(mass > 0, mass, 1.0)[:, None]).to(out_ptrs.dtype.element_ty), mask=mask)

    @triton.jit
    def _paged_merge_kernel(partial_ptr, lse_ptr, out_ptr, stride_pr, stride_ph, stride_ps, stride_or, stride_oh,
                            SPLITS: tl.constexpr, SP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr):
        """One (row, head): the splits' partial outputs weighted by their share of the softmax mass."""
        row = tl.program_id(0)
        head = tl.program_id(1)
        split = tl.arange(0, SP)
        split_ok = split < SPLITS
        lse = tl.load(lse_ptr + (row * tl.num_programs(1) + head) * SPLITS + split, mask=split_ok,
                      other=float("-inf"))
        used = split_ok & (lse > float("-inf"))  # splits that saw a key (a chunk's uncovered query: none)
        weight = tl.where(used, tl.exp2(lse - tl.maximum(tl.max(lse, 0), -1e30)), 0.0)
        d = tl.arange(0, DP)
        d_ok = d < D
        partial = tl.load(partial_ptr + row.to(tl.int64) * stride_pr + head * stride_ph
                          + split[:, None] * stride_ps + d[None, :], mask=used[:, None] & d_ok[None, :], other=0.0)
        mass = tl.sum(weight, 0)
        out = tl.sum(partial * weight[:, None], 0) / tl.where(mass > 0, mass, 1.0)
        tl.store(out_ptr + row.to(tl.int64) * stride_or + head * stride_oh + d, out.to(out_ptr.dtype.element_ty),
                 mask=d_ok)

    @triton.jit
    def _paged_chunk_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, tiles_ptr, k_scale_ptr, v_scale_ptr, out_ptr, lse_ptr,
                            merged_ptr, counters_ptr, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
                            stride_tr, stride_ot, stride_oh, stride_os, max_blocks, window, scale, QPG: tl.constexpr,
                            D: tl.constexpr, DP: tl.constexpr, BS: tl.constexpr, TILE: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, FP8: tl.constexpr,
                            WINDOWED: tl.constexpr, PRECISION: tl.constexpr, MERGE: tl.constexpr,
                            PDL: tl.constexpr = False):
        """One (``BLOCK_M`` queries of a ``TILE``-query tile, head, split): causal online softmax over the split's
        share of those queries' keys (with ``MERGE``, the last split to finish merges them into ``merged_ptr``,
        laid out as ``q``). A tile's part past its query count does nothing. PDL: launched as a dependent, it
        waits first."""
        start_dependents(PDL)
        wait_for_producers(PDL)
        program = tl.program_id(0)
        tile = program // (TILE // BLOCK_M)
        part = (program % (TILE // BLOCK_M)) * BLOCK_M
        head = tl.program_id(1)
        split = tl.program_id(2)
        sequence = tl.load(tiles_ptr + tile * 4)
        count = tl.minimum(tl.load(tiles_ptr + tile * 4 + 2) - part, BLOCK_M)
        if (sequence >= 0) & (count > 0):
            first = tl.load(tiles_ptr + tile * 4 + 1) + part
            start = tl.load(tiles_ptr + tile * 4 + 3) + part
            group = head // QPG
            rows = tl.arange(0, BLOCK_M)
            row_ok = rows < count
            query_positions = start + rows
            d = tl.arange(0, DP)
            d_ok = d < D
            tokens = (first + rows).to(tl.int64)
            q = tl.load(q_ptr + tokens[:, None] * stride_qt + head * stride_qh + d[None, :],
                        mask=row_ok[:, None] & d_ok[None, :], other=0.0)
            q = _compute_q(q, FP8)
            end = start + count
            lo = 0
            if WINDOWED:
                lo = (tl.maximum(start - window, 0) // BLOCK_N) * BLOCK_N
            qk_scale, m, total, acc = _softmax_start(scale, k_scale_ptr, group, BLOCK_M, DP, FP8)
            table_row = sequence.to(tl.int64) * stride_tr
            # whole key tiles before the tile's first query: every query attends to every key, no mask to apply
            # (padding queries compute on zeros and are not stored)
            diagonal = lo
            if not WINDOWED:
                diagonal = (start // BLOCK_N) * BLOCK_N
            per_split = tl.cdiv(tl.cdiv(end - lo, BLOCK_N), SPLITS) * BLOCK_N
            lo = lo + split * per_split
            hi = tl.minimum(lo + per_split, end)
            for key_start in range(lo, tl.minimum(hi, diagonal), BLOCK_N):
                keys = key_start + tl.arange(0, BLOCK_N)
                m, total, acc = _attend_block(q, k_ptr, v_ptr, tables_ptr, table_row, keys, keys[None, :] >= 0,
                                              group, max_blocks, stride_kb, stride_kt, stride_kh, d, d_ok, qk_scale,
                                              m, total, acc, BS, FP8, PRECISION, MASKED=False)
            for key_start in range(tl.maximum(lo, diagonal), hi, BLOCK_N):
                keys = key_start + tl.arange(0, BLOCK_N)
                allowed = (keys < hi)[None, :] & (keys[None, :] <= query_positions[:, None]) & row_ok[:, None]
                if WINDOWED:
                    allowed = allowed & (keys[None, :] >= query_positions[:, None] - window)
                m, total, acc = _attend_block(q, k_ptr, v_ptr, tables_ptr, table_row, keys, allowed, group,
                                              max_blocks, stride_kb, stride_kt, stride_kh, d, d_ok, qk_scale, m,
                                              total, acc, BS, FP8, PRECISION)
            found = total > 0
            acc = _softmax_end(acc, total, v_scale_ptr, group, FP8)
            out = out_ptr + tokens[:, None] * stride_ot + head * stride_oh + split * stride_os + d[None, :]
            if SPLITS == 1:
                tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
            else:
                tl.store(out, acc, mask=row_ok[:, None] & d_ok[None, :])
                lse = tl.where(found, m + tl.log2(tl.where(found, total, 1.0)), float("-inf"))
                tl.store(lse_ptr + (tokens * tl.num_programs(1) + head) * SPLITS + split, lse, mask=row_ok)
                if MERGE:
                    tl.debug_barrier()
                    slot = program * tl.num_programs(1) + head
                    if tl.atomic_add(counters_ptr + slot, 1, sem="acq_rel") == SPLITS - 1:
                        tl.store(counters_ptr + slot, 0)
                        _merge_splits(out_ptr + tokens[:, None] * stride_ot + head * stride_oh + d[None, :],
                                      lse_ptr + (tokens * tl.num_programs(1) + head) * SPLITS,
                                      merged_ptr + tokens[:, None] * stride_qt + head * stride_qh + d[None, :],
                                      row_ok[:, None] & d_ok[None, :], row_ok, stride_os, BLOCK_M, DP, SPLITS)

    # Decode reads the cache once: the configurations vary the keys per iteration and the pipelining depth that
    # keep HBM busy (H100: 64-128 keys of 128-dim bf16 per iteration, 2-4 stages; float8 halves the bytes).
    # Each also with the KV heads' programs side by side (GROUP_MAJOR) for the shapes likeliest to win: a float8
    # key row of one head is 128 bytes, 4 KB apart from the next position's, and its neighbours in memory are the
    # other heads' rows of the same position.
    _DECODE_CONFIGS = [
        triton.Config({"BLOCK_N": n, "GROUP_MAJOR": major}, num_warps=warps, num_stages=stages)
        for n, warps, stages, major in ((64, 4, 3, False), (32, 2, 3, False), (32, 4, 4, False), (64, 4, 2, False),
                                        (64, 8, 3, False), (128, 4, 2, False), (128, 8, 2, False),
                                        (128, 8, 3, False), (256, 8, 2, False), (64, 4, 3, True),
                                        (128, 4, 2, True), (128, 8, 2, True))
    ]
    # A float8 cache: the same shapes with twice the positions per iteration (the same bytes in flight), and
    # deeper pipelines of them; and programs of one or two warps over one or two blocks an iteration, which win
    # with many rows (H100, 128 rows of 672 positions: one warp over 32 positions reads at 0.91 of the copy
    # bandwidth, against 0.84 for the best of the others).
    _DECODE_FP8_CONFIGS = [
        triton.Config({"BLOCK_N": n, "GROUP_MAJOR": major}, num_warps=warps, num_stages=stages)
        for n, warps, stages, major in ((128, 4, 3, False), (64, 2, 3, False), (64, 4, 4, False),
                                        (128, 4, 2, False), (128, 8, 3, False), (256, 4, 2, False),
                                        (256, 8, 2, False), (256, 4, 3, False), (128, 4, 4, False),
                                        (128, 4, 3, True), (256, 4, 2, True), (256, 8, 2, True), (256, 4, 3, True),
                                        (32, 1, 3, False), (32, 1, 4, False), (32, 1, 3, True), (64, 2, 3, True))
    ]
    # A float8 cache with one query head a KV head (MHA): also key rows a lane on the CUDA cores
    # (`_attend_lanes`), first (the interpreter runs the first configuration)
    _LANES_CONFIGS = [
        triton.Config({"BLOCK_N": lanes * unroll, "GROUP_MAJOR": major, "LANES": lanes, "UNROLL": unroll},
                      num_warps=warps, num_stages=1)
        for lanes, unroll, warps, major in ((4, 4, 1, False), (4, 8, 1, False), (8, 4, 2, False), (8, 8, 2, False),
                                            (16, 4, 4, False), (16, 2, 4, False), (8, 4, 1, False),
                                            (4, 4, 1, True), (8, 4, 2, True), (16, 4, 4, True))
    ]
    # A chunk over a long prefix is bound by its products (H100, 16k keys: ~250 TFLOP/s). Programs of 64 queries
    # (two per 128-query tile): on the H100 they won at every split count against programs of a whole tile (8
    # warps, 128 x 32-128 keys), which were dropped as candidates for the compile time they added to a first start.
    _CHUNK_CONFIGS = [
        triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=warps, num_stages=stages)
        for m, n, warps, stages in ((64, 64, 4, 2), (64, 32, 4, 2), (64, 64, 4, 3), (64, 64, 8, 3), (64, 128, 8, 2),
                                    (64, 128, 8, 3))
    ]
    _CHUNK_PARTS = CHUNK_TILE // min(config.kwargs["BLOCK_M"] for config in _CHUNK_CONFIGS)
    # The interpreter (TRITON_INTERPRET=1, CPU checks) cannot time configurations: it runs the first.
    # registered: the kernel cache keeps their results (and `tuned_kinds`), so a restart times none of them again
    _decode_tuned, _decode_tuned_fp8, _decode_tuned_mha_fp8 = (
        register_tuned(name, triton.autotune(configs=configs[:1] if _INTERPRETED else configs,
                                             key=["row_bucket", "QPG", "D", "BS", "SPLITS", "FP8", "stride_kt"],
                                             do_bench=time_candidate)(_paged_decode_kernel))
        for name, configs in (("paged_decode", _DECODE_CONFIGS), ("paged_decode_fp8", _DECODE_FP8_CONFIGS),
                              ("paged_decode_mha_fp8", _LANES_CONFIGS + _DECODE_FP8_CONFIGS)))
    _chunk_tuned = register_tuned("paged_chunk", triton.autotune(
        configs=_CHUNK_CONFIGS[:1] if _INTERPRETED else _CHUNK_CONFIGS,
        key=["QPG", "D", "BS", "SPLITS", "FP8", "stride_kt"], do_bench=time_candidate,
    )(_paged_chunk_kernel))
