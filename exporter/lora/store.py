"""LoRA adapters in the engine directory: ``llm_engine/lora/<uid>/adapter.safetensors`` + ``adapter.json``.

The safetensors file holds ``<layer>.<module>.a`` (A ``[rank, in]``) and ``<layer>.<module>.b`` (B ``[out, rank]``)
in the model dtype, unscaled; ``adapter.json`` holds ``uid``, ``rank``, ``alpha``, ``modules`` and ``source``. The
manifest lists the files (and their hashes) with the engine's others, and its ``lora`` entry names the adapters.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .adapters import LoraAdapter, LoraError, check_uid

LORA_DIR = "lora"


def save_adapters(directory: Path, adapters: Sequence[LoraAdapter], dtype: torch.dtype) -> None:
    """Write each adapter into ``directory/<uid>/`` with its tensors in ``dtype``."""
    for adapter in adapters:
        folder = directory / check_uid(adapter.uid)
        folder.mkdir(parents=True)
        tensors = {}
        for (layer, module), (a, b) in adapter.weights.items():
            tensors[f"{layer}.{module}.a"] = a.to(dtype).contiguous()
            tensors[f"{layer}.{module}.b"] = b.to(dtype).contiguous()
        save_file(tensors, str(folder / "adapter.safetensors"))
        (folder / "adapter.json").write_text(json.dumps({"uid": adapter.uid, **adapter.describe()}, indent=2))


def load_adapters(directory: Path, uids: Sequence[str]) -> list[LoraAdapter]:
    """The adapters ``uids`` saved in ``directory``."""
    adapters = []
    for uid in uids:
        folder = directory / check_uid(uid)
        try:
            facts = json.loads((folder / "adapter.json").read_text())
            tensors = load_file(str(folder / "adapter.safetensors"))
        except (OSError, ValueError) as error:
            raise LoraError(f"LoRA adapter {uid!r} of the engine is unreadable ({error}); export it again") from None
        weights = {}
        for name, a in tensors.items():
            layer, module, kind = name.split(".")
            if kind == "a":
                weights[int(layer), module] = (a, tensors[f"{layer}.{module}.b"])
        adapters.append(LoraAdapter(uid, int(facts["rank"]), float(facts["alpha"]), weights,
                                    source=str(facts.get("source", ""))))
    return adapters
