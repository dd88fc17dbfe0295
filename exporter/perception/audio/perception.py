"""`AudioPerception`: NeMo's AudioPerceptionModule (mel front end -> FastConformer -> modality adapter -> proj)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf
from torch import Tensor, nn

from .adapters import build_modality_adapter
from .conformer import ConformerEncoder
from .errors import AudioPerceptionError
from .features import FRONTENDS, NEMO_25, MelPreprocessor, check_frontend

DEFAULT_FRONTEND = NEMO_25
_FEATURIZER_BUFFERS = ("preprocessor.featurizer.fb", "preprocessor.featurizer.window")

__all__ = ["DEFAULT_FRONTEND", "FRONTENDS", "AudioPerception", "AudioPerceptionError"]


def _plain(value: Any) -> Any:
    """A config (DictConfig, ListConfig or nested mappings and lists of them) as plain dicts and lists."""
    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    if isinstance(value, Mapping):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value


class AudioPerception(nn.Module):
    """NeMo's AudioPerceptionModule at inference: mel front end -> FastConformer -> modality adapter -> proj.

    Parameter and buffer names are NeMo's without the leading `perception.`; always in eval mode (no dither).
    """

    def __init__(self, preprocessor: MelPreprocessor, encoder: ConformerEncoder, modality_adapter: nn.Module,
                 proj: nn.Module, frontend: str, output_dim: int):
        super().__init__()
        self.preprocessor = preprocessor
        self.encoder = encoder
        self.modality_adapter = modality_adapter
        self.proj = proj
        self.frontend = frontend
        self.output_dim = output_dim  # width of the encoded features (the LLM hidden size)
        featurizer = preprocessor.featurizer
        self.sample_rate: int = featurizer.sample_rate
        self.n_mels: int = featurizer.n_mels * featurizer.frame_splicing
        self.eval()

    @classmethod
    def from_config(cls, perception_cfg: Mapping[str, Any], *, frontend: str | None = None) -> AudioPerception:
        """Builds from a SALM model config's `perception` section (dict or DictConfig).

        `frontend`: "nemo-2.4" or "nemo-2.5" (see `features`); None takes the section's own `frontend` key if it
        has one (this project writes it into exported configs), else "nemo-2.5".
        """
        cfg = _plain(perception_cfg)
        for key in ("preprocessor", "encoder", "modality_adapter"):
            if not isinstance(cfg.get(key), Mapping):
                raise AudioPerceptionError(f"the perception config has no `{key}` section")
        frontend = check_frontend(frontend or cfg.get("frontend") or DEFAULT_FRONTEND)
        if cfg.get("use_multi_layer_feat"):
            raise AudioPerceptionError("perception use_multi_layer_feat=True (multi-layer encoder features) "
                                       "is not supported")
        preprocessor = MelPreprocessor.from_config(cfg["preprocessor"], frontend)
        n_mels = preprocessor.featurizer.n_mels * preprocessor.featurizer.frame_splicing
        encoder = ConformerEncoder.from_config(cfg["encoder"], frontend, feat_in=n_mels)
        if encoder.feat_in != n_mels:
            raise AudioPerceptionError(f"encoder feat_in={encoder.feat_in} but the preprocessor makes {n_mels} "
                                       "features per frame")
        adapter_cfg = cfg["modality_adapter"]
        adapter, adapter_dim = build_modality_adapter(adapter_cfg, frontend, input_dim=encoder.output_dim)
        if "output_dim" not in adapter_cfg and "d_model" in adapter_cfg:
            if cfg.get("output_dim") is None:
                raise AudioPerceptionError("the perception config has no output_dim (the LLM hidden size)")
            proj: nn.Module = nn.Linear(int(adapter_cfg["d_model"]), int(cfg["output_dim"]))
        else:
            proj = nn.Identity()
        output_dim = proj.out_features if isinstance(proj, nn.Linear) else adapter_dim
        return cls(preprocessor, encoder, adapter, proj, frontend, output_dim)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False):
        """Loads NeMo's perception weights (prefix `perception.` removed). `preprocessor.featurizer.fb` / `.window`
        are optional (computed when absent); layer biases absent from the weights are dropped (`use_bias: false`)."""
        state = dict(state_dict)
        for key in _FEATURIZER_BUFFERS:
            state.setdefault(key, self.get_buffer(key))
        for name, module in (("encoder", self.encoder), ("modality_adapter", self.modality_adapter)):
            if isinstance(module, ConformerEncoder):
                module.drop_biases_absent_from(state, prefix=f"{name}.")
        return super().load_state_dict(state, strict=strict, assign=assign)

    def train(self, mode: bool = True) -> AudioPerception:
        if mode:
            raise AudioPerceptionError("AudioPerception is inference-only (no dither, batch norm running stats)")
        return super().train(False)

    def features(self, signal: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
        """float32 signal [B, N] + lengths [B] (samples) -> mel [B, n_mels, T], mel_lengths [B] int64."""
        if signal.dim() != 2 or lengths.shape != signal.shape[:1]:
            raise AudioPerceptionError(f"expected signal [B, N] and lengths [B], got {list(signal.shape)} and "
                                       f"{list(lengths.shape)}")
        with torch.no_grad():
            return self.preprocessor(signal, lengths)

    def encode(self, mel: Tensor, mel_lengths: Tensor) -> tuple[Tensor, Tensor]:
        """mel -> encoded [B, T', H_llm], encoded_lengths [B] int64 (encoder -> adapter -> transpose -> proj)."""
        encoded, lengths = self.encoder(mel, mel_lengths)
        encoded, lengths = self.modality_adapter(encoded, lengths)
        return self.proj(encoded.transpose(1, 2)), lengths.to(torch.int64)

    def forward(self, signal: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
        return self.encode(*self.features(signal, lengths))
