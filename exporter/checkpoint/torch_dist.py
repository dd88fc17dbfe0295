"""torch_dist (torch.distributed.checkpoint) folders, read in one process with no process group."""

from __future__ import annotations

import functools
import io
from collections.abc import Callable

import torch

from .archive import Archive, NemoCheckpointError, reading
from .names import LAYER_KEY, canonical_name
from .safe_pickle import load_dist_metadata, load_tensors
from .streaming import Piece, Window, as_rows, fill


class DistReader:
    """Reads a torch_dist checkpoint folder into canonical per-layer tensors, streaming chunks into place."""

    def __init__(self, archive: Archive, folder: str):
        self._archive, self._folder = archive, folder
        name = folder + ".metadata"
        with archive.open(name) as handle, reading(archive.path, name):
            self._metadata = load_dist_metadata(handle, f"{archive.path}: {name}")

    def load(self, renamed: Callable[[str], str]) -> dict[str, torch.Tensor]:
        """Every tensor under its canonical name (after `renamed`); stacked layers become one tensor each."""
        out: dict[str, torch.Tensor] = {}
        jobs = []
        for key, entry in self._metadata.state_dict_metadata.items():
            stored = renamed(key)
            canonical = canonical_name(stored)
            if canonical is None or not hasattr(entry, "chunks"):  # dropped, or bytes (a TE extra state)
                continue
            size, dtype = list(entry.size), entry.properties.dtype
            if canonical.startswith("decoder.layers.") and not LAYER_KEY.match(canonical):  # stacked layers
                target = [torch.empty(size[1:], dtype=dtype) for _ in range(size[0])]
                out.update((canonical_name(_layer_key(stored, i)), layer) for i, layer in enumerate(target))
            else:
                target = out[canonical] = torch.empty(size, dtype=dtype)
            for index, chunk in enumerate(entry.chunks):
                info = self._storage_info(key, index, chunk)
                jobs.append((info.relative_path, info.offset, info.length, _chunk_pieces(target, chunk)))
        for relative_path, offset, length, pieces in sorted(jobs, key=lambda job: job[:2]):
            self._fill_chunk(self._folder + relative_path, offset, length, pieces)
        return out

    def _fill_chunk(self, name: str, offset: int, length: int, pieces: list[Piece]) -> None:
        """Stream one chunk (a torch.save stream at `offset` of member `name`) into its pieces."""
        def load(map_location: str) -> torch.Tensor:
            window = io.BufferedReader(Window(handle, offset, length), 1 << 20)
            return load_tensors(window, map_location)

        with self._archive.open(name) as handle, reading(self._archive.path, name):
            fill(handle, offset, load("meta"), pieces, functools.partial(load, "cpu"))

    def _storage_info(self, key: str, index: int, chunk):
        from torch.distributed.checkpoint.metadata import MetadataIndex

        info = self._metadata.storage_data.get(MetadataIndex(key, chunk.offsets, index))
        if info is None or getattr(info, "transform_descriptors", None):
            problem = f"unsupported transforms {info.transform_descriptors}" if info else "no storage entry"
            raise NemoCheckpointError(
                f"{self._archive.path}: {self._folder}.metadata has {problem} for {key} "
                f"at {list(chunk.offsets)}"
            )
        return info


def _layer_key(stacked_key: str, layer: int) -> str:
    """The per-layer stored key of a stacked key: `….decoder.layers.X` -> `….decoder.layers.<layer>.X`."""
    head, _, tail = stacked_key.partition("decoder.layers.")
    return f"{head}decoder.layers.{layer}.{tail}"


def _chunk_pieces(target: torch.Tensor | list[torch.Tensor], chunk) -> list[Piece]:
    """Where the rows of a dist chunk go, in a tensor or in stacked per-layer tensors (one row per layer)."""
    offsets, sizes = list(chunk.offsets), list(chunk.sizes)
    inner = tuple(slice(o, o + s) for o, s in zip(offsets[1:], sizes[1:]))
    if isinstance(target, list):
        return [(j, target[offsets[0] + j][inner].unsqueeze(0)) for j in range(sizes[0])]
    if not sizes:
        return [(0, as_rows(target))]
    return [(0, target[(slice(offsets[0], offsets[0] + sizes[0]), *inner)])]

