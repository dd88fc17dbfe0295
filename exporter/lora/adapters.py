"""NeMo LoRA adapters as NeMo's PEFT fine-tuning writes them, read into one form: per (layer, module) A and B.

NeMo's LoRA (``peft.lora_tuning``) adds ``(alpha / dim) · linear_out(linear_in(x))`` to a projection's output, with
``A = linear_in.weight [dim, in]`` and ``B = linear_out.weight [out, dim]``; ``alpha`` defaults to ``dim``. Its
adapters, relative to a layer (legacy ``language_model.encoder.layers`` names are mapped to these):

- ``self_attention.adapter_layer.lora_kqv_adapter``: the fused QKV (``attn_qkv``), B's rows in the fused tensor's
  per-group interleaved order;
- ``self_attention.adapter_layer.lora_dense_attention_adapter``: the attention output (``attn_dense``);
- ``mlp.adapter_layer.lora_hto4h_adapter``: fc1 (``mlp_h_to_4h``), B's rows ``[gate; up]`` for gated MLPs;
- ``mlp.adapter_layer.lora_4htoh_adapter``: fc2 (``mlp_4h_to_h``).

An adapter checkpoint is a ``.nemo`` or a folder (``model_config.yaml`` with ``peft.lora_tuning``, and
``model_weights.ckpt`` or TP shards ``mp_rank_XX/model_weights.ckpt``), read by ``NemoCheckpoint``, which joins the
TP shards as NeMo's layers split them (``exporter.checkpoint.names``: each rank's fc1 adapter holds
``[gate_r; up_r]``). Module names are TensorRT-LLM's ``lora_target_modules``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from torch import Tensor

from wire import NO_LORA_UIDS

from ..checkpoint import NemoCheckpoint, NemoCheckpointError
from ..llm.lora_layers import LORA_MODULES

LORA_MARKER = "adapter_layer.lora"
#: NeMo's LoRA adapter (relative to a layer) -> the module it adapts (a `lora_target_modules` name).
NEMO_ADAPTERS = {
    "self_attention.adapter_layer.lora_kqv_adapter": "attn_qkv",
    "self_attention.adapter_layer.lora_dense_attention_adapter": "attn_dense",
    "mlp.adapter_layer.lora_hto4h_adapter": "mlp_h_to_4h",
    "mlp.adapter_layer.lora_4htoh_adapter": "mlp_4h_to_h",
}
#: NeMo's `lora_target_modules` choices (TensorRT-LLM's names). NeMo's adapters are fused, so the separate
#: q/k/v and gate modules never hold one.
LORA_TARGET_MODULES = ("attn_qkv", "attn_q", "attn_k", "attn_v", "attn_dense", "mlp_h_to_4h", "mlp_gate",
                       "mlp_4h_to_h")
_LORA_KEY = re.compile(r"^decoder\.layers\.(\d+)\.(.+\.adapter_layer\.lora_\w+)\.(linear_in|linear_out)\.weight$")
_UID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]{0,63}$")
#: What a checkpoint folder holds at its top (a config, weights, TP shard folders, dist weights).
_CHECKPOINT_ENTRY = re.compile(r"^(model_config\.yaml|model_weights\.ckpt|model_weights|mp_rank_\d+|"
                               r"tp_rank_\d+_pp_rank_\d+)$")


class LoraError(ValueError):
    """LoRA adapters that cannot be read, merged or served (the message names the adapter, key or setting)."""


@dataclass
class LoraAdapter:
    """One LoRA adapter: per ``(layer, module)`` its ``A [rank, in]`` and ``B [out, rank]``; the update of that
    projection's output is ``scale · B A x``. ``extra`` holds any other (fine-tuned) tensors its checkpoint carried,
    in canonical names."""

    uid: str
    rank: int
    alpha: float
    weights: dict[tuple[int, str], tuple[Tensor, Tensor]]
    source: str = ""
    extra: dict[str, Tensor] = field(default_factory=dict)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @property
    def modules(self) -> tuple[str, ...]:
        """The modules it adapts, in `LORA_MODULES` order."""
        used = {module for _, module in self.weights}
        return tuple(m for m in LORA_MODULES if m in used)

    def describe(self) -> dict[str, Any]:
        """What the engine manifest records of it."""
        return {"rank": self.rank, "alpha": self.alpha, "modules": list(self.modules), "source": self.source}


def check_uid(uid: str) -> str:
    """``uid`` if it can name an adapter (letters, digits, ``_.+-``, up to 64; not ``-1``), else a LoraError."""
    if not isinstance(uid, str) or not _UID.match(uid) or uid in NO_LORA_UIDS:
        raise LoraError(f"LoRA uid {uid!r} is not valid: use up to 64 letters, digits, '_', '.', '+' or '-', "
                        "starting with a letter or digit ('-1' means no adapter)")
    return uid


def take_adapter_weights(weights: dict[str, Tensor], model_config: Any, where: str
                         ) -> tuple[dict[tuple[int, str], tuple[Tensor, Tensor]], int, float] | None:
    """Remove the LoRA tensors from canonical ``weights``; return them per (layer, module) with the adapters' rank
    and alpha (from ``peft.lora_tuning``), or None if there are none. ``where`` names the checkpoint in errors."""
    pairs: dict[tuple[int, str], dict[str, Tensor]] = {}
    for name in [k for k in weights if LORA_MARKER in k]:
        match = _LORA_KEY.match(name)
        if match is None or match[2] not in NEMO_ADAPTERS:
            raise LoraError(
                f"{where}: LoRA weight {name!r} is not one this exporter merges or serves (linear_in/linear_out weights of "
                f"{', '.join(a.rsplit('.', 1)[1] for a in NEMO_ADAPTERS)}); merge it into the checkpoint with NeMo"
            )
        pairs.setdefault((int(match[1]), NEMO_ADAPTERS[match[2]]), {})[match[3]] = weights.pop(name)
    if not pairs:
        return None
    alpha, dim = lora_alpha_and_dim(model_config)
    adapters: dict[tuple[int, str], tuple[Tensor, Tensor]] = {}
    ranks = set()
    for (layer, module), pair in sorted(pairs.items()):
        if set(pair) != {"linear_in", "linear_out"}:
            missing = ({"linear_in", "linear_out"} - set(pair)).pop()
            raise LoraError(f"{where}: layer {layer} {module} adapter lacks its {missing}.weight")
        a, b = pair["linear_in"], pair["linear_out"]
        if a.ndim != 2 or b.ndim != 2 or b.shape[1] != a.shape[0]:
            raise LoraError(f"{where}: layer {layer} {module} adapter has linear_in {list(a.shape)} and linear_out "
                            f"{list(b.shape)}; linear_out's columns must equal linear_in's rows (the rank)")
        if dim is not None and a.shape[0] != dim:
            raise LoraError(f"{where}: layer {layer} {module} adapter has rank {a.shape[0]}, but "
                            f"peft.lora_tuning.adapter_dim is {dim}")
        ranks.add(a.shape[0])
        adapters[layer, module] = (a, b)
    if len(ranks) != 1:
        raise LoraError(f"{where}: the adapters have different ranks {sorted(ranks)}; NeMo's LoRA has one "
                        "adapter_dim")
    rank = ranks.pop()
    return adapters, rank, float(alpha if alpha is not None else rank)


def read_adapter(path: str | Path, uid: str | None = None) -> LoraAdapter:
    """The LoRA adapter in a NeMo PEFT checkpoint (``.nemo`` or folder), named ``uid`` (default: its file name)."""
    path = Path(path)
    uid = check_uid(uid if uid is not None else path.name.removesuffix(".nemo"))
    try:
        with NemoCheckpoint(path) as checkpoint:
            config = checkpoint.config
            sharded = checkpoint.layout in ("tp_shards", "tp_pp_shards")
            weights = checkpoint.state_dict()
    except NemoCheckpointError as error:
        raise LoraError(f"LoRA adapter {uid!r}: {error}") from None
    taken = take_adapter_weights(weights, config, f"LoRA adapter {uid!r} ({path.name})")
    if taken is None:
        raise LoraError(f"LoRA adapter {uid!r}: {path.name} holds no NeMo LoRA adapter weights "
                        "(decoder.layers.<i>.*.adapter_layer.lora_*); NeMo 2.0 PEFT checkpoints are not read")
    adapters, rank, alpha = taken
    if sharded and any(module == "mlp_h_to_4h" for _, module in adapters) and not config.get("activation"):
        raise LoraError(f"LoRA adapter {uid!r}: its model_config.yaml has no `activation`, which says how its "
                        "TP-sharded fc1 adapter joins ([gate_r; up_r] per rank when gated); add it")
    return LoraAdapter(uid, rank, alpha, adapters, source=path.name, extra=weights)


def adapter_sources(spec: str | Path | Sequence[str | Path]) -> dict[str, Path]:
    """uid -> checkpoint of each adapter that ``lora_checkpoint_path`` names.

    ``spec``: one adapter (a ``.nemo`` or a folder; uid = its name without ``.nemo``), a folder of adapters (each
    ``.nemo`` or adapter folder in it, uid = its name), ``uid:path`` (that uid), or several of these as a list or a
    comma-separated string.
    """
    entries = [spec] if isinstance(spec, (str, Path)) else list(spec)
    if len(entries) == 1 and isinstance(entries[0], str) and "," in entries[0]:
        entries = [part.strip() for part in entries[0].split(",") if part.strip()]
    sources: dict[str, Path] = {}
    for entry in entries:
        uid, path = _named_entry(entry)
        if not path.exists():
            raise LoraError(f"lora_checkpoint_path {str(entry)!r}: {path} does not exist")
        if uid is not None or _is_adapter(path):
            found = {check_uid(uid or path.name.removesuffix(".nemo")): path}
        else:
            found = {check_uid(child.name.removesuffix(".nemo")): child
                     for child in sorted(path.iterdir()) if _is_adapter(child)}
            if not found:
                raise LoraError(f"lora_checkpoint_path {str(entry)!r}: {path} is neither a LoRA checkpoint "
                                "(model_config.yaml + model_weights.ckpt or mp_rank_XX/) nor a folder of them")
        for name, source in found.items():
            if name in sources:
                raise LoraError(f"lora_checkpoint_path names LoRA uid {name!r} twice ({sources[name]}, {source}); "
                                "give one of them another uid with uid:path")
            sources[name] = source
    return sources


def read_adapters(spec: str | Path | Sequence[str | Path] | None) -> list[LoraAdapter]:
    """Every adapter ``lora_checkpoint_path`` names (`adapter_sources`), read."""
    if spec is None or (not isinstance(spec, (str, Path)) and not spec):
        return []
    return [read_adapter(path, uid) for uid, path in adapter_sources(spec).items()]


@dataclass(frozen=True)
class LoraPlan:
    """The LoRA an engine serves: its adapters, the modules any adapter may adapt, the largest rank and the number
    of adapters served at once (slots)."""

    adapters: tuple[LoraAdapter, ...]
    modules: tuple[str, ...]
    max_rank: int
    max_loras: int

    def to_manifest(self) -> dict[str, Any]:
        return {"target_modules": list(self.modules), "max_lora_rank": self.max_rank, "max_loras": self.max_loras,
                "adapters": {adapter.uid: adapter.describe() for adapter in self.adapters}}


def plan_lora(adapters: Sequence[LoraAdapter], target_modules: Sequence[str] | None, max_rank: int,
              max_loras: int | None = None) -> LoraPlan:
    """The modules NeMo's ``lora_target_modules`` names (default: every module the adapters adapt, or all of them
    without adapters) and ``max_loras`` slots (default: one per adapter). Each adapter is checked against them, its
    rank and the model where it is served (`exporter.llm.lora_layers.check_lora_adapter`)."""
    if max_rank < 1:
        raise LoraError(f"max_lora_rank must be at least 1, got {max_rank}")
    if max_loras is not None and max_loras < max(1, len(adapters)):
        raise LoraError(f"max_loras={max_loras} cannot hold the {len(adapters)} LoRA adapters given; raise it")
    if target_modules is None:
        used = {module for adapter in adapters for module in adapter.modules}
        modules = tuple(m for m in LORA_MODULES if m in used) if adapters else tuple(LORA_MODULES)
    else:
        unknown = [m for m in target_modules if m not in LORA_TARGET_MODULES]
        if unknown:
            raise LoraError(f"lora_target_modules {unknown} are not LoRA modules; choose from "
                            f"{', '.join(LORA_TARGET_MODULES)}")
        separate = [m for m in target_modules if m not in LORA_MODULES]
        if separate:
            raise LoraError(f"lora_target_modules {separate} name separate q/k/v or gate projections, which NeMo's "
                            f"fused LoRA adapters do not have; use {', '.join(LORA_MODULES)}")
        modules = tuple(m for m in LORA_MODULES if m in target_modules)
    for adapter in adapters:
        if adapter.extra:
            raise LoraError(f"LoRA adapter {adapter.uid!r} also carries fine-tuned weights that are not LoRA "
                            f"(such as {next(iter(adapter.extra))}), which one engine cannot serve per adapter; "
                            "export it merged (merge_lora=True)")
    return LoraPlan(tuple(adapters), modules, max_rank, max_loras or max(1, len(adapters)))


def lora_alpha_and_dim(model_config: Any) -> tuple[float | None, int | None]:
    """``(alpha, adapter_dim)`` from ``peft.lora_tuning`` (None where not set; alpha None means alpha = dim).

    The example configs write ``alpha: ${model.peft.lora_tuning.adapter_dim}``, an interpolation that cannot
    resolve in a saved model config; it is read as what it names.
    """
    peft = _plain(model_config).get("peft") or {}
    if peft.get("weight_tying"):
        raise LoraError("peft.weight_tying LoRA is not supported; merge the adapters with NeMo first")
    lora = peft.get("lora_tuning") or {}
    if lora.get("weight_tying"):
        raise LoraError("peft.lora_tuning.weight_tying LoRA is not supported; merge the adapters with NeMo first")
    if lora.get("variant", "nemo") != "nemo":
        raise LoraError(f"peft.lora_tuning.variant {lora.get('variant')!r} (unfused q/k/v and gate/up adapters) is "
                        "not supported; NeMo's default fused variant is")
    dim, alpha = lora.get("adapter_dim"), lora.get("alpha")
    if isinstance(alpha, str) and alpha.startswith("${"):
        if not alpha.rstrip("}").endswith("adapter_dim"):
            raise LoraError(f"peft.lora_tuning.alpha is the interpolation {alpha!r}; set it to a number")
        alpha = None
    try:
        return (None if alpha is None else float(alpha)), (None if dim is None else int(dim))
    except (TypeError, ValueError):
        raise LoraError(f"peft.lora_tuning adapter_dim={dim!r} / alpha={alpha!r} must be numbers") from None


def _named_entry(entry: str | Path) -> tuple[str | None, Path]:
    """(uid, path) of a ``uid:path`` entry, (None, path) of a plain path."""
    text = str(entry)
    name, sep, rest = text.partition(":")
    if sep and rest and "/" not in name and not Path(text).exists():
        return check_uid(name), Path(rest).expanduser()
    return None, Path(text).expanduser()


def _is_adapter(path: Path) -> bool:
    """Whether ``path`` is one checkpoint (a ``.nemo`` file, or a folder holding a config or weights)."""
    if path.is_file():
        return path.suffix == ".nemo"
    return path.is_dir() and any(_CHECKPOINT_ENTRY.match(child.name) for child in path.iterdir())


def _plain(model_config: Any) -> dict:
    """The config as plain containers, interpolations left as their ``${...}`` text."""
    if isinstance(model_config, DictConfig):
        return OmegaConf.to_container(model_config, resolve=False)
    return dict(model_config or {})
