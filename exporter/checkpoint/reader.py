"""`NemoCheckpoint`: layout detection, config, artifacts and tokenizer; weights through the layout's reader."""

from __future__ import annotations

import fnmatch
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path, PurePosixPath
from typing import Any

import torch
import yaml
from omegaconf import DictConfig, OmegaConf

from .archive import Archive, NemoCheckpointError
from .experts import stack_experts
from .legacy import TP_PP_SHARD, TP_SHARD, LegacyReader, torch_load
from .names import FC1_UP
from .nemo2 import nemo2_to_nemo1_config
from .streaming import TensorStream
from .torch_dist import DistReader


class NemoCheckpoint:
    """A NeMo checkpoint: config, artifacts, tokenizer and weights in canonical names (docs/architecture.md).

    `path` is a `.nemo` tar (plain or gzip) or an extracted folder, NeMo-1 or NeMo 2.0. `rename_keys` are
    `old:new` substring renames applied to the stored key names while loading (TensorRT-LLM's
    `--nemo_rename_key`). `layout`: "legacy" (`model_weights.ckpt`), "tp_shards" (`mp_rank_XX/`),
    "tp_pp_shards" (`tp_rank_XX_pp_rank_XXX/`), "torch_dist" (NeMo-1 `model_weights/`) or "nemo2".
    """

    def __init__(self, path: str | os.PathLike, rename_keys: Sequence[str] = ()):
        self.path = Path(path)
        self._renames = [_parse_rename(rule) for rule in rename_keys]
        self._archive = Archive(self.path)
        self.layout = self._detect_layout()
        self._config: DictConfig | None = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Close the underlying archive."""
        self._archive.close()

    def member_names(self) -> list[str]:
        """Names of the files in the checkpoint, without a leading `./`."""
        return list(self._archive.names)

    @property
    def config(self) -> DictConfig:
        """The model config in NeMo-1 field names (a NeMo 2.0 config is mapped to them)."""
        if self._config is None:
            self._config = self._load_config()
        return self._config

    def artifact(self, name_or_ref: str) -> bytes:
        """Bytes of an artifact: a `nemo:` reference, an `/artifacts/` path, a member path or a basename."""
        ref, names = str(name_or_ref), self._archive.names
        if ref in names:
            return self._archive.read(ref)
        pattern = "*" + (ref[len("nemo:"):] if ref.startswith("nemo:") else PurePosixPath(ref).name)
        root_files = [n for n in names if "/" not in n]
        matches = [n for n in root_files if fnmatch.fnmatch(n, pattern)]
        if not matches and self.layout == "nemo2":
            context = [n for n in names if n.startswith("context/")]
            matches = [n for n in context if fnmatch.fnmatch(n.rsplit("/")[-1], pattern)]
        if len(matches) != 1:
            raise NemoCheckpointError(
                f"{self.path}: artifact {ref!r} must match exactly one file ({pattern!r}); matched "
                f"{', '.join(matches) or 'none'}. Files at the archive root: "
                f"{', '.join(root_files) or 'none'}"
            )
        return self._archive.read(matches[0])

    def tokenizer(self, tokenizer_path: str | os.PathLike | None = None):
        """The model's tokenizer (`exporter.llm.tokenizer.load_tokenizer`), or the one at `tokenizer_path`."""
        from exporter.llm.tokenizer import load_tokenizer

        return load_tokenizer(
            self.config.get("tokenizer"), read_artifact=self.artifact, tokenizer_path=tokenizer_path
        )

    def state_dict(self, select: Callable[[str], bool] | None = None) -> dict[str, torch.Tensor]:
        """All weights in canonical names: TP shards merged, PP stages renumbered, dist layers unstacked, each
        MoE layer's experts stacked. `select(name)`: read only the tensors it accepts (legacy layouts; the dist
        ones read all, then drop the others)."""
        if self.layout in ("torch_dist", "nemo2"):
            folder = "model_weights/" if self.layout == "torch_dist" else "weights/"
            weights = DistReader(self._archive, folder).load(self._renamed)
            weights = {k: v for k, v in weights.items() if select is None or select(k)}
        else:
            weights = self._legacy_reader(select).load()
        return self._finish(weights)

    def tensor_stream(self, select: Callable[[str], bool] | None = None) -> TensorStream | None:
        """The (selected) weights as a `TensorStream` in the order the checkpoint stores them (nothing read yet), or
        None where the layout does not store each canonical tensor as one stored tensor (then use `state_dict`):
        the `legacy` layout's plain file, in a folder or an uncompressed tar, without TP shards or per-expert
        tensors."""
        return self._legacy_reader(select).stream() if self.layout == "legacy" else None

    @property
    def tp_size(self) -> int:
        """The TP ranks whose own files hold the weights (`tp_shards` layout), else 1."""
        return self._legacy_reader().tp_size() if self.layout == "tp_shards" else 1

    def rank_state_dict(self, rank: int, select: Callable[[str], bool] | None = None) -> dict[str, torch.Tensor]:
        """The weights of TP rank `rank`'s file (`tp_shards` layout) as Megatron split them, not merged, in
        canonical names (`select`: as in `state_dict`)."""
        if self.layout != "tp_shards":
            raise NemoCheckpointError(f"{self.path}: per-rank weights need the tp_shards layout, not {self.layout}")
        return self._finish(self._legacy_reader(select).load_rank(rank))

    def _legacy_reader(self, select: Callable[[str], bool] | None = None) -> LegacyReader:
        return LegacyReader(self._archive, self.layout, self._renamed, lambda: self.config.get("activation"),
                            select)

    def _finish(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        for name in [k for k in weights if FC1_UP in k]:  # legacy non-fast GLU: fc1 = [gate; up]
            fc1 = name.replace(FC1_UP, "mlp.linear_fc1.")
            weights[fc1] = torch.cat([weights[fc1], weights.pop(name)])
        if not weights:
            raise NemoCheckpointError(f"{self.path}: the {self.layout} weights hold no tensors")
        return stack_experts(weights)

    def _detect_layout(self) -> str:
        names = set(self._archive.names)
        if any(n.startswith("model_weights/") for n in names):
            return self._check_dist_backend("model_weights/", "torch_dist")
        if any(n.startswith("weights/") for n in names) and "context/model.yaml" in names:
            return self._check_dist_backend("weights/", "nemo2")
        if "model_weights.ckpt" in names:
            return "legacy"
        if any(TP_SHARD.match(n) for n in names):
            return "tp_shards"
        if any(TP_PP_SHARD.match(n) for n in names):
            return "tp_pp_shards"
        raise NemoCheckpointError(
            f"{self.path}: no weights found (expected model_weights.ckpt, mp_rank_XX/, "
            f"tp_rank_XX_pp_rank_XXX/, model_weights/ or NeMo 2.0 context/ + weights/); it holds: "
            f"{', '.join(sorted(names)[:30]) or 'nothing'}"
        )

    def _check_dist_backend(self, folder: str, layout: str) -> str:
        meta = folder + "metadata.json"
        backend = None
        if meta in self._archive.names:
            backend = self._parse(meta, json.loads).get("sharded_backend")
        if backend == "zarr":
            raise NemoCheckpointError(
                f"{self.path}: {folder} is a zarr distributed checkpoint, which is not supported; convert it "
                f"to torch_dist first (re-save it with NeMo's dist_ckpt_format=torch_dist)"
            )
        if backend not in (None, "torch_dist"):
            raise NemoCheckpointError(f"{self.path}: {meta} names unsupported sharded_backend {backend!r}")
        if folder + ".metadata" not in self._archive.names:
            raise NemoCheckpointError(f"{self.path}: {folder}.metadata is missing (torch_dist checkpoint)")
        return layout

    def _load_config(self) -> DictConfig:
        names = self._archive.names
        if self.layout == "nemo2":
            return nemo2_to_nemo1_config(self._parse("context/model.yaml", yaml.safe_load))
        configs = sorted((n for n in names if n.rsplit("/")[-1] == "model_config.yaml"), key=len)
        if configs:
            return OmegaConf.create(self._parse(configs[0], yaml.safe_load))
        weights = next((n for n in names if n.endswith("model_weights.ckpt")), None)
        saved = torch_load(self._archive, weights, map_location="meta") if weights else None
        cfg = saved.get("hyper_parameters", {}).get("cfg") if isinstance(saved, dict) else None
        if cfg is None:
            raise NemoCheckpointError(f"{self.path}: no model_config.yaml, no hyper_parameters.cfg")
        return OmegaConf.create(OmegaConf.to_container(cfg) if isinstance(cfg, DictConfig) else cfg)

    def _parse(self, name: str, parse: Callable[[bytes], Any]) -> dict:
        """Member `name` parsed by `parse` (json.loads or yaml.safe_load: data only, never objects) as a mapping."""
        try:
            value = parse(self._archive.read(name))
        except (ValueError, yaml.YAMLError) as err:
            reason = str(err).splitlines()[0]
            raise NemoCheckpointError(f"{self.path}: {name} is not valid JSON or YAML data: {reason}") from None
        if not isinstance(value, dict):
            raise NemoCheckpointError(f"{self.path}: {name} holds a {type(value).__name__}, not a mapping")
        return value

    def _renamed(self, key: str) -> str:
        """Stored `key` after the user's `old:new` renames."""
        for old, new in self._renames:
            key = key.replace(old, new)
        return key


def _parse_rename(rule: str) -> tuple[str, str]:
    old, sep, new = str(rule).partition(":")
    if not sep or not old:
        raise ValueError(f"rename_keys entry {rule!r} must have the form 'old:new'")
    return old, new
