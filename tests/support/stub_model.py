"""A deterministic stand-in for the exported model, to test the serving layer without weights.

Each row is answered with its prompt, a digest of its media and its generation parameters, so a test can tell
every request's answer apart. Bad input raises ValueError, as the real model does; a prompt starting with
"crash" raises RuntimeError (a server fault).
"""

from __future__ import annotations

import io
import threading
import time

import numpy as np

from wire import (
    ITritonDeployable,
    RequestRow,
    encode_outputs,
    multimodal_triton_inputs,
    multimodal_triton_outputs,
    split_request,
)

DEFAULTS = {"max_output_len": 30, "top_k": 1, "top_p": 0.0, "temperature": 1.0, "repetition_penalty": 1.0,
            "num_beams": 1}


def describe_pixels(pixels: np.ndarray) -> str:
    """`mean=R,G,B|size=WxH|frames=N` of a `[H,W,3]` or `[N,H,W,3]` uint8 array."""
    frames = pixels if pixels.ndim == 4 else pixels[np.newaxis]
    mean = frames.reshape(-1, 3).mean(axis=0).round().astype(int)
    count, height, width = frames.shape[:3]
    return f"mean={mean[0]},{mean[1]},{mean[2]}|size={width}x{height}|frames={count}"


def expected_answer(text: str, media: str, beam: int = 0, **params: float) -> str:
    """The answer the stub gives: prompt, media digest, parameters (defaults filled), beam index."""
    full = {name: value for name, value in DEFAULTS.items() if name != "num_beams"}
    full.update(params)
    shown = "|".join(f"{name}={full[name]:g}" for name in sorted(full))
    return f"{text}|{media}|{shown}|beam={beam}"


class StubMultimodalModel(ITritonDeployable):
    """Answers deterministically after `delay_s`; `prompts` records every call's prompts, `concurrent_peak` the
    most calls that ran at once."""

    def __init__(self, model_dir=None, load_model=True, modality: str = "vision", delay_s: float = 0.0, **_):
        self.modality = modality
        self.delay_s = delay_s
        self.prompts: list[list[str]] = []
        self.concurrent_peak = 0
        self._running = 0
        self._lock = threading.Lock()

    def load(self) -> None:
        """Nothing to load (`TensorRTMMExporter.load`'s place: the scripts load the exporter they made unloaded)."""

    @property
    def get_triton_input(self):
        return multimodal_triton_inputs(self.modality)

    @property
    def get_triton_output(self):
        return multimodal_triton_outputs()

    def triton_infer_fn(self, **inputs: np.ndarray) -> dict[str, np.ndarray]:
        rows = split_request(inputs)
        with self._lock:
            self.prompts.append([row.text for row in rows])
            self._running += 1
            self.concurrent_peak = max(self.concurrent_peak, self._running)
        try:
            time.sleep(self.delay_s)
            return encode_outputs([self._answer_row(row) for row in rows])
        finally:
            with self._lock:
                self._running -= 1

    def _answer_row(self, row: RequestRow) -> list[str]:
        if row.text.startswith("crash"):
            raise RuntimeError("the stub crashed in /opt/stub/model.py")
        params = {**DEFAULTS, **row.sampling}
        if params["temperature"] <= 0:
            raise ValueError(f"temperature must be > 0, got {params['temperature']}")
        media = self._describe_media(row)
        beams = params.pop("num_beams")
        lora = f"|lora={row.lora_uid}" if row.lora_uid else ""
        return [expected_answer(row.text, media, beam, **params) + lora for beam in range(beams)]

    def _describe_media(self, row: RequestRow) -> str:
        if row.media is not None:
            return describe_pixels(row.media)
        if row.signal is not None:
            return f"samples={row.signal.shape[0]}"
        if row.media_bytes is None:
            return "no-media"
        if self.modality == "audio":
            import soundfile

            try:
                signal, _ = soundfile.read(io.BytesIO(row.media_bytes[0]), dtype="float32")
            except (RuntimeError, TypeError) as error:
                raise ValueError(f"input_media_bytes is not a decodable audio file ({error})") from None
            return f"samples={signal.shape[0]}"
        from PIL import Image

        try:
            image = Image.open(io.BytesIO(row.media_bytes[0])).convert("RGB")
        except (OSError, ValueError) as error:
            raise ValueError(f"input_media_bytes is not a decodable image ({type(error).__name__})") from None
        return describe_pixels(np.asarray(image))
