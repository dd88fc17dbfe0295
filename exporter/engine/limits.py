"""Engine limits fixed at export and checked on every request, with messages that say what to change."""

from __future__ import annotations

from dataclasses import asdict, dataclass


class LimitError(ValueError):
    """A request or an export setting is past one of the engine's limits."""


@dataclass(frozen=True)
class EngineLimits:
    """The sizes an engine was exported for (NeMo's export arguments of the same names; ``max_beam_width`` is
    TensorRT-LLM's, default 1 as there). ``vision_max_batch_size`` is the most media items (images, video frames,
    audio clips) one perception-encoder call takes; None: the model type's default (its ``encoder_batch``)."""

    max_input_len: int = 4096
    max_output_len: int = 256
    max_batch_size: int = 1
    max_multimodal_len: int = 3072
    vision_max_batch_size: int | None = None
    max_beam_width: int = 1

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if value is not None and int(value) < 1:
                raise LimitError(f"{name} must be at least 1, got {value}")
        if self.max_beam_width > self.max_batch_size:
            raise LimitError(
                f"max_beam_width={self.max_beam_width} is over max_batch_size={self.max_batch_size}: each beam takes "
                f"one of the max_batch_size KV-cache rows; raise max_batch_size to at least {self.max_beam_width} or "
                f"lower max_beam_width"
            )

    def check_export(self, features_per_item: int) -> None:
        """At export: the multimodal table must hold one media item (an image, a video, a second of audio) for every
        request of a full batch."""
        needed = self.max_batch_size * features_per_item
        if self.max_multimodal_len < needed:
            raise LimitError(
                f"max_multimodal_len={self.max_multimodal_len} is below max_batch_size × features per media item "
                f"= {self.max_batch_size} × {features_per_item} = {needed}; raise max_multimodal_len to at least "
                f"{needed} or lower max_batch_size"
            )

    def check_batch(self, batch_size: int) -> None:
        if batch_size > self.max_batch_size:
            raise LimitError(
                f"batch of {batch_size} requests is over max_batch_size={self.max_batch_size}; send fewer at once "
                f"or export with a larger max_batch_size"
            )

    def check_request(self, prompt_len: int, media_features: int, max_output_len: int, num_beams: int = 1) -> None:
        """Per request: prompt length (text + features), multimodal features, new tokens and beams."""
        if num_beams > self.max_beam_width:
            raise LimitError(
                f"num_beams={num_beams} is over the engine's max_beam_width={self.max_beam_width}; ask for fewer beams "
                f"or export with a larger max_beam_width"
            )
        if prompt_len > self.max_input_len:
            raise LimitError(
                f"the prompt is {prompt_len} tokens including {media_features} media features, over "
                f"max_input_len={self.max_input_len}; shorten the text or export with a larger max_input_len"
            )
        if media_features > self.max_multimodal_len:
            raise LimitError(
                f"the request's media give {media_features} features, over max_multimodal_len="
                f"{self.max_multimodal_len}; send less media (fewer images or frames, a shorter clip) or export with a "
                f"larger max_multimodal_len"
            )
        if max_output_len > self.max_output_len:
            raise LimitError(
                f"max_output_len={max_output_len} is over the engine's max_output_len={self.max_output_len}; "
                f"ask for fewer tokens or export with a larger max_output_len"
            )

    def to_dict(self) -> dict[str, int | None]:
        return asdict(self)
