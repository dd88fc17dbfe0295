"""The scheduler's bookkeeping of the paged KV cache: the pool's size, which blocks are free, which rows hold them,
and which hold a prompt prefix another request can reuse.

Blocks are counted here, on the host; their contents live in `exporter.llm.paged_attention.PagedKVCache`. A block
has a reference count (the requests whose block tables hold it). A full block of a prompt is indexed by a chained
key of everything before and in it (`prefix_keys`): a later prompt that starts the same way takes those blocks
instead of computing them. A block whose count drops to 0 keeps its contents and its key while the pool can spare
it; when the pool needs blocks it takes never-used ones first, then the cached ones released longest ago.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..llm.model import Decoder
from ..llm.paged_attention import PagedKVCache, kv_scales_from_amax
from ..llm.sampling import host_to_device

KV_CACHE_DTYPES = ("auto", "fp8")
CPU_DEFAULT_MAX_BYTES = 4 << 30  # the CPU pool's default budget is a static cache's size, at most this


@dataclass(frozen=True)
class KVCacheOptions:
    """How the KV cache is sized and used (TensorRT-LLM's option names).

    free_gpu_mem_fraction: on CUDA, the share of the memory left free after the weights, the encoder and an
        activation reserve that the pool takes.
    max_bytes: the pool's byte budget: on the CPU its size (default: what a static cache of every row at its
        longest would take, at most 4 GiB), on CUDA a cap.
    dtype: "auto" (the model's dtype) or "fp8" (float8 e4m3 with static per-head scales; CUDA GPUs with FP8).
    enable_reuse: share the blocks of identical prompt prefixes (token ids and media) between requests.
    block_size: positions per block.
    """

    free_gpu_mem_fraction: float = 0.9
    max_bytes: int | None = None
    dtype: str = "auto"
    enable_reuse: bool = True
    block_size: int = 32

    def __post_init__(self) -> None:
        if not 0.0 < self.free_gpu_mem_fraction <= 1.0:
            raise ValueError(f"kv_cache_free_gpu_mem_fraction must be in (0, 1], got {self.free_gpu_mem_fraction}")
        if self.max_bytes is not None and self.max_bytes < 1:
            raise ValueError(f"kv_cache_bytes must be positive, got {self.max_bytes}")
        if self.dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype {self.dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
        if self.block_size < 1:
            raise ValueError(f"the KV-cache block size must be at least 1, got {self.block_size}")


def allocate_cache(model: Decoder, options: KVCacheOptions, *, rows: int, blocks_per_row: int, reserve_bytes: int = 0,
                   scales: Tensor | None = None) -> PagedKVCache:
    """The paged cache `options` ask for, for `rows` rows of `blocks_per_row` blocks (`pool_size`); a float8 one
    with `scales` (default: `calibrated_kv_scales`)."""
    if options.dtype == "fp8":
        device = model.device
        if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
            raise ValueError(f"kv_cache_dtype fp8 needs a GPU with FP8 (compute capability 8.9 or later); "
                             f"{torch.cuda.get_device_name(device)} has {torch.cuda.get_device_capability(device)}; "
                             "use kv_cache_dtype auto")
        scales = scales if scales is not None else calibrated_kv_scales(model)
    else:
        scales = None
    blocks = pool_size(options, block_bytes=block_bytes(model, options), rows=rows, blocks_per_row=blocks_per_row,
                       device=model.device, reserve_bytes=reserve_bytes)
    return model.new_paged_kv_cache(blocks, options.block_size, scales)


def block_bytes(model: Decoder, options: KVCacheOptions) -> int:
    """The bytes of one KV-cache block of `model` (keys and values of every layer) as `options` ask for it."""
    c = model.config
    element = 1 if options.dtype == "fp8" else model.dtype.itemsize
    return 2 * c.num_layers * options.block_size * model.kv_heads * c.head_dim * element


def pool_size(options: KVCacheOptions, *, block_bytes: int, rows: int, blocks_per_row: int,
              device: torch.device, reserve_bytes: int = 0) -> int:
    """Blocks in the pool, the null block included. On CUDA: `free_gpu_mem_fraction` of the free memory less
    `reserve_bytes`, capped by `max_bytes` and by twice what `rows` rows at their longest can hold (the second half
    keeps reusable prefixes); on the CPU: `max_bytes`, by default a static cache's size (capped)."""
    static = rows * blocks_per_row
    if device.type == "cuda":
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(options.free_gpu_mem_fraction * max(free - reserve_bytes, 0))
        if options.max_bytes is not None:
            budget = min(budget, options.max_bytes)
        blocks = min(budget // block_bytes, 2 * static)
    elif options.max_bytes is not None:
        blocks = options.max_bytes // block_bytes
    else:
        blocks = min(static, CPU_DEFAULT_MAX_BYTES // block_bytes)
    return 1 + blocks


def calibrated_kv_scales(model: Decoder, prompt: Tensor | None = None) -> Tensor:
    """Float8 KV-cache scales `[layers, 2, kv_heads]` from the largest keys and values of one prompt `[T, H]`
    (default: 256 token ids spread over the vocabulary; every layer normalises its input, so a layer's keys and
    values have about the same range whatever the tokens or media)."""
    if prompt is None:
        count = min(256, model.config.vocab_size, model.config.max_position_embeddings or 256)
        ids = torch.linspace(0, model.config.vocab_size - 1, count).long().to(model.device)
        prompt = model.embed(ids)
    with torch.inference_mode():
        cache = model.new_kv_cache(1, len(prompt))
        model(prompt[None].to(model.dtype), kv_cache=cache)
        return kv_scales_from_amax(cache.data[:, :, 0].abs().amax(dim=(2, 4)))


def prefix_keys(content: Sequence[Hashable | None], block_size: int, salt: str = "") -> list[bytes]:
    """The chained keys of a prompt's full blocks: key i covers every position before and in block i. `content` is
    one item per position: a token id, or for a media feature its media's key and offset; None where unknown (the
    keys stop before the block holding it). `salt` names what else changes the keys and values (a LoRA adapter).

    A block of 64-bit ints (token ids; the Pipeline's media positions too, see `pipeline.prompt_prefix`) is hashed
    as their bytes, packed for the whole prompt at once; any other block as its items' repr, tagged apart."""
    keys: list[bytes] = []
    previous = hashlib.blake2b(salt.encode(), digest_size=16).digest()
    full = len(content) - len(content) % block_size
    packed = _packed(content[:full])
    width = block_size * 8
    for start in range(0, full, block_size):
        if packed is not None:
            block = b"i" + packed[start * 8:start * 8 + width]
        else:
            items = tuple(content[start:start + block_size])
            if any(item is None for item in items):
                break
            ints = _packed(items)
            block = b"i" + ints if ints is not None else b"r" + repr(items).encode()
        previous = hashlib.blake2b(previous + block, digest_size=16).digest()
        keys.append(previous)
    return keys


def _packed(items: Sequence) -> bytes | None:
    """The items' bytes as signed 64-bit ints, or None if any is not such an int."""
    try:
        return array("q", items).tobytes()
    except (TypeError, OverflowError):
        return None


class BlockPool:
    """Reference counts of `num_blocks` blocks (block 0, the null block, is never handed out), the free ones, and
    the index of full prompt blocks by their prefix key (see the module docstring)."""

    def __init__(self, num_blocks: int):
        if num_blocks < 2:
            raise ValueError(f"the KV-cache pool needs at least 2 blocks (one is the null block), got {num_blocks}")
        self.refs = [0] * num_blocks
        self.free = list(range(num_blocks - 1, 0, -1))  # popped from the end: lowest first
        self.cached: OrderedDict[int, None] = OrderedDict()  # unreferenced indexed blocks, oldest release first
        self.index: dict[bytes, int] = {}
        self.keys: dict[int, bytes] = {}

    @property
    def capacity(self) -> int:
        """Blocks that can be handed out (all but the null block)."""
        return len(self.refs) - 1

    @property
    def available(self) -> int:
        """Blocks an allocation can take: free, or cached and unreferenced."""
        return len(self.free) + len(self.cached)

    @property
    def used(self) -> int:
        """Blocks some request holds."""
        return self.capacity - self.available

    def can_allocate(self, count: int, reused: Sequence[int] = ()) -> bool:
        """Whether `count` new blocks fit once the `reused` blocks (from `lookup`) are taken too."""
        return count + sum(block in self.cached for block in set(reused)) <= self.available

    def allocate(self, count: int) -> list[int]:
        """`count` blocks, each referenced once: free ones first, then the cached ones released longest ago."""
        if count > self.available:
            raise RuntimeError(f"the KV-cache pool has {self.available} blocks left, {count} were asked for")
        blocks = []
        for _ in range(count):
            if self.free:
                block = self.free.pop()
            else:
                block, _ = self.cached.popitem(last=False)
                del self.index[self.keys.pop(block)]
            self.refs[block] = 1
            blocks.append(block)
        return blocks

    def share(self, blocks: Sequence[int]) -> None:
        """One more reference to each block (a cached one is taken out of the cache)."""
        for block in blocks:
            self.refs[block] += 1
            self.cached.pop(block, None)

    def release(self, blocks: Sequence[int]) -> None:
        """One reference less to each block; an unreferenced one becomes free, or cached if indexed (blocks
        released together are evicted in reverse order: a prompt's last blocks before its first)."""
        for block in reversed(blocks):
            self.refs[block] -= 1
            if self.refs[block] == 0:
                if block in self.keys:
                    self.cached[block] = None
                else:
                    self.free.append(block)

    def lookup(self, keys: Sequence[bytes]) -> list[int]:
        """The blocks indexed under the leading `keys` (stops at the first key not indexed)."""
        blocks = []
        for key in keys:
            block = self.index.get(key)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def register(self, block: int, key: bytes) -> None:
        """Index a referenced block's contents under `key` (the first block registered for a key keeps it)."""
        if key not in self.index and block not in self.keys:
            self.index[key] = block
            self.keys[block] = key

    def forget(self) -> None:
        """Drop the index (after a failed step, whose blocks may hold anything): cached blocks become free."""
        self.free.extend(self.cached)
        self.cached.clear()
        self.index.clear()
        self.keys.clear()


class BlockTables:
    """Every scheduler row's block table on the device, `tensor [rows, width]` int32 (what the decode step reads); an
    idle row's is all null blocks."""

    def __init__(self, rows: int, width: int, device: torch.device):
        self.tensor = torch.zeros(rows, width, dtype=torch.int32, device=device)

    @property
    def width(self) -> int:
        return self.tensor.shape[1]

    def set(self, first: int, tables: Sequence[Sequence[int]]) -> None:
        """Rows `[first, first + len(tables))` get these tables (padded with the null block)."""
        rows = [list(blocks) + [0] * (self.width - len(blocks)) for blocks in tables]
        self.tensor[first:first + len(tables)].copy_(host_to_device(rows, torch.int32, self.tensor.device))

    def clear(self, first: int, count: int) -> None:
        self.tensor[first:first + count] = 0
