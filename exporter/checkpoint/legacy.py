"""Legacy NeMo-1 weight files: `model_weights.ckpt`, TP shards `mp_rank_XX/`, TP x PP `tp_rank_XX_pp_rank_XXX/`.

Each tensor is allocated once at its merged size and every rank's bytes stream into it.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Iterator

import torch

from .archive import Archive, NemoCheckpointError, reading
from .experts import ExpertStacks
from .names import (
    FC1_UP,
    GATED_ACTIVATIONS,
    LAYER_KEY,
    canonical_name,
    expert_slot,
    holds_gate_and_up,
    tp_split_dim,
)
from .safe_pickle import LEGACY_SAFE_GLOBALS, load_tensors
from .streaming import Piece, TensorStream, Window, as_rows, fill, stored_offset

TP_SHARD = re.compile(r"^mp_rank_(\d+)/model_weights\.ckpt$")
TP_PP_SHARD = re.compile(r"^tp_rank_(\d+)_pp_rank_(\d+)/model_weights\.ckpt$")


def torch_load(archive: Archive, name: str, map_location: str = "cpu"):
    """The object pickled in weights file `name`, loaded without running code (`safe_pickle`)."""
    with archive.open(name) as handle, reading(archive.path, name):
        return load_tensors(handle, map_location, LEGACY_SAFE_GLOBALS)


class LegacyReader:
    """Reads the legacy weight files of `archive` (`layout` "legacy", "tp_shards" or "tp_pp_shards").

    `renamed` applies the user's key renames; `activation()` gives the model's activation (asked only when
    gated TP shards must be merged).
    """

    def __init__(self, archive: Archive, layout: str, renamed: Callable[[str], str],
                 activation: Callable[[], str | None], select: Callable[[str], bool] | None = None):
        self._archive, self._layout, self._renamed, self._activation = archive, layout, renamed, activation
        self._select = select

    def load(self) -> dict[str, torch.Tensor]:
        """Every (selected) tensor in canonical names: TP shards merged, PP stages renumbered."""
        weights: dict[str, torch.Tensor] = {}
        first_layer = 0
        for _, files in sorted(self._shard_files().items()):
            ranks = [self._stored_tensors(name) for name in files]
            separate_up = any(FC1_UP in name for name in ranks[0])
            gated = len(ranks) > 1 and not separate_up and self._activation() in GATED_ACTIVATIONS
            targets, jobs = _plan_tp_merge(ranks, gated)
            for name, rank_jobs in zip(files, jobs):
                self._fill_from_file(name, rank_jobs)
            for name, tensor in targets.items():  # PP stages number their layers from 0
                match = LAYER_KEY.match(name)
                name = f"decoder.layers.{int(match[1]) + first_layer}.{match[2]}" if match else name
                weights[name] = tensor
            first_layer += len({m[1] for m in map(LAYER_KEY.match, targets) if m})
        return weights

    def tp_size(self) -> int:
        """The TP ranks the weights are split over (1 when they are not split)."""
        return len(next(iter(self._shard_files().values())))

    def load_rank(self, rank: int) -> dict[str, torch.Tensor]:
        """The (selected) tensors of TP rank `rank`'s file as it stores them (Megatron's per-rank slices; a
        gated fc1 `[gate_r; up_r]`), in canonical names; TP-only layouts (no PP stages)."""
        stages = self._shard_files()
        if len(stages) != 1:
            raise NemoCheckpointError(f"{self._archive.path}: per-rank reading needs one PP stage, it has "
                                      f"{len(stages)}")
        name = stages[0][rank]
        stored = self._stored_tensors(name)
        targets, jobs = _plan_tp_merge([stored], gated=False)
        self._fill_from_file(name, jobs[0])
        return targets

    def stream(self) -> TensorStream | None:
        """The (selected) tensors of a `legacy` layout's single file as a `TensorStream` in stored order, read
        through a file handle of their own; None where a canonical tensor is not one stored tensor as it is (TP
        shards, a separate up projection, per-expert tensors), the file sits in a compressed tar, or a tensor cannot
        be read by its offset alone (torch gives none, or it is stored non-contiguous): those would be loaded whole."""
        name = "model_weights.ckpt"
        if self._layout != "legacy" or (span := self._archive.span(name)) is None:
            return None
        stored = self._stored_tensors(name)
        if any(FC1_UP in n or expert_slot(n) or stored_offset(meta) is None or not meta.is_contiguous()
               for n, (_, meta) in stored.items()):
            return None
        order = sorted(stored.items(), key=lambda item: stored_offset(item[1][1]) +
                       item[1][1].storage_offset() * item[1][1].element_size())

        def read() -> Iterator[tuple[str, torch.Tensor]]:
            filled: list[tuple[str, torch.Tensor]] = []

            def jobs() -> Iterator[tuple[str, torch.Tensor, list[Piece]]]:
                for canonical, (key, meta) in order:  # each tensor allocated when its turn comes
                    filled.append((canonical, torch.empty(meta.shape, dtype=meta.dtype)))
                    yield key, meta, [(0, as_rows(filled[-1][1]))]

            path, offset, length = span
            with open(path, "rb", buffering=0) as raw:
                for _ in self._fill_each(name, jobs(), Window(raw, offset, length)):
                    yield filled.pop()

        return TensorStream({canonical: meta for canonical, (_, meta) in order}, read)

    def _load_weights_dict(self, name: str, map_location: str = "cpu") -> dict:
        saved = torch_load(self._archive, name, map_location)
        if isinstance(saved, dict) and isinstance(saved.get("state_dict"), dict):
            return saved["state_dict"]  # a PyTorch Lightning checkpoint
        if not isinstance(saved, dict):
            raise NemoCheckpointError(f"{self._archive.path}: {name} holds a {type(saved).__name__}, not a state dict")
        return saved

    def _shard_files(self) -> dict[int, list[str]]:
        """The weight files of each pipeline stage, indexed by TP rank."""
        if self._layout == "legacy":
            return {0: ["model_weights.ckpt"]}
        stages: dict[int, dict[int, str]] = {}
        for name in self._archive.names:
            if match := TP_PP_SHARD.match(name):
                stages.setdefault(int(match[2]), {})[int(match[1])] = name
            elif match := TP_SHARD.match(name):
                stages.setdefault(0, {})[int(match[1])] = name
        for stage, files in stages.items():
            if sorted(files) != list(range(len(files))):
                raise NemoCheckpointError(
                    f"{self._archive.path}: PP stage {stage} lacks TP ranks: {sorted(files)}"
                )
        return {stage: [files[r] for r in range(len(files))] for stage, files in stages.items()}

    def _stored_tensors(self, name: str) -> dict[str, tuple[str, torch.Tensor]]:
        """Canonical name -> (stored key, meta tensor) of a weights file, read without its tensor data."""
        out = {}
        for key, value in self._load_weights_dict(name, map_location="meta").items():
            canonical = canonical_name(self._renamed(key))
            if canonical is not None and isinstance(value, torch.Tensor) and (
                    self._select is None or self._select(canonical.replace(FC1_UP, "mlp.linear_fc1."))):
                out[canonical] = (key, value)
        return out

    def _fill_from_file(self, name: str, jobs: list[tuple[str, torch.Tensor, list[Piece]]]) -> None:
        """Copy the tensors of weights file `name` into their pieces, reading the file front to back."""
        with self._archive.open(name) as handle, reading(self._archive.path, name):
            for _ in self._fill_each(name, sorted(jobs, key=lambda job: stored_offset(job[1]) or 0), handle):
                pass

    def _fill_each(self, name: str, jobs: Iterable[tuple[str, torch.Tensor, list[Piece]]],
                   handle) -> Iterator[None]:
        """Copy each job's stored tensor of weights file `name` (open as `handle`) into its pieces, in the jobs'
        order, yielding after each."""
        loaded: dict = {}

        def load_real(key: str) -> torch.Tensor:  # only when torch gives no storage offsets
            if not loaded:
                loaded.update(self._load_weights_dict(name))
            return loaded[key]

        for key, meta, pieces in jobs:
            with reading(self._archive.path, name):
                fill(handle, 0, meta, pieces, functools.partial(load_real, key))
            yield


def _plan_tp_merge(ranks: list[dict[str, tuple[str, torch.Tensor]]], gated: bool):
    """Merged target tensors of one pipeline stage and, per TP rank, its (stored key, meta, pieces) copy jobs.

    Dim-0 splits land on row ranges, dim-1 splits on column ranges, a gated fc1 rank `[gate_r; up_r]` on two
    row ranges; replicated tensors are read from rank 0 only. Experts' tensors land in their layer's stack.
    """
    targets: dict[str, torch.Tensor] = {}
    stacks = ExpertStacks(ranks[0])
    jobs: list[list] = [[] for _ in ranks]
    for name, (key0, meta0) in ranks[0].items():
        stored = [rank.get(name) for rank in ranks]
        if None in stored:
            raise NemoCheckpointError(f"tensor {name} is missing from some of the {len(ranks)} TP rank files")
        dim = tp_split_dim(name) if len(ranks) > 1 else None
        shape = list(meta0.shape)
        if dim is not None:
            shape[dim] = sum(meta.shape[dim] for _, meta in stored)
        target = targets[name] = stacks.empty(name, shape, meta0.dtype)
        if dim is None:
            jobs[0].append((key0, meta0, [(0, as_rows(target))]))
            continue
        fused_gate_up = gated and holds_gate_and_up(name)
        offset = 0
        for rank_jobs, (key, meta) in zip(jobs, stored):
            size = meta.shape[dim]
            if fused_gate_up:
                half, gate_rows = size // 2, shape[0] // 2
                pieces = [(0, target[offset // 2:][:half]), (half, target[gate_rows + offset // 2:][:half])]
            else:
                pieces = [(0, target.narrow(dim, offset, size))]
            rank_jobs.append((key, meta, pieces))
            offset += size
    return targets, jobs
