"""Encoder outputs of media already seen, reused by later requests: a bounded LRU keyed by a hash of the media.

Keys come from the media's content (`media_key`), never from the client, so a request can only reuse features of
media it sends itself. The cache is bounded in entries and in bytes; the least recently used blocks go first.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict
from typing import Any

import numpy as np
import torch
from PIL import Image

DEFAULT_MAX_ENTRIES = 256
DEFAULT_MAX_BYTES = 256 * 1024 * 1024
MAX_CLAIM_WAIT_S = 60.0  # a thread waits at most this long for another's encoding, then encodes the item itself
_FILE_CHUNK = 1 << 20


def media_key(item: Any) -> str | None:
    """A key naming one media item by content: sha256 of encoded bytes (or of a file's bytes), or of raw pixels
    with their dtype and shape; None when the item cannot be hashed (it is then encoded every time)."""
    digest = hashlib.sha256()
    if isinstance(item, (bytes, bytearray, memoryview)):
        digest.update(item)
        return "bytes:" + digest.hexdigest()
    if isinstance(item, np.ndarray) and not item.dtype.hasobject and item.size:  # empty: refused when decoded
        digest.update(f"{item.dtype.str}{item.shape}".encode())
        digest.update(memoryview(np.ascontiguousarray(item)).cast("B"))
        return "array:" + digest.hexdigest()
    if isinstance(item, Image.Image):
        digest.update(f"{item.mode}{item.size}".encode())
        digest.update(item.tobytes())
        return "pil:" + digest.hexdigest()
    if isinstance(item, (str, os.PathLike)):
        try:
            with open(item, "rb") as file:
                while chunk := file.read(_FILE_CHUNK):
                    digest.update(chunk)
        except OSError:
            return None  # loading reports the problem
        return "bytes:" + digest.hexdigest()
    return None


class FeatureCache:
    """Thread-safe LRU of feature blocks ``[n, H]`` by media key, bounded by ``max_entries`` and ``max_bytes``.

    ``max_entries=0`` turns caching off. ``hits`` / ``misses`` count lookups. ``get_or_claim`` lets one thread
    encode a media item that several threads ask for at once while the others wait for its block.
    """

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, max_bytes: int = DEFAULT_MAX_BYTES):
        if max_entries < 0 or max_bytes < 0:
            raise ValueError(f"feature cache bounds must be >= 0, got max_entries={max_entries}, max_bytes={max_bytes}")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.hits = 0
        self.misses = 0
        self._blocks: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._claims: dict[str, tuple[int, threading.Event]] = {}  # key -> (the claiming thread, set when resolved)

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def nbytes(self) -> int:
        """Bytes held by the cached blocks."""
        return self._bytes

    def get(self, key: str | None) -> torch.Tensor | None:
        """The block stored under ``key`` (now the most recently used), or None (counted as a miss)."""
        with self._lock:
            block = self._blocks.get(key) if key is not None else None
            if block is None:
                self.misses += 1
                return None
            self._blocks.move_to_end(key)
            self.hits += 1
            return block

    def get_or_claim(self, key: str | None) -> torch.Tensor | None:
        """Like ``get``; but when the block is missing and another thread has claimed ``key`` (it is encoding the
        same media), first wait until that thread puts or releases it. On a miss the calling thread claims ``key``
        and must later ``put`` or ``release`` it. A thread that holds a claim never waits (no two threads can then
        wait for each other): it gets None and encodes the item itself, as does one that waited
        ``MAX_CLAIM_WAIT_S``."""
        me = threading.get_ident()
        while key is not None and self.max_entries:
            with self._lock:
                if key in self._blocks:
                    break
                claim = self._claims.get(key)
                if claim is None:
                    self._claims[key] = (me, threading.Event())
                    break
                if any(owner == me for owner, _ in self._claims.values()):
                    break
            if not claim[1].wait(MAX_CLAIM_WAIT_S):
                break
        return self.get(key)

    def release(self, keys: list[str | None]) -> None:
        """Give up the calling thread's claims on ``keys`` that are still open (their encoding failed or was not
        needed), waking the threads waiting for them."""
        me = threading.get_ident()
        for key in keys:
            if key is not None:
                self._resolve(key, owner=me)

    def put(self, key: str, block: torch.Tensor) -> None:
        """Store a copy of ``block`` (detached, its own memory) and evict the least recently used past the bounds;
        resolve a claim on ``key``. A block larger than ``max_bytes`` is not stored.
        """
        size = block.numel() * block.element_size()
        if self.max_entries == 0 or size > self.max_bytes:
            self._resolve(key)
            return
        block = block.detach().clone()
        with self._lock:
            old = self._blocks.pop(key, None)
            if old is not None:
                self._bytes -= old.numel() * old.element_size()
            self._blocks[key] = block
            self._bytes += size
            while len(self._blocks) > self.max_entries or self._bytes > self.max_bytes:
                _, evicted = self._blocks.popitem(last=False)
                self._bytes -= evicted.numel() * evicted.element_size()
        self._resolve(key)

    def _resolve(self, key: str, owner: int | None = None) -> None:
        """Close the claim on ``key`` (only ``owner``'s, when given), waking the threads waiting for it."""
        with self._lock:
            claim = self._claims.get(key)
            if claim is None or (owner is not None and claim[0] != owner):
                return
            del self._claims[key]
        claim[1].set()

    def clear(self) -> None:
        """Drop every block and reset the counters."""
        with self._lock:
            self._blocks.clear()
            self._bytes = 0
            self.hits = self.misses = 0

    def stats(self) -> dict[str, int]:
        """Entries, bytes, hits and misses."""
        with self._lock:
            return {"entries": len(self._blocks), "bytes": self._bytes, "hits": self.hits, "misses": self.misses}
