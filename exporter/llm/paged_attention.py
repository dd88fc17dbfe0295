"""A KV cache in fixed-size blocks and the attention that reads it.

`PagedKVCache.data` is `[layers, 2 (keys, values), blocks, block_size, kv_heads, head_dim]`, stored head-major
(`Decoder.new_paged_kv_cache` allocates `[..., blocks, kv_heads, block_size, head_dim]` and hands out this view):
one KV head's keys of a block are one contiguous run (4 KB of float8 at 32 positions of 128 dims), which a decode
kernel program streams; the kernels and the reference take the strides as they come. A row (a request's
sequence) owns a block table: its position `p` lives in block `table[p // block_size]` at offset
`p % block_size`, so rows take only the blocks they need and rows can share blocks (a common prefix). Block 0 is
the null block: idle rows and padding positions write there and nothing real reads it.

One forward call (`PagedBatch`) holds decode tokens first (token `i` is row `i`'s next token) and then a chunk of
prompt pieces (`Chunk`: each sequence a run of consecutive positions of one row). Every token writes its key and
value into its slot before attention, then attends to its row's positions up to its own. On CUDA the Triton
kernels of `paged_triton` do it; elsewhere (and as their reference) the row's blocks are gathered and
`scaled_dot_product_attention` runs on them.

A float8 (e4m3) cache stores `value / scale` with one static scale per (layer, keys or values, KV head)
(`scales [layers, 2, kv_heads]`, from `kv_scales_from_amax`); attention multiplies it back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from . import paged_triton

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3 value
FP8_HEADROOM = 4.0  # scales leave room for keys and values this many times the calibrated largest magnitude


MERGE_SLOTS = 4096  # (row, KV head) pairs a decode kernel with split keys can merge in place (see `counters`)


@dataclass
class PagedKVCache:
    """The block pool of every layer (see the module docstring); `scales` only for a float8 cache. `counters`
    `[MERGE_SLOTS]` int32, zero between calls: the decode kernel's tickets, one per (row, KV head), with which the
    last of its key splits to finish merges them (one kernel per layer, no merge kernel after it); the cache's own,
    as the steps that read it never run concurrently."""

    data: Tensor
    scales: Tensor | None = None
    counters: Tensor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.counters = torch.zeros(MERGE_SLOTS, dtype=torch.int32, device=self.data.device)

    @property
    def block_size(self) -> int:
        return self.data.shape[3]

    @property
    def num_blocks(self) -> int:
        return self.data.shape[2]

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over all layers, keys and values."""
        return self.data[:, :, 0].numel() * self.data.element_size()

    def layer(self, index: int) -> tuple[Tensor, Tensor, Tensor | None]:
        """Keys and values `[blocks, block_size, kv_heads, head_dim]` of one layer and its scales `[2, kv_heads]`."""
        return self.data[index, 0], self.data[index, 1], None if self.scales is None else self.scales[index]

    def copy_blocks_(self, targets: Tensor, sources: Tensor) -> None:
        """Block `targets[i]` gets the contents of block `sources[i]` as they were before the call."""
        self.data[:, :, targets] = self.data[:, :, sources]


def kv_scales_from_amax(amax: Tensor) -> Tensor:
    """Float8 scales `[layers, 2, kv_heads]` from the largest key and value magnitudes seen in calibration, with
    `FP8_HEADROOM` to spare (larger values saturate at the largest e4m3 value)."""
    return (amax.float().clamp(min=1e-4) * FP8_HEADROOM / FP8_MAX).contiguous()


@dataclass
class Chunk:
    """The prompt pieces of a forward call (after its decode tokens): sequence `s` is chunk tokens
    `[first, first + count)` at positions `[start, start + count)` of a row whose block table is `tables[s]`.

    `blocks`/`offsets` `[C]` are each chunk token's write slot (the null block for padding); `tiles [T, 4]` int32 cut
    the sequences into kernel programs of at most `paged_triton.CHUNK_TILE` queries (sequence or -1, first, count,
    start); `sequences` is the same on the host, `(first, count, start)` per sequence, for the reference path;
    `splits`: how many parts the chunk kernel cuts each tile's keys into.
    """

    tables: Tensor
    blocks: Tensor
    offsets: Tensor
    tiles: Tensor
    sequences: tuple[tuple[int, int, int], ...]
    splits: int = 1


@dataclass
class PagedBatch:
    """What one forward call over a paged cache reads and writes.

    rows: the first `rows` tokens are decode tokens, token `i` row `i`'s, at `positions[i]`, attending to blocks
        `tables[i]` (`[>= rows, blocks_per_row]` int32; an idle row's table is all null blocks).
    span: the keys the reference path gathers per decode row (at least every row's position + 1).
    splits: how many parts the decode kernel cuts each row's positions into.
    chunk: the prompt pieces after the decode tokens, or None.
    """

    cache: PagedKVCache
    rows: int = 0
    tables: Tensor | None = None
    positions: Tensor | None = None
    span: int = 0
    splits: int = 1
    chunk: Chunk | None = None

    def write_slots(self) -> tuple[Tensor, Tensor]:
        """Each token's block and offset `[N]` (decode tokens from their tables, on the device)."""
        blocks, offsets = [], []
        if self.rows:
            size = self.cache.block_size
            page = (self.positions // size).clamp(max=self.tables.shape[1] - 1)
            blocks.append(self.tables[: self.rows].gather(1, page[:, None])[:, 0].long())
            offsets.append(self.positions % size)
        if self.chunk is not None:
            blocks.append(self.chunk.blocks)
            offsets.append(self.chunk.offsets)
        if len(blocks) == 1:
            return blocks[0], offsets[0]
        return torch.cat(blocks), torch.cat(offsets)


def paged_attention(q: Tensor, layer: int, batch: PagedBatch, window: int | None) -> Tensor:
    """Attention of every token of `batch` (`q [N, heads, d]`, keys and values already written) over its row's
    cached positions up to its own (and no further back than `window`). Returns `[N, heads, d]`."""
    k, v, scales = batch.cache.layer(layer)
    kernels = q.is_cuda and paged_triton.available()
    parts = []
    if batch.rows:
        decode_q = q[: batch.rows]
        if kernels:
            parts.append(paged_triton.decode(decode_q, k, v, batch.tables, batch.positions, scales, batch.splits,
                                             window, batch.cache.counters))
        else:
            parts.append(_decode_reference(decode_q, k, v, batch, scales, window))
    if batch.chunk is not None:
        chunk_q = q[batch.rows:]
        chunk = batch.chunk
        if kernels:
            parts.append(paged_triton.chunk(chunk_q, k, v, chunk.tables, chunk.tiles, scales, window, chunk.splits,
                                            batch.cache.counters))
        else:
            parts.append(_chunk_reference(chunk_q, k, v, chunk, scales, window))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def gather_positions(k: Tensor, v: Tensor, tables: Tensor, length: int, scales: Tensor | None,
                     dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Keys and values of positions `[0, length)` of rows with block tables `tables [R, *]`, as
    `[R, kv_heads, length, d]` in `dtype` (float8 blocks multiplied back by their scales)."""
    size = k.shape[1]
    count = -(-length // size)
    index = tables[:, :count].long()
    keys, values = (cache[index].flatten(1, 2)[:, :length].transpose(1, 2) for cache in (k, v))
    if scales is not None:
        keys = keys.float() * scales[0][None, :, None, None]
        values = values.float() * scales[1][None, :, None, None]
    return keys.to(dtype), values.to(dtype)


def _allowed(query_positions: Tensor, key_positions: Tensor, window: int | None) -> Tensor:
    """`[..., T, S]`: which keys (positions `[S]`) each query (positions `[..., T]`) attends to."""
    allowed = key_positions <= query_positions[..., None]
    if window is not None:
        allowed &= key_positions >= query_positions[..., None] - window
    return allowed


def _attend(q: Tensor, keys: Tensor, values: Tensor, allowed: Tensor) -> Tensor:
    """`q [B, heads, T, d]` over `keys`/`values` `[B, kv_heads, S, d]`, where `allowed [B, T, S]`."""
    mask = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill_(~allowed, float("-inf"))
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask[:, None],
                                          enable_gqa=keys.shape[1] != q.shape[1])


def _decode_reference(q: Tensor, k: Tensor, v: Tensor, batch: PagedBatch, scales: Tensor | None,
                      window: int | None) -> Tensor:
    keys, values = gather_positions(k, v, batch.tables[: batch.rows], batch.span, scales, q.dtype)
    key_positions = torch.arange(batch.span, device=q.device)
    allowed = _allowed(batch.positions[: batch.rows, None], key_positions, window)  # [R, 1, S]
    return _attend(q[:, :, None], keys, values, allowed)[:, :, 0]


def _chunk_reference(q: Tensor, k: Tensor, v: Tensor, chunk: Chunk, scales: Tensor | None,
                     window: int | None) -> Tensor:
    out = torch.zeros_like(q)
    for sequence, (first, count, start) in enumerate(chunk.sequences):
        keys, values = gather_positions(k, v, chunk.tables[sequence: sequence + 1], start + count, scales, q.dtype)
        query_positions = torch.arange(start, start + count, device=q.device)
        allowed = _allowed(query_positions, torch.arange(start + count, device=q.device), window)
        queries = q[first: first + count].transpose(0, 1)[None]  # [1, heads, count, d]
        out[first: first + count] = _attend(queries, keys, values, allowed[None])[0].transpose(0, 1)
    return out
