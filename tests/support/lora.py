"""NeMo LoRA adapters for the tiny Neva of `support.vlm`, written as NeMo's PEFT fine-tuning writes them, and the
reference: transformers' Llama with an adapter merged by hand into its own (unfused) q/k/v/o/gate/up/down weights.

The files are built here with torch.save and YAML, not with the project's writer: `model_weights.ckpt` under
`model.decoder.layers.<i>.<adapter>.linear_in|linear_out.weight` plus `model_config.yaml` (the base model's config
and `peft.lora_tuning`), or, tensor parallel, `mp_rank_0X/model_weights.ckpt` holding each rank's part as NeMo's
ParallelLinearAdapter holds it (linear_in of QKV and fc1 split along the rank, of dense and fc2 along the input;
every linear_out along its output; fc1's linear_out per rank `[gate_r; up_r]`). The merge follows NeMo's forward:
the update `(alpha / dim) · B A` adds to the fused, per-group interleaved QKV output and to fc1's `[gate; up]`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import yaml
from transformers import LlamaForCausalLM

from support.vlm import FFN, GROUPS, HEADS, HIDDEN, LAYERS, TinyVlm

HEAD_DIM = HIDDEN // HEADS
QKV_ROWS = (HEADS + 2 * GROUPS) * HEAD_DIM
ADAPTERS = {  # NeMo adapter -> (rows of B, columns of A)
    "self_attention.adapter_layer.lora_kqv_adapter": (QKV_ROWS, HIDDEN),
    "self_attention.adapter_layer.lora_dense_attention_adapter": (HIDDEN, HIDDEN),
    "mlp.adapter_layer.lora_hto4h_adapter": (2 * FFN, HIDDEN),
    "mlp.adapter_layer.lora_4htoh_adapter": (HIDDEN, FFN),
}
ROW_PARALLEL = ("lora_dense_attention_adapter", "lora_4htoh_adapter")  # their linear_in splits along the input


@dataclass
class TinyAdapter:
    """An adapter on disk and what it adds: per NeMo adapter key prefix, (A, B); the update is scale · B A."""

    path: Path
    rank: int
    scale: float
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]


def write_adapter(folder: Path, base_config: dict, *, seed: int, rank: int, alpha: float | str | None,
                  tp_size: int = 1, adapters: tuple[str, ...] = tuple(ADAPTERS), magnitude: float = 0.25,
                  layers: int = LAYERS) -> TinyAdapter:
    """A NeMo PEFT LoRA folder (`model_config.yaml` + weights) in `folder`; `alpha` None leaves it out (alpha =
    dim), a string writes it as given (the example configs' interpolation)."""
    generator = torch.Generator().manual_seed(seed)
    pairs = {}
    for layer in range(layers):
        for adapter in adapters:
            rows, columns = ADAPTERS[adapter]
            a = torch.randn(rank, columns, generator=generator) * magnitude
            b = torch.randn(rows, rank, generator=generator) * magnitude
            pairs[f"decoder.layers.{layer}.{adapter}"] = (a, b)
    lora = {"adapter_dim": rank, "adapter_dropout": 0.0, "column_init_method": "xavier", "row_init_method": "zero",
            "target_modules": ["attention_qkv", "attention_dense", "mlp_fc1", "mlp_fc2"]}
    if alpha is not None:
        lora["alpha"] = alpha
    config = copy.deepcopy(base_config)
    config.update(peft={"peft_scheme": "lora", "restore_from_path": None, "lora_tuning": lora},
                  tensor_model_parallel_size=tp_size)
    folder.mkdir(parents=True)
    (folder / "model_config.yaml").write_text(yaml.safe_dump(config))
    for rank_index in range(tp_size):
        shard = {}
        for prefix, (a, b) in pairs.items():
            a_part, b_part = _tp_part(prefix, a, b, rank_index, tp_size)
            shard[f"model.{prefix}.linear_in.weight"] = a_part.clone()
            shard[f"model.{prefix}.linear_out.weight"] = b_part.clone()
        target = folder / f"mp_rank_{rank_index:02d}" if tp_size > 1 else folder
        target.mkdir(exist_ok=True)
        torch.save(shard, target / "model_weights.ckpt")
    effective_alpha = rank if alpha is None or isinstance(alpha, str) else alpha
    return TinyAdapter(folder, rank, effective_alpha / rank, pairs)


def _tp_part(prefix: str, a: torch.Tensor, b: torch.Tensor, rank: int, tp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s linear_in and linear_out of one adapter, as NeMo's parallel layers hold them."""
    a_part = a.chunk(tp, dim=1 if prefix.endswith(ROW_PARALLEL) else 0)[rank]
    if prefix.endswith("lora_hto4h_adapter"):
        gate, up = b.chunk(2, dim=0)
        return a_part, torch.cat([gate.chunk(tp)[rank], up.chunk(tp)[rank]])
    return a_part, b.chunk(tp, dim=0)[rank]


def nemo_config(vlm: TinyVlm) -> dict:
    """The tiny Neva's model config (as its .nemo holds it)."""
    import tarfile

    with tarfile.open(vlm.nemo) as archive:
        member = next(m for m in archive.getmembers() if m.name.endswith("model_config.yaml"))
        return yaml.safe_load(archive.extractfile(member))


def merged_llm(llm: LlamaForCausalLM, adapter: TinyAdapter) -> LlamaForCausalLM:
    """A copy of transformers' Llama with `adapter` merged into its own weights, following NeMo's forward."""
    merged = copy.deepcopy(llm)
    per_group = HEADS // GROUPS
    with torch.no_grad():
        for prefix, (a, b) in adapter.pairs.items():
            layer = merged.model.layers[int(prefix.split(".")[2])]
            delta = adapter.scale * (b @ a)
            if prefix.endswith("lora_kqv_adapter"):  # rows per KV group: its queries, its key, its value
                grouped = delta.view(GROUPS, per_group + 2, HEAD_DIM, HIDDEN)
                layer.self_attn.q_proj.weight += grouped[:, :per_group].reshape(HEADS * HEAD_DIM, HIDDEN)
                layer.self_attn.k_proj.weight += grouped[:, per_group].reshape(GROUPS * HEAD_DIM, HIDDEN)
                layer.self_attn.v_proj.weight += grouped[:, per_group + 1].reshape(GROUPS * HEAD_DIM, HIDDEN)
            elif prefix.endswith("lora_dense_attention_adapter"):
                layer.self_attn.o_proj.weight += delta
            elif prefix.endswith("lora_hto4h_adapter"):  # rows [gate; up]
                layer.mlp.gate_proj.weight += delta[:FFN]
                layer.mlp.up_proj.weight += delta[FFN:]
            else:
                layer.mlp.down_proj.weight += delta
    return merged


def with_adapter(vlm: TinyVlm, adapter: TinyAdapter | None) -> TinyVlm:
    """The reference model of `vlm` answering with `adapter` merged (the base without one)."""
    return vlm if adapter is None else replace(vlm, llm=merged_llm(vlm.llm, adapter))
