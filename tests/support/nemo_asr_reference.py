"""Runs INSIDE the NeMo reference venv (tests/support/nemo_reference_env.py): NeMo's own ASR modules on given inputs.

Usage: python -P nemo_asr_reference.py spec.json
spec.json: {"cases": [{"perception": <SALM perception config>, "weights": "<torch state dict .pt, perception keys
without the 'perception.' prefix>" | null, "inputs": "<.npz with signal [B, N] float32, lengths [B] int64>",
"output": "<.npz to write>"}]}

Per case it builds NeMo's AudioToMelSpectrogramPreprocessor with its own window and filterbank (they are written out,
not loaded) and, when the config has an encoder, NeMo's ConformerEncoder for the encoder and for a ConformerEncoder
modality adapter, loads the weights strictly, and composes them as SALM's AudioPerceptionModule does (adapter, then
`proj` = Linear(adapter d_model -> output_dim) when the adapter config has d_model and no output_dim). Output keys:
fb, window, mel, mel_lengths, and with an encoder: encoder_out, encoder_lengths, encoded, encoded_lengths.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch
from nemo.collections.asr.modules import AudioToMelSpectrogramPreprocessor, ConformerEncoder
from nemo.core.classes.common import typecheck


def _kwargs(cfg: dict) -> dict:
    return {key: value for key, value in cfg.items() if key != "_target_"}


def _sub_state(state: dict, prefix: str) -> dict:
    return {key[len(prefix):]: value for key, value in state.items() if key.startswith(prefix)}


def run_case(case: dict) -> None:
    cfg = case["perception"]
    inputs = np.load(case["inputs"])
    signal, lengths = torch.from_numpy(inputs["signal"]), torch.from_numpy(inputs["lengths"])
    preprocessor = AudioToMelSpectrogramPreprocessor(**_kwargs(cfg["preprocessor"])).eval()
    out = {
        "fb": preprocessor.featurizer.fb.numpy(),
        "window": preprocessor.featurizer.window.numpy(),
    }
    with torch.no_grad(), typecheck.disable_checks():  # as AudioPerceptionModule: the adapter takes encoder outputs
        mel, mel_lengths = preprocessor(input_signal=signal, length=lengths)
        out.update(mel=mel.numpy(), mel_lengths=mel_lengths.numpy())
        if "encoder" in cfg:
            state = torch.load(case["weights"], map_location="cpu")
            encoder = ConformerEncoder(**_kwargs(cfg["encoder"])).eval()
            encoder.load_state_dict(_sub_state(state, "encoder."), strict=True)
            enc, enc_lengths = encoder(audio_signal=mel, length=mel_lengths)
            out.update(encoder_out=enc.numpy(), encoder_lengths=enc_lengths.numpy())
            adapter_cfg = cfg["modality_adapter"]
            target = adapter_cfg["_target_"].rsplit(".", 1)[-1]
            if target == "ConformerEncoder":
                adapter_kwargs = _kwargs(adapter_cfg)
                adapter_kwargs.setdefault("feat_in", encoder._feat_out)
                adapter = ConformerEncoder(**adapter_kwargs).eval()
                adapter.load_state_dict(_sub_state(state, "modality_adapter."), strict=True)
                enc, enc_lengths = adapter(audio_signal=enc, length=enc_lengths)
            elif not target.startswith("IdentityConnector"):
                raise SystemExit(f"reference: adapter {target} not handled")
            encoded = enc.transpose(1, 2)
            if "output_dim" not in adapter_cfg and "d_model" in adapter_cfg:
                proj = torch.nn.Linear(adapter_cfg["d_model"], cfg["output_dim"])
                proj.load_state_dict(_sub_state(state, "proj."), strict=True)
                encoded = proj(encoded)
            out.update(encoded=encoded.numpy(), encoded_lengths=enc_lengths.numpy())
    np.savez(case["output"], **out)


def main() -> None:
    with open(sys.argv[1]) as handle:
        spec = json.load(handle)
    for case in spec["cases"]:
        run_case(case)


if __name__ == "__main__":
    main()
