"""NeMo LoRA adapters: read from NeMo's PEFT checkpoints (`adapters`), merged into the weights they adapt
(`merge`), kept in the engine directory (`store`). Serving them per row is `exporter.llm.lora_layers`."""

from .adapters import (
    LORA_TARGET_MODULES,
    LoraAdapter,
    LoraError,
    LoraPlan,
    adapter_sources,
    check_uid,
    lora_alpha_and_dim,
    plan_lora,
    read_adapter,
    read_adapters,
)
from .merge import merge_adapter, merge_extra, merge_lora
from .store import LORA_DIR, load_adapters, save_adapters

__all__ = [
    "LORA_DIR", "LORA_TARGET_MODULES", "LoraAdapter", "LoraError", "adapter_sources", "check_uid",
    "load_adapters", "lora_alpha_and_dim", "LoraPlan", "merge_adapter", "merge_extra", "merge_lora",
    "plan_lora", "read_adapter", "read_adapters", "save_adapters",
]
