"""Read a NeMo checkpoint (`.nemo` tar, gzip tar or folder) into canonical weights (docs/architecture.md).

Nothing is extracted to disk and the weights are never held twice: every tensor is allocated once at its final
(merged, un-stacked) size and the stored bytes of each shard or chunk are streamed into place.
"""

from __future__ import annotations

import collections
import contextlib
import fnmatch
import functools
import io
import json
import math
import os
import pickle
import re
import tarfile
import typing
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path, PurePosixPath
from typing import IO

import omegaconf
import torch
import yaml
from omegaconf import DictConfig, OmegaConf

LAYER_KEY = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
TP_SHARD = re.compile(r"^mp_rank_(\d+)/model_weights\.ckpt$")
TP_PP_SHARD = re.compile(r"^tp_rank_(\d+)_pp_rank_(\d+)/model_weights\.ckpt$")
#: Stored key prefixes, longest first: NeMo-1 `model.` (amp O2: `model.module.`), NeMo 2 `module.`.
STORED_PREFIXES = ("model.module.", "model.", "module.")
#: Stored entries that are not model weights (a buffer, legacy PP's tied copy of the embedding).
DROPPED_SUFFIXES = ("rotary_pos_emb.inv_freq", "word_embeddings_for_head.weight")
#: Bytes of stored tensor data read at a time.
STREAM_BLOCK_BYTES = 8 << 20

#: Activations whose `linear_fc1` holds `[gate; up]` (per TP rank in sharded files).
GATED_ACTIVATIONS = frozenset({"fast-swiglu", "swiglu", "fast-geglu", "geglu", "fast-reglu", "reglu"})
#: Legacy (non-mcore) activations whose up half is a separate `dense_h_to_4h_2`.
SEPARATE_UP_ACTIVATIONS = frozenset({"swiglu", "geglu", "reglu"})
#: Internal name of such a separate up half until it is appended to `linear_fc1`.
FC1_UP = "mlp.linear_fc1_up."
#: (canonical, TransformerEngine) name prefixes of a layer's norms, relative to `decoder.layers.<i>.`.
TE_NORM_NAMES = (("input_layernorm.", "self_attention.linear_qkv.layer_norm_"),
                 ("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_"))
#: (canonical, legacy non-mcore) name prefixes of a layer's parameters.
LEGACY_LAYER_NAMES = (
    ("self_attention.linear_qkv.", "self_attention.query_key_value."),
    ("self_attention.linear_proj.", "self_attention.dense."), ("mlp.linear_fc1.", "mlp.dense_h_to_4h."),
    (FC1_UP, "mlp.dense_h_to_4h_2."), ("mlp.linear_fc2.", "mlp.dense_4h_to_h."),
    ("pre_mlp_layernorm.", "post_attention_layernorm."),
)
COLUMN_PARALLEL_LAYER_PARAMS = frozenset(
    module + kind for module in ("self_attention.linear_qkv.", "mlp.linear_fc1.", FC1_UP)
    for kind in ("weight", "bias")
)

#: NeMo 2.0 config field -> NeMo-1 field.
NEMO2_RENAMED_FIELDS = {"add_bias_linear": "bias", "rotary_percent": "rotary_percentage",
                        "seq_length": "max_position_embeddings"}
#: NeMo 2.0 activation function -> (NeMo-1 activation when gated, when not).
NEMO2_ACTIVATIONS = {
    "silu": ("fast-swiglu", "silu"), "gelu": ("geglu", "gelu"), "relu": ("fast-reglu", "relu"),
    "squared_relu": ("squared-relu",) * 2, "openai_gelu": ("openai-gelu",) * 2,
}
NEMO2_NORMALIZATIONS = {"RMSNorm": "rmsnorm", "LayerNorm": "layernorm"}
NEMO2_PRECISIONS = {"bfloat16": "bf16", "float16": 16, "float32": 32}

#: Non-tensor objects legacy weight files legitimately hold: TE extra states (BytesIO) and a PTL
#: `hyper_parameters.cfg` DictConfig. torch.load(weights_only=True) refuses everything else.
_CKPT_SAFE_GLOBALS = [
    io.BytesIO, bytes, dict, list, int, collections.defaultdict, typing.Any, omegaconf.DictConfig,
    omegaconf.ListConfig, omegaconf.base.ContainerMetadata, omegaconf.base.Metadata, omegaconf.nodes.AnyNode,
    omegaconf.nodes.StringNode, omegaconf.nodes.IntegerNode, omegaconf.nodes.FloatNode,
    omegaconf.nodes.BooleanNode,
]
#: What a torch.distributed.checkpoint `.metadata` pickle may reference besides its metadata module.
_METADATA_SAFE_GLOBALS = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
}

Piece = tuple[int, torch.Tensor]  # (first row of a stored tensor, destination view of the rows that follow)


class NemoCheckpointError(Exception):
    """A checkpoint cannot be read: the message names the file or member and what is wrong."""


def swap_prefix(name: str, pairs: tuple[tuple[str, str], ...], reverse: bool = False) -> str:
    """Replace the first matching prefix of `name` by its partner in `pairs` (left->right, or right->left)."""
    for left, right in pairs:
        old, new = (right, left) if reverse else (left, right)
        if name.startswith(old):
            return new + name[len(old):]
    return name


def tp_split_dim(name: str) -> int | None:
    """Dimension along which NeMo splits canonical tensor `name` over TP ranks; None when replicated."""
    match = LAYER_KEY.match(name)
    if not match:
        return 0 if name in ("embedding.word_embeddings.weight", "output_layer.weight") else None
    if match[2] in COLUMN_PARALLEL_LAYER_PARAMS:
        return 0
    return 1 if match[2] in ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight") else None


def canonical_name(key: str) -> str | None:
    """Canonical name of a stored NeMo key (any prefix; legacy or TE names); None for dropped entries."""
    if "_extra_state" in key or key.endswith(DROPPED_SUFFIXES):
        return None
    prefix = next((p for p in STORED_PREFIXES if key.startswith(p)), "")
    key = key[len(prefix):]
    if key.startswith("language_model."):  # legacy NeMo-1, or a NeMo 2 VLM's language model
        key = key[len("language_model."):]
        key = "decoder." + key[len("encoder."):] if key.startswith("encoder.") else key
    match = LAYER_KEY.match(key)
    if match:
        rest = swap_prefix(match[2], LEGACY_LAYER_NAMES, reverse=True)
        key = f"decoder.layers.{match[1]}.{swap_prefix(rest, TE_NORM_NAMES, reverse=True)}"
    return key


# -- archive access: a tar (plain or gzip) or a folder, read member by member


class _Archive:
    """Read-only access to the files of a `.nemo` tar or folder by normalised name (no leading `./`)."""

    def __init__(self, path: Path):
        self.path = path
        self._tar: tarfile.TarFile | None = None
        self._members: dict[str, tarfile.TarInfo] = {}
        if not path.exists():
            raise NemoCheckpointError(f"{path}: no such file or folder")
        if path.is_dir():
            self.names = sorted(str(Path(folder, f).relative_to(path)) for folder, _, files in os.walk(path)
                                for f in files)
            return
        try:
            self._tar = tarfile.open(path, "r:*")  # noqa: SIM115 (open until close())
            members = self._tar.getmembers()
        except (tarfile.TarError, EOFError, OSError, zlib.error) as err:
            raise NemoCheckpointError(f"{path}: not a readable .nemo archive (tar or tar.gz): {err}") from err
        compressed = not isinstance(self._tar.fileobj, io.BufferedReader)
        for member in members:
            _check_member(path, member)
            if not compressed and member.offset_data + member.size > path.stat().st_size:
                raise NemoCheckpointError(f"{path}: the archive is truncated inside member {member.name!r}")
            if member.isfile():
                self._members[_normalise(member.name)] = member
        self.names = sorted(self._members)

    def open(self, name: str) -> IO[bytes]:
        """A seekable binary file object for member `name`."""
        if self._tar is None:
            target = (self.path / name).resolve()
            if not target.is_relative_to(self.path.resolve()):
                raise NemoCheckpointError(f"{self.path}: {name!r} points outside the checkpoint folder")
            return open(target, "rb")
        if name not in self._members:
            raise NemoCheckpointError(f"{self.path}: no member {name!r}")
        return self._tar.extractfile(self._members[name])

    def read(self, name: str) -> bytes:
        with self.open(name) as handle, _reading(self.path, name):
            return handle.read()

    def close(self) -> None:
        if self._tar is not None:
            self._tar.close()


def _normalise(name: str) -> str:
    while name.startswith("./"):
        name = name[2:]
    return name


def _check_member(path: Path, member: tarfile.TarInfo) -> None:
    """Refuse members that could escape or misuse an extraction: absolute, `..`, links, devices, fifos."""
    problem = None
    if member.name.startswith("/") or re.match(r"^[A-Za-z]:[\\/]", member.name):
        problem = "has an absolute path"
    elif ".." in re.split(r"[\\/]", member.name):
        problem = "contains '..'"
    elif member.issym() or member.islnk():
        problem = f"is a link (to {member.linkname!r})"
    elif member.isdev():
        problem = "is a device file or fifo"
    elif not (member.isfile() or member.isdir()):
        problem = "is not a regular file or folder"
    if problem:
        raise NemoCheckpointError(f"{path}: refusing unsafe archive member {member.name!r}: it {problem}")


@contextlib.contextmanager
def _reading(path: Path, name: str):
    """Turn low-level read failures inside the block into a NemoCheckpointError naming the member."""
    try:
        yield
    except NemoCheckpointError:
        raise
    except (tarfile.TarError, EOFError, OSError, zlib.error, RuntimeError, pickle.UnpicklingError) as err:
        raise NemoCheckpointError(
            f"{path}: cannot read member {name!r} (truncated, corrupt or not a weights file): {err}"
        ) from err


# -- the checkpoint


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
        self._archive = _Archive(self.path)
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

    def state_dict(self) -> dict[str, torch.Tensor]:
        """All weights in canonical names: TP shards merged, PP stages renumbered, dist layers unstacked."""
        if self.layout in ("torch_dist", "nemo2"):
            folder = "model_weights/" if self.layout == "torch_dist" else "weights/"
            weights = _DistReader(self._archive, folder).load(self._renamed)
        else:
            weights = self._load_legacy()
        for name in [k for k in weights if FC1_UP in k]:  # legacy non-fast GLU: fc1 = [gate; up]
            fc1 = name.replace(FC1_UP, "mlp.linear_fc1.")
            weights[fc1] = torch.cat([weights[fc1], weights.pop(name)])
        if not weights:
            raise NemoCheckpointError(f"{self.path}: the {self.layout} weights hold no tensors")
        return weights

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
            backend = json.loads(self._archive.read(meta)).get("sharded_backend")
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
            return nemo2_to_nemo1_config(yaml.safe_load(self._archive.read("context/model.yaml")))
        configs = sorted((n for n in names if n.rsplit("/")[-1] == "model_config.yaml"), key=len)
        if configs:
            return OmegaConf.create(yaml.safe_load(self._archive.read(configs[0])))
        weights = next((n for n in names if n.endswith("model_weights.ckpt")), None)
        saved = self._torch_load(weights, map_location="meta") if weights else None
        cfg = saved.get("hyper_parameters", {}).get("cfg") if isinstance(saved, dict) else None
        if cfg is None:
            raise NemoCheckpointError(f"{self.path}: no model_config.yaml, no hyper_parameters.cfg")
        return OmegaConf.create(OmegaConf.to_container(cfg) if isinstance(cfg, DictConfig) else cfg)

    def _renamed(self, key: str) -> str:
        """Stored `key` after the user's `old:new` renames."""
        for old, new in self._renames:
            key = key.replace(old, new)
        return key

    # -- legacy weight files

    def _torch_load(self, name: str, map_location: str = "cpu"):
        with (
            self._archive.open(name) as handle,
            _reading(self.path, name),
            torch.serialization.safe_globals(_CKPT_SAFE_GLOBALS),
        ):
            return torch.load(handle, map_location=map_location, weights_only=True)

    def _load_weights_dict(self, name: str, map_location: str = "cpu") -> dict:
        saved = self._torch_load(name, map_location)
        if isinstance(saved, dict) and isinstance(saved.get("state_dict"), dict):
            return saved["state_dict"]  # a PyTorch Lightning checkpoint
        if not isinstance(saved, dict):
            raise NemoCheckpointError(f"{self.path}: {name} holds a {type(saved).__name__}, not a state dict")
        return saved

    def _shard_files(self) -> dict[int, list[str]]:
        """The weight files of each pipeline stage, indexed by TP rank."""
        if self.layout == "legacy":
            return {0: ["model_weights.ckpt"]}
        stages: dict[int, dict[int, str]] = {}
        for name in self._archive.names:
            if match := TP_PP_SHARD.match(name):
                stages.setdefault(int(match[2]), {})[int(match[1])] = name
            elif match := TP_SHARD.match(name):
                stages.setdefault(0, {})[int(match[1])] = name
        for stage, files in stages.items():
            if sorted(files) != list(range(len(files))):
                raise NemoCheckpointError(f"{self.path}: PP stage {stage} lacks TP ranks: {sorted(files)}")
        return {stage: [files[r] for r in range(len(files))] for stage, files in stages.items()}

    def _load_legacy(self) -> dict[str, torch.Tensor]:
        """Legacy files: each tensor is allocated at its merged size and every rank's bytes stream into it."""
        weights: dict[str, torch.Tensor] = {}
        first_layer = 0
        for _, files in sorted(self._shard_files().items()):
            ranks = [self._stored_tensors(name) for name in files]
            separate_up = any(FC1_UP in name for name in ranks[0])
            gated = len(ranks) > 1 and not separate_up and self.config.get("activation") in GATED_ACTIVATIONS
            targets, jobs = _plan_tp_merge(ranks, gated)
            for name, rank_jobs in zip(files, jobs):
                self._fill_from_file(name, rank_jobs)
            for name, tensor in targets.items():  # PP stages number their layers from 0
                match = LAYER_KEY.match(name)
                name = f"decoder.layers.{int(match[1]) + first_layer}.{match[2]}" if match else name
                weights[name] = tensor
            first_layer += len({m[1] for m in map(LAYER_KEY.match, targets) if m})
        return weights

    def _stored_tensors(self, name: str) -> dict[str, tuple[str, torch.Tensor]]:
        """Canonical name -> (stored key, meta tensor) of a weights file, read without its tensor data."""
        out = {}
        for key, value in self._load_weights_dict(name, map_location="meta").items():
            canonical = canonical_name(self._renamed(key))
            if canonical is not None and isinstance(value, torch.Tensor):
                out[canonical] = (key, value)
        return out

    def _fill_from_file(self, name: str, jobs: list[tuple[str, torch.Tensor, list[Piece]]]) -> None:
        """Copy the tensors of weights file `name` into their pieces, reading the file front to back."""
        loaded: dict = {}

        def load_real(key: str) -> torch.Tensor:  # only when torch gives no storage offsets
            if not loaded:
                loaded.update(self._load_weights_dict(name))
            return loaded[key]

        with self._archive.open(name) as handle, _reading(self.path, name):
            for key, meta, pieces in sorted(jobs, key=lambda job: _stored_offset(job[1]) or 0):
                _fill(handle, 0, meta, pieces, functools.partial(load_real, key))


def _parse_rename(rule: str) -> tuple[str, str]:
    old, sep, new = str(rule).partition(":")
    if not sep or not old:
        raise ValueError(f"rename_keys entry {rule!r} must have the form 'old:new'")
    return old, new


def _plan_tp_merge(ranks: list[dict[str, tuple[str, torch.Tensor]]], gated: bool):
    """Merged target tensors of one pipeline stage and, per TP rank, its (stored key, meta, pieces) copy jobs.

    Dim-0 splits land on row ranges, dim-1 splits on column ranges, a gated fc1 rank `[gate_r; up_r]` on two
    row ranges; replicated tensors are read from rank 0 only.
    """
    targets: dict[str, torch.Tensor] = {}
    jobs: list[list] = [[] for _ in ranks]
    for name, (key0, meta0) in ranks[0].items():
        stored = [rank.get(name) for rank in ranks]
        if None in stored:
            raise NemoCheckpointError(f"tensor {name} is missing from some of the {len(ranks)} TP rank files")
        dim = tp_split_dim(name) if len(ranks) > 1 else None
        shape = list(meta0.shape)
        if dim is not None:
            shape[dim] = sum(meta.shape[dim] for _, meta in stored)
        target = targets[name] = torch.empty(shape, dtype=meta0.dtype)
        if dim is None:
            jobs[0].append((key0, meta0, [(0, _as_rows(target))]))
            continue
        fused_gate_up = gated and name.rsplit(".", 1)[0].endswith("mlp.linear_fc1")
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


def nemo2_to_nemo1_config(model_yaml: dict) -> DictConfig:
    """Map a NeMo 2.0 `context/model.yaml` to a NeMo-1 model config (scalars, NeMo-1 names, tokenizer)."""
    source = model_yaml.get("config") or {}
    scalar = (bool, int, float, str, type(None))
    cfg = {k: v for k, v in source.items() if k != "_target_" and isinstance(v, scalar)}
    for new, old in NEMO2_RENAMED_FIELDS.items():
        if new in cfg:
            cfg[old] = cfg.pop(new)
    cfg = {"max_position_embeddings": 4096, "rotary_percentage": 1.0, "bias": False, **cfg, "mcore_gpt": True}
    if cfg.get("normalization") in NEMO2_NORMALIZATIONS:
        cfg["normalization"] = NEMO2_NORMALIZATIONS[cfg["normalization"]]
    func = _target_tail(source.get("activation_func"), "gelu")
    gated = bool(source.get("gated_linear_unit", False))
    cfg["activation"] = NEMO2_ACTIVATIONS[func][0 if gated else 1] if func in NEMO2_ACTIVATIONS else func
    if (dtype := _target_tail(source.get("params_dtype"), "")) in NEMO2_PRECISIONS:
        cfg["precision"] = NEMO2_PRECISIONS[dtype]
    tokenizer = model_yaml.get("tokenizer") or {}
    target = str(tokenizer.get("_target_", ""))
    if target.endswith("SentencePieceTokenizer"):
        cfg["tokenizer"] = {"library": "sentencepiece", "model": f"context/{tokenizer.get('model_path')}"}
    elif target.endswith("AutoTokenizer"):
        cfg["tokenizer"] = {"library": "huggingface", "type": tokenizer.get("pretrained_model_name")}
    return OmegaConf.create(cfg)


def _target_tail(value, default: str) -> str:
    """`torch.nn.functional.silu` -> `silu`, from a `{_target_: ...}` node or a plain string."""
    value = value.get("_target_", default) if isinstance(value, dict) else str(value or default)
    return value.rsplit(".", 1)[-1]


# -- torch_dist (torch.distributed.checkpoint): one process, no process group


class _DistReader:
    """Reads a torch_dist checkpoint folder into canonical per-layer tensors, streaming chunks into place."""

    def __init__(self, archive: _Archive, folder: str):
        self._archive, self._folder = archive, folder
        with archive.open(folder + ".metadata") as handle, _reading(archive.path, folder + ".metadata"):
            self._metadata = _MetadataUnpickler(handle).load()

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
            window = io.BufferedReader(_Window(handle, offset, length), 1 << 20)
            return torch.load(window, map_location=map_location, weights_only=True)

        with self._archive.open(name) as handle, _reading(self._archive.path, name):
            _fill(handle, offset, load("meta"), pieces, functools.partial(load, "cpu"))

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
        return [(0, _as_rows(target))]
    return [(0, target[(slice(offsets[0], offsets[0] + sizes[0]), *inner)])]


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles torch.distributed.checkpoint `.metadata`, allowing only the classes that file needs."""

    def find_class(self, module: str, name: str):
        if module == "torch.distributed.checkpoint.metadata" or (module, name) in _METADATA_SAFE_GLOBALS:
            return super().find_class(module, name)
        constant = getattr(torch, name, None) if module == "torch" else None
        if constant is torch.Size or isinstance(constant, (torch.dtype, torch.layout, torch.memory_format)):
            return constant
        raise NemoCheckpointError(f"refusing to unpickle {module}.{name} from a dist checkpoint's .metadata")


# -- streaming stored tensor bytes into place


def _as_rows(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.dim() else tensor.view(1)


def _stored_offset(meta: torch.Tensor) -> int | None:
    """Offset of a meta-loaded tensor's data record in its torch.save stream (None if torch gives none)."""
    return getattr(meta.untyped_storage(), "_checkpoint_offset", None)


def _fill(handle: IO[bytes], base: int, meta: torch.Tensor, pieces: list[Piece], load_real: Callable) -> None:
    """Copy the rows of a stored tensor into `pieces`.

    `meta` comes from torch.load(map_location="meta") of a torch.save stream starting at byte `base` of
    `handle`; its storage offset locates the data, read block by block straight into the destination. Without
    that offset (older torch) or for a non-contiguous stored tensor, `load_real()` loads the tensor instead.
    """
    offset = _stored_offset(meta)
    if offset is None or not meta.is_contiguous():
        real = _as_rows(load_real())
        for first, dest in pieces:
            dest.copy_(real[first:first + dest.shape[0]])
        return
    start = base + offset + meta.storage_offset() * meta.element_size()
    row_bytes = math.prod(meta.shape[1:]) * meta.element_size()
    rows_per_block = max(1, STREAM_BLOCK_BYTES // max(row_bytes, 1))
    for first, dest in pieces:
        for row in range(0, dest.shape[0], rows_per_block):
            part = dest[row:row + rows_per_block]
            handle.seek(start + (first + row) * row_bytes)
            block = part if part.is_contiguous() else torch.empty(part.shape, dtype=part.dtype)
            _read_exactly(handle, block)
            if block is not part:
                part.copy_(block)


def _read_exactly(handle: IO[bytes], tensor: torch.Tensor) -> None:
    """Fill contiguous `tensor` with the next bytes of `handle`, at most STREAM_BLOCK_BYTES per read."""
    view = memoryview(tensor.view(-1).view(torch.uint8).numpy()) if tensor.numel() else memoryview(b"")
    filled = 0
    while filled < len(view):
        got = handle.readinto(view[filled:filled + STREAM_BLOCK_BYTES])
        if not got:
            raise NemoCheckpointError("unexpected end of tensor data")
        filled += got


class _Window(io.RawIOBase):
    """A read-only, seekable view of bytes `[offset, offset + length)` of another seekable file."""

    def __init__(self, handle: IO[bytes], offset: int, length: int):
        super().__init__()
        self._handle, self._start, self._length, self._pos = handle, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = (0, self._pos, self._length)[whence]
        self._pos = min(max(base + pos, 0), self._length)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buffer) -> int:
        self._handle.seek(self._start + self._pos)
        data = self._handle.read(max(0, min(len(buffer), self._length - self._pos)))
        buffer[:len(data)] = data
        self._pos += len(data)
        return len(data)
