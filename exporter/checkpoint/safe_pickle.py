"""Unpickling the pickles a checkpoint holds without running their code: exact (module, name) allow-lists.

A `.nemo` comes from hubs and colleagues, so every pickle in it is hostile until read:

- a torch_dist `.metadata` is read by `load_dist_metadata`: an unpickler that resolves only the exact
  (module, name) pairs a `torch.distributed.checkpoint` metadata file references (torch 2.5 to 2.13), from a fixed
  table (no import, no attribute path, no builtins), lets BUILD set state only on instances of those classes, and
  refuses extension codes and persistent ids;
- legacy weight files (`model_weights.ckpt`) go through `torch.load(weights_only=True)` with the smallest extra
  allow-list a real NeMo file needs (`load_tensors` with `LEGACY_SAFE_GLOBALS`), torch_dist chunks with none.
"""

from __future__ import annotations

import collections
import functools
import io
import pathlib
import pickle
import typing
from collections.abc import Sequence
from typing import IO, TYPE_CHECKING, Any

import omegaconf
import torch

from .archive import NemoCheckpointError

if TYPE_CHECKING:
    from torch.distributed.checkpoint import metadata as dcp_metadata

#: Extra globals of legacy weight files: TE extra states (BytesIO; an empty one pickles `bytes`) and a PTL
#: `hyper_parameters.cfg` DictConfig.
LEGACY_SAFE_GLOBALS = [
    io.BytesIO, bytes, dict, list, int, collections.defaultdict, typing.Any, omegaconf.DictConfig, omegaconf.ListConfig,
    omegaconf.base.ContainerMetadata, omegaconf.base.Metadata, omegaconf.nodes.AnyNode,
]

_LAYOUTS = {str(value): value for value in vars(torch).values() if isinstance(value, torch.layout)}


def _layout(name: str) -> torch.layout:
    """Stands in for `torch.serialization._get_layout`: a layout by its name, nothing else."""
    if not isinstance(name, str) or name not in _LAYOUTS:
        raise pickle.UnpicklingError(f"unknown tensor layout {name!r}")
    return _LAYOUTS[name]


@functools.cache
def _metadata_tables() -> tuple[dict[tuple[str, str], Any], frozenset]:
    """(module, name) -> object: everything a `.metadata` pickle may name; and the classes BUILD may set state on
    (fresh instances of them only). `torch.distributed.checkpoint` is imported here, when a torch_dist checkpoint
    is read: its import takes seconds, which a server's start does not pay."""
    from torch.distributed.checkpoint import filesystem as dcp_filesystem
    from torch.distributed.checkpoint import metadata as dcp_metadata

    classes = (dcp_metadata.Metadata, dcp_metadata.StorageMeta, dcp_metadata.TensorStorageMetadata,
               dcp_metadata.BytesStorageMetadata, dcp_metadata.ChunkStorageMetadata, dcp_metadata.TensorProperties,
               dcp_metadata.MetadataIndex, dcp_filesystem._StorageInfo)
    names = {
        **{(cls.__module__, cls.__name__): cls for cls in classes},
        # TensorProperties' memory format, called with its value (its members are singletons: never BUILD targets)
        ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"): dcp_metadata._MEM_FORMAT_ENCODING,
        ("torch", "Size"): torch.Size,
        **{("torch", name): value for name, value in vars(torch).items() if isinstance(value, torch.dtype)},
        ("torch.serialization", "_get_layout"): _layout,
        ("pathlib", "PosixPath"): pathlib.PosixPath,  # StorageMeta.checkpoint_id: the folder the writer saved to
        ("pathlib._local", "PosixPath"): pathlib.PosixPath,  # the same class, as Python 3.13 names it
    }
    return names, frozenset((*classes, pathlib.PosixPath))


class _MetadataUnpickler(pickle._Unpickler):
    """The pure-Python unpickler (its opcode table can be narrowed) with the table above as its only globals."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def find_class(self, module: str, name: str) -> Any:
        found = _metadata_tables()[0].get((module, name))
        if found is None:
            raise pickle.UnpicklingError(f"refusing to unpickle {module}.{name} (not a torch_dist metadata type)")
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("refusing a persistent id")

    def _load_build(self) -> None:
        """BUILD only on an instance of an allowed class: never on a class, function or module."""
        if type(self.stack[-2]) not in _metadata_tables()[1]:
            raise pickle.UnpicklingError(f"refusing to set the state of {type(self.stack[-2]).__name__}")
        pickle._Unpickler.load_build(self)

    def _refuse_extension(self) -> None:
        raise pickle.UnpicklingError("refusing an extension code")

    dispatch[pickle.BUILD[0]] = _load_build
    for _opcode in (pickle.EXT1, pickle.EXT2, pickle.EXT4):
        dispatch[_opcode[0]] = _refuse_extension
    del _opcode


def load_dist_metadata(handle: IO[bytes], where: str) -> dcp_metadata.Metadata:
    """The `torch.distributed.checkpoint` Metadata pickled in `handle`; `where` names it in errors.

    Any refused name, malformed stream or unexpected structure is a NemoCheckpointError; nothing else runs.
    """
    try:
        metadata = _MetadataUnpickler(handle).load()
    except Exception as err:  # a hostile stream can fail in any way; each is one clear error
        raise NemoCheckpointError(f"{where}: not a readable torch_dist metadata file: {err}") from None
    problem = _metadata_problem(metadata)
    if problem:
        raise NemoCheckpointError(f"{where}: malformed torch_dist metadata: {problem}")
    return metadata


def _metadata_problem(metadata: Any) -> str | None:
    """What is wrong with the structure the reader relies on, or None."""
    from torch.distributed.checkpoint import filesystem as dcp_filesystem
    from torch.distributed.checkpoint import metadata as dcp_metadata

    if type(metadata) is not dcp_metadata.Metadata:
        return f"it holds a {type(metadata).__name__}, not a Metadata"
    entries, storage = metadata.state_dict_metadata, metadata.storage_data
    if not isinstance(entries, dict) or not isinstance(storage, dict):
        return "state_dict_metadata and storage_data must be dicts"
    for key, entry in entries.items():
        if not isinstance(key, str):
            return f"key {key!r} is not a string"
        if isinstance(entry, dcp_metadata.BytesStorageMetadata):
            continue
        if not (isinstance(entry, dcp_metadata.TensorStorageMetadata)
                and isinstance(entry.properties, dcp_metadata.TensorProperties)
                and isinstance(entry.properties.dtype, torch.dtype) and _ints(entry.size)
                and isinstance(entry.chunks, list)
                and all(isinstance(c, dcp_metadata.ChunkStorageMetadata) and _ints(c.offsets) and _ints(c.sizes)
                        for c in entry.chunks)):
            return f"entry {key!r} is not a well-formed tensor entry"
    for index, info in storage.items():
        if not (isinstance(index, dcp_metadata.MetadataIndex) and isinstance(info, dcp_filesystem._StorageInfo)
                and isinstance(info.relative_path, str) and _ints((info.offset, info.length))):
            return f"storage entry {index!r} is not well formed"
    return None


def _ints(values: Any) -> bool:
    return isinstance(values, (tuple, list, torch.Size)) and all(type(v) is int and v >= 0 for v in values)


def load_tensors(handle: IO[bytes], map_location: str, safe_globals: Sequence[Any] = ()) -> Any:
    """torch.load(weights_only=True) of a torch.save stream, allowing `safe_globals` besides torch's own list."""
    try:
        with torch.serialization.safe_globals(list(safe_globals)):
            return torch.load(handle, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:  # torch's text is a page of advice; keep the reason
        reason = str(err).partition("WeightsUnpickler error: ")[2] or str(err)
        raise pickle.UnpicklingError(f"refusing to unpickle it: {reason.split('. ')[0]}") from None
