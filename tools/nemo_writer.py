"""Write `.nemo` archives in the layouts NeMo produces (tests and the demo builder use them).

Weights come in canonical names (docs/architecture.md); the writer stores them under the names, shards and
files NeMo itself would write: legacy `model_weights.ckpt` (optionally TP/PP sharded), NeMo-1 `torch_dist`
(`model_weights/`, stacked layers) and NeMo 2.0 (`context/` + `weights/`).
"""

from __future__ import annotations

import copy
import dataclasses
import io
import json
import random
import shutil
import tarfile
import tempfile
import uuid
import warnings
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from omegaconf import DictConfig, OmegaConf
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from exporter.checkpoint import (
    FC1_UP,
    GATED_ACTIVATIONS,
    LAYER_KEY,
    LEGACY_LAYER_NAMES,
    NEMO2_RENAMED_FIELDS,
    SEPARATE_UP_ACTIVATIONS,
    TE_NORM_NAMES,
    holds_gate_and_up,
    swap_prefix,
    tp_split_dim,
)
from exporter.checkpoint.names import DIST_EXPERT_NAMES, FALCON_NORM_NAMES
from exporter.llm.config import FALCON_SPEC_NAME

LAYOUTS = ("legacy", "torch_dist", "nemo2")
DIST_METADATA = {
    "sharded_backend": "torch_dist",
    "sharded_backend_version": 1,
    "common_backend": "torch",
    "common_backend_version": 1,
}
TE_EXTRA_STATE_MODULES = (
    "self_attention.core_attention",
    "self_attention.linear_qkv",
    "self_attention.linear_proj",
    "mlp.linear_fc1",
    "mlp.linear_fc2",
)
NEMO2_COPIED_FIELDS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
    "position_embedding_type", "rotary_base", "seq_len_interpolation_factor", "layernorm_epsilon",
    "share_embeddings_and_output_weights", "make_vocab_size_divisible_by", "layernorm_zero_centered_gamma",
    "bias_activation_fusion", "window_size", "num_moe_experts", "moe_router_topk", "moe_router_pre_softmax",
    "moe_router_score_function", "moe_router_topk_scaling_factor", "moe_ffn_hidden_size",
)
#: Stacked expert weights of one MoE layer, as the canonical state dict holds them.
STACKED_EXPERTS = ("mlp.experts.linear_fc1.weight", "mlp.experts.linear_fc2.weight")
NEMO2_ACTIVATION_TARGETS = {
    "swiglu": "torch.nn.functional.silu",
    "geglu": "torch.nn.functional.gelu",
    "reglu": "torch.nn.functional.relu",
    "silu": "torch.nn.functional.silu",
    "gelu": "torch.nn.functional.gelu",
    "relu": "torch.nn.functional.relu",
    "squared-relu": "megatron.core.activations.squared_relu",
    "openai-gelu": "megatron.core.activations.openai_gelu",
}
NEMO2_SP_TOKENIZER = "nemo.collections.common.tokenizers.sentencepiece_tokenizer.SentencePieceTokenizer"
NEMO2_HF_TOKENIZER = "nemo.collections.common.tokenizers.huggingface.auto_tokenizer.AutoTokenizer"


def hf_llama_to_nemo(
    hf_state_dict: Mapping[str, torch.Tensor],
    num_attention_heads: int,
    num_query_groups: int,
    head_dim: int | None = None,
) -> dict[str, torch.Tensor]:
    """Convert transformers `LlamaForCausalLM` weights to canonical NeMo names.

    QKV is fused in NeMo's per-query-group order ([q heads of group g, k_g, v_g] for each g); `linear_fc1` is
    `[gate; up]`. Biases are carried over when present.
    """
    hidden = hf_state_dict["model.embed_tokens.weight"].shape[1]
    head_dim = head_dim or hidden // num_attention_heads
    layer_ids = sorted({int(k.split(".")[2]) for k in hf_state_dict if k.startswith("model.layers.")})
    out = {"embedding.word_embeddings.weight": hf_state_dict["model.embed_tokens.weight"]}
    for i in layer_ids:
        hf, nemo = f"model.layers.{i}.", f"decoder.layers.{i}."
        for kind in ("weight", "bias"):
            qkv = [hf_state_dict.get(f"{hf}self_attn.{p}_proj.{kind}") for p in "qkv"]
            if qkv[0] is not None:
                out[f"{nemo}self_attention.linear_qkv.{kind}"] = fuse_qkv(*qkv, num_query_groups, head_dim)
            pairs = {
                "self_attention.linear_proj": hf_state_dict.get(f"{hf}self_attn.o_proj.{kind}"),
                "mlp.linear_fc2": hf_state_dict.get(f"{hf}mlp.down_proj.{kind}"),
            }
            gate = hf_state_dict.get(f"{hf}mlp.gate_proj.{kind}")
            if gate is not None:
                pairs["mlp.linear_fc1"] = torch.cat([gate, hf_state_dict[f"{hf}mlp.up_proj.{kind}"]], dim=0)
            for name, tensor in pairs.items():
                if tensor is not None:
                    out[f"{nemo}{name}.{kind}"] = tensor
        out[f"{nemo}input_layernorm.weight"] = hf_state_dict[f"{hf}input_layernorm.weight"]
        out[f"{nemo}pre_mlp_layernorm.weight"] = hf_state_dict[f"{hf}post_attention_layernorm.weight"]
    out["decoder.final_layernorm.weight"] = hf_state_dict["model.norm.weight"]
    if "lm_head.weight" in hf_state_dict:
        out["output_layer.weight"] = hf_state_dict["lm_head.weight"]
    return out


def fuse_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_query_groups: int, head_dim: int
) -> torch.Tensor:
    """Interleave separate Q/K/V projections (weights or biases) per query group, as NeMo stores them."""
    groups = [t.reshape(num_query_groups, -1, *t.shape[1:]) for t in (q, k, v)]
    if groups[1].shape[1] != head_dim:
        raise ValueError(f"k_proj has {groups[1].shape[1]} rows per query group, expected {head_dim}")
    return torch.cat(groups, dim=1).reshape(-1, *q.shape[1:])


def write_nemo(
    path: str | Path,
    config: Mapping,
    state_dict: Mapping[str, torch.Tensor],
    *,
    layout: str = "legacy",
    tp_size: int = 1,
    pp_size: int = 1,
    mcore: bool = True,
    transformer_engine: bool = True,
    compress: bool = False,
    dot_prefix: bool = True,
    artifacts: Mapping[str, str | Path] | None = None,
    prefix: str | None = None,
) -> Path:
    """Write `state_dict` (canonical names) and the NeMo-1 style `config` as a `.nemo` tar at `path`.

    `layout`: "legacy" (model_weights.ckpt, TP/PP shards), "torch_dist" (NeMo-1 `model_weights/`) or
    "nemo2" (`context/` + `weights/`); torch_dist/nemo2 store each tensor as the chunks `tp_size` x `pp_size`
    ranks would write. `artifacts` maps a config path such as "tokenizer.model" to a local file, stored in
    the archive and referenced the way NeMo does. `prefix` overrides the key prefix (`model.` for NeMo-1,
    `module.` for NeMo 2). `mcore=False` stores legacy names, `transformer_engine` TE norm names.
    Stacked expert weights are stored one expert at a time (`local_experts.<e>`) in the legacy layout and stacked
    in dist checkpoints, as NeMo does.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if not mcore and layout != "legacy":
        raise ValueError("non-mcore (mcore=False) models are saved only in the legacy layout")
    cfg = OmegaConf.to_container(config, resolve=True) if isinstance(config, DictConfig) else copy.deepcopy(config)
    cfg = dict(cfg)
    cfg.update(
        mcore_gpt=mcore, transformer_engine=transformer_engine,
        tensor_model_parallel_size=tp_size, pipeline_model_parallel_size=pp_size,
    )
    canonical = dict(state_dict)
    if not mcore and cfg.get("activation") in SEPARATE_UP_ACTIVATIONS:
        canonical = _separate_up_halves(canonical)
    if mcore and transformer_engine:
        canonical.update(_te_extra_states(canonical))
    names = _stored_layer_names(cfg, transformer_engine)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if layout == "nemo2":
            _write_nemo2_context(root / "context", cfg, canonical, artifacts or {})
            _write_dist(root / "weights", canonical, cfg, prefix or "module.", names, tp_size, pp_size)
        else:
            _store_artifacts(root, cfg, artifacts or {})
            OmegaConf.save(OmegaConf.create(cfg), root / "model_config.yaml")
            if layout == "legacy":
                _write_legacy(root, _unstack_experts(canonical), cfg, prefix or "model.", mcore, names, tp_size,
                              pp_size)
            else:
                _write_dist(root / "model_weights", canonical, cfg, prefix or "model.", names, tp_size, pp_size)
        return tar_directory(root, path, compress=compress, dot_prefix=dot_prefix)


def tar_directory(
    src: str | Path, path: str | Path, *, compress: bool = False, dot_prefix: bool = True
) -> Path:
    """Tar folder `src`'s contents into `path` (gzip when `compress`; members `./x` when `dot_prefix`)."""
    src, path = Path(src), Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)

    def normalise(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
        return info

    with tarfile.open(path, "w:gz" if compress else "w") as tar:
        if dot_prefix:
            tar.add(src, arcname=".", filter=normalise)
        else:
            for child in sorted(src.iterdir()):
                tar.add(child, arcname=child.name, filter=normalise)
    return path


def stored_name(canonical: str, prefix: str, mcore: bool = True,
                layer_names: tuple[tuple[str, str], ...] = TE_NORM_NAMES) -> str:
    """The key NeMo stores canonical tensor `canonical` under (per-layer form); `layer_names` are the (canonical,
    stored) prefix pairs of the layer's tensors (`_stored_layer_names`)."""
    if canonical.startswith("perception."):
        return canonical
    match = LAYER_KEY.match(canonical)
    if match:
        index, rest = match.groups()
        if not mcore:
            return f"{prefix}language_model.encoder.layers.{index}.{swap_prefix(rest, LEGACY_LAYER_NAMES)}"
        return f"{prefix}decoder.layers.{index}.{swap_prefix(rest, layer_names)}"
    if mcore:
        return prefix + canonical
    if canonical.startswith("decoder."):
        return f"{prefix}language_model.encoder.{canonical[len('decoder.'):]}"
    return f"{prefix}language_model.{canonical}"


def _stored_layer_names(cfg: Mapping, transformer_engine: bool) -> tuple[tuple[str, str], ...]:
    """(canonical, stored) prefixes of an mcore layer's tensors: TE fuses the norms into the next linear (only the
    input norm in a MoE layer); NeMo's Falcon layer keeps its norms apart, naming a sequential layer's second one
    `post_self_attn_layernorm`."""
    if cfg.get("name") == FALCON_SPEC_NAME:
        custom = cfg.get("mcore_customization_config") or {}
        parallel = custom.get("new_decoder_architecture") or custom.get("parallel_attention")
        return () if parallel else FALCON_NORM_NAMES
    if not transformer_engine:
        return ()
    return TE_NORM_NAMES[:1] if cfg.get("num_moe_experts") else TE_NORM_NAMES


def _unstack_experts(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Stacked expert weights split into Megatron SequentialMLP's per-expert tensors (`local_experts.<e>`)."""
    out = {}
    for name, tensor in state_dict.items():
        match = LAYER_KEY.match(name)
        if match and match.group(2) in STACKED_EXPERTS:
            module = match.group(2).split(".")[2]
            out.update((f"decoder.layers.{match.group(1)}.mlp.experts.local_experts.{e}.{module}.weight", expert)
                       for e, expert in enumerate(tensor))
        else:
            out[name] = tensor
    return out


def _separate_up_halves(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Split each fused `[gate; up]` fc1 into `dense_h_to_4h` (gate) and `dense_h_to_4h_2` (up)."""
    out = {}
    for name, tensor in state_dict.items():
        match = LAYER_KEY.match(name)
        if match and match.group(2).startswith("mlp.linear_fc1."):
            gate, up = (half.clone() for half in tensor.chunk(2, dim=0))
            out[name] = gate
            out[f"decoder.layers.{match.group(1)}.{FC1_UP}{match.group(2).rsplit('.', 1)[1]}"] = up
        else:
            out[name] = tensor
    return out


def _te_extra_states(state_dict: Mapping[str, torch.Tensor]) -> dict[str, io.BytesIO]:
    """TransformerEngine `_extra_state` entries (empty FP8 metadata) for every layer, as TE saves them."""
    layers = {int(m.group(1)) for m in map(LAYER_KEY.match, state_dict) if m}
    return {
        f"decoder.layers.{i}.{module}._extra_state": io.BytesIO(b"")
        for i in sorted(layers) for module in TE_EXTRA_STATE_MODULES
    }


def _store_artifacts(root: Path, cfg: dict, artifacts: Mapping[str, str | Path]) -> None:
    """Copy each artifact to `<uuid32hex>_<basename>` and point its config entry at `nemo:<that name>`."""
    for config_path, local in artifacts.items():
        local = Path(local)
        name = f"{uuid.UUID(int=random.Random(config_path).getrandbits(128), version=4).hex}_{local.name}"
        shutil.copyfile(local, root / name)
        _set_config_path(cfg, config_path, f"nemo:{name}")


def _set_config_path(cfg: dict, dotted: str, value: str) -> None:
    *parents, leaf = dotted.split(".")
    node = cfg
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value


def _tp_shards(tensor: torch.Tensor, name: str, tp_size: int, gated: bool) -> list[torch.Tensor]:
    """Rank slices of canonical tensor `name`, split exactly as NeMo's tensor-parallel layers hold them."""
    dim = tp_split_dim(name)
    if dim is None or tp_size == 1 or isinstance(tensor, io.BytesIO):
        return [tensor] * tp_size
    if tensor.shape[dim] % tp_size:
        raise ValueError(f"{name}: dim {dim} (size {tensor.shape[dim]}) is not divisible by tp_size={tp_size}")
    if gated and holds_gate_and_up(name):
        gate, up = tensor.chunk(2, dim=0)
        return [torch.cat(pair, dim=0) for pair in zip(gate.chunk(tp_size), up.chunk(tp_size))]
    return [shard.clone() for shard in tensor.chunk(tp_size, dim=dim)]


def _pp_stage(name: str, num_layers: int, pp_size: int) -> tuple[int, str]:
    """(pipeline stage, stage-local name) of canonical tensor `name`."""
    match = LAYER_KEY.match(name)
    if match:
        per_stage = num_layers // pp_size
        index = int(match.group(1))
        return index // per_stage, f"decoder.layers.{index % per_stage}.{match.group(2)}"
    if name.startswith(("decoder.", "output_layer.")):
        return pp_size - 1, name
    return 0, name


def _write_legacy(
    root: Path, canonical: dict, cfg: dict, prefix: str, mcore: bool, names: tuple, tp: int, pp: int
) -> None:
    num_layers = cfg["num_layers"]
    if num_layers % pp:
        raise ValueError(f"num_layers={num_layers} is not divisible by pp_size={pp}")
    gated = cfg.get("activation") in GATED_ACTIVATIONS and not any(FC1_UP in k for k in canonical)
    shards: dict[tuple[int, int], dict] = defaultdict(dict)
    for name, tensor in canonical.items():
        stage, local = _pp_stage(name, num_layers, pp)
        for rank, shard in enumerate(_tp_shards(tensor, name, tp, gated)):
            shards[rank, stage][stored_name(local, prefix, mcore, names)] = shard
    for (rank, stage), weights in shards.items():
        if pp > 1:
            folder = root / f"tp_rank_{rank:02d}_pp_rank_{stage:03d}"
        else:
            folder = root / f"mp_rank_{rank:02d}" if tp > 1 else root
        folder.mkdir(exist_ok=True)
        torch.save({k: _own_storage(v) for k, v in weights.items()}, folder / "model_weights.ckpt")


def _own_storage(value):
    """`value`, cloned when it views part of a larger storage (torch.save would store the whole storage)."""
    is_view = isinstance(value, torch.Tensor) and value.untyped_storage().nbytes() > value.nbytes
    return value.clone() if is_view else value


def _write_dist(folder: Path, canonical: dict, cfg: dict, prefix: str, names: tuple, tp: int, pp: int) -> None:
    """Megatron-style torch_dist checkpoint: homogeneous layers stacked under keys without a layer number (an MoE
    layer's experts stacked after the layer axis, under `mlp.experts.experts.`)."""
    folder.mkdir(parents=True)
    num_layers = cfg["num_layers"]
    per_layer: dict[str, dict[int, torch.Tensor]] = defaultdict(dict)
    flat: dict[str, object] = {}
    for name, tensor in canonical.items():
        match = LAYER_KEY.match(name)
        if not match:
            flat[stored_name(name, prefix)] = tensor
        elif isinstance(tensor, io.BytesIO):
            index, rest = match.groups()
            flat[f"{prefix}decoder.layers.{rest}/shard_{index}_{num_layers}"] = tensor
        else:
            per_layer[match.group(2)][int(match.group(1))] = tensor
    chunking: dict[str, tuple[str, int]] = {}
    for rest, layers in per_layer.items():
        if sorted(layers) != list(range(num_layers)):
            raise ValueError(f"decoder.layers.<i>.{rest} is missing for some of the {num_layers} layers")
        key = f"{prefix}decoder.layers.{swap_prefix(rest, names + DIST_EXPERT_NAMES)}"
        flat[key] = torch.stack([layers[i] for i in range(num_layers)])
        chunking[key] = (f"decoder.layers.0.{rest}", 1)
    for name in canonical:
        if not LAYER_KEY.match(name):
            chunking[stored_name(name, prefix)] = (name, 0)
    gated = cfg.get("activation") in GATED_ACTIVATIONS
    planner = _ChunkingPlanner(lambda key, size: _rank_chunks(key, size, chunking, tp, pp, gated))
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        writer = dcp.FileSystemWriter(str(folder), thread_count=1)
        dcp.save(flat, storage_writer=writer, planner=planner, no_dist=True)
    torch.save({}, folder / "common.pt")
    (folder / "metadata.json").write_text(json.dumps(DIST_METADATA, indent=2))


def _rank_chunks(key, size, chunking, tp, pp, gated) -> list[tuple[list[int], list[int]]]:
    """The (offsets, sizes) pieces that TP x PP Megatron ranks would each write of global tensor `key`."""
    pieces = [([0] * len(size), list(size))]
    canonical, stacked_dims = chunking.get(key, ("", 0))
    if stacked_dims and pp > 1:
        pieces = _split_pieces(pieces, 0, pp)
    dim = tp_split_dim(canonical)
    if dim is not None and tp > 1:
        fused_gate_up = gated and holds_gate_and_up(canonical)
        pieces = _split_pieces(pieces, dim + stacked_dims, 2 * tp if fused_gate_up else tp)
    return pieces


def _split_pieces(pieces, dim: int, parts: int):
    out = []
    for offsets, sizes in pieces:
        if sizes[dim] % parts:
            raise ValueError(f"dimension {dim} of size {sizes[dim]} cannot be split into {parts} rank pieces")
        step = sizes[dim] // parts
        for p in range(parts):
            o, s = list(offsets), list(sizes)
            o[dim], s[dim] = offsets[dim] + p * step, step
            out.append((o, s))
    return out


class _ChunkingPlanner(DefaultSavePlanner):
    """A torch.distributed.checkpoint save planner writing each tensor as the pieces several ranks would."""

    def __init__(self, pieces_of):
        super().__init__()
        self._pieces_of = pieces_of

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        items = []
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                items.append(item)
                continue
            size = item.tensor_data.size
            for offsets, sizes in self._pieces_of(item.index.fqn, size):
                chunk = ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
                items.append(dataclasses.replace(
                    item, type=WriteItemType.SHARD,
                    index=MetadataIndex(item.index.fqn, torch.Size(offsets)),
                    tensor_data=TensorWriteData(chunk, item.tensor_data.properties, size),
                ))
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        value = self.state_dict[write_item.index.fqn]
        if write_item.type == WriteItemType.BYTE_IO:
            return self.transform_object(write_item, value)
        chunk = write_item.tensor_data.chunk
        for dim, (offset, length) in enumerate(zip(chunk.offsets, chunk.sizes)):
            value = value.narrow(dim, offset, length)
        return value.clone()


def _write_nemo2_context(
    context: Path, cfg: dict, canonical: Mapping, artifacts: Mapping[str, str | Path]
) -> None:
    """`context/model.yaml` (+ io.json and the tokenizer file) with NeMo 2.0 field names."""
    context.mkdir(parents=True)
    unknown = set(artifacts) - {"tokenizer.model"}
    if unknown:
        raise ValueError(f"NeMo 2.0 archives store only a 'tokenizer.model' artifact, got {sorted(unknown)}")
    model_class = "gpt.model.base.GPTModel"
    if cfg.get("apply_embedding_scaling"):
        model_class = "gpt.model.gemma.GemmaModel"
    elif cfg.get("normalization") == "rmsnorm":
        model_class = "gpt.model.llama.LlamaModel"
    model = {"_target_": f"nemo.collections.llm.{model_class}", "config": nemo2_config(cfg, canonical)}
    tokenizer_cfg = cfg.get("tokenizer") or {}
    if "tokenizer.model" in artifacts:
        local = Path(artifacts["tokenizer.model"])
        (context / "nemo_tokenizer").mkdir()
        shutil.copyfile(local, context / "nemo_tokenizer" / local.name)
        model["tokenizer"] = {"_target_": NEMO2_SP_TOKENIZER, "model_path": f"nemo_tokenizer/{local.name}"}
    elif tokenizer_cfg.get("library") == "huggingface":
        model["tokenizer"] = {
            "_target_": NEMO2_HF_TOKENIZER, "pretrained_model_name": tokenizer_cfg.get("type")
        }
    OmegaConf.save(OmegaConf.create(model), context / "model.yaml")
    (context / "io.json").write_text("{}")


def nemo2_config(cfg: Mapping, canonical: Mapping | None = None) -> dict:
    """Convert a NeMo-1 model config to the `config:` section of a NeMo 2.0 `model.yaml`."""
    activation = cfg.get("activation", "gelu")
    out = {"_target_": "nemo.collections.llm.gpt.model.base.GPTConfig"}
    out.update({field: cfg[field] for field in NEMO2_COPIED_FIELDS if field in cfg})
    out.update({new: cfg[old] for new, old in NEMO2_RENAMED_FIELDS.items() if old in cfg})
    normalization = cfg.get("normalization", "layernorm")
    out["normalization"] = "RMSNorm" if normalization == "rmsnorm" else "LayerNorm"
    if normalization == "layernorm1p":
        out["layernorm_zero_centered_gamma"] = True
    target = NEMO2_ACTIVATION_TARGETS["openai-gelu" if cfg.get("openai_gelu") else activation.removeprefix("fast-")]
    out["activation_func"] = {"_target_": target, "_call_": False}
    out["gated_linear_unit"] = activation in GATED_ACTIVATIONS
    dtype = next((t.dtype for t in (canonical or {}).values() if isinstance(t, torch.Tensor)), torch.float32)
    out["params_dtype"] = {"_target_": str(dtype), "_call_": False}
    return out

