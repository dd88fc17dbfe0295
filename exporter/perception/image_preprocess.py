"""Image preprocessing with NeMo training semantics (`neva_dataset.process_image`), JSON-serialisable.

Steps:
1. load as RGB (PIL `convert("RGB")`, as NeMo's loaders);
2. aspect handling by `data.image_aspect_ratio`: `pad` = centre on a square filled with `int(255 * mean)`,
   `resize` = plain bicubic resize to the crop size, anything else = none;
3. the tower's HF image processor: CLIP = bicubic shortest-edge resize + centre crop, SigLIP = bicubic resize
   to (S, S); then rescale by 1/255 and normalise with the tower's mean/std.
Step 3 gives the same numbers as transformers' CLIP / SigLIP image processors.
"""

from __future__ import annotations

import io
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

DEFAULT_MAX_IMAGE_PIXELS = 40_000_000
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
SIGLIP_MEAN = (0.5, 0.5, 0.5)
SIGLIP_STD = (0.5, 0.5, 0.5)
ASPECT_MODES = {
    "pad": "pad",
    "resize": "resize",
    "square": "none",
    "keep": "none",
    "none": "none",
    "": "none",
}

ImageInput = Image.Image | np.ndarray | str | os.PathLike | bytes


class ImageLoadError(ValueError):
    """An image could not be read or is not acceptable (too large, wrong array type)."""


def _size_dict(value: Any, tower_type: str) -> dict[str, int]:
    """An HF `size` / `crop_size` entry as a dict (`shortest_edge` or `height`+`width`)."""
    if isinstance(value, int):
        return {"shortest_edge": value} if tower_type == "clip" else {"height": value, "width": value}
    if "shortest_edge" in value:
        return {"shortest_edge": int(value["shortest_edge"])}
    return {"height": int(value["height"]), "width": int(value["width"])}


def _hw(value: Any) -> tuple[int, int]:
    if isinstance(value, Mapping):
        return int(value["height"]), int(value["width"])
    if isinstance(value, int):
        return value, value
    height, width = list(value)
    return int(height), int(width)


def _image_name(image: Any) -> str:
    return str(image) if isinstance(image, (str, os.PathLike)) else f"<{type(image).__name__}>"


class ImagePreprocessor:
    """Turns images into `[B, 3, S, S]` float32 pixel tensors for one vision tower."""

    def __init__(
        self,
        *,
        resize: Mapping[str, int],
        crop_size: Mapping[str, int] | None,
        image_mean: Sequence[float],
        image_std: Sequence[float],
        aspect_ratio: str = "none",
        squash_size: Sequence[int] | None = None,
        rescale_factor: float = 1 / 255,
        resample: int = Image.Resampling.BICUBIC,
        max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    ):
        if aspect_ratio not in ("pad", "resize", "none"):
            raise ValueError(f"aspect_ratio must be pad, resize or none, got {aspect_ratio!r}")
        if aspect_ratio == "resize" and squash_size is None:
            raise ValueError("aspect_ratio 'resize' needs squash_size (the crop size [height, width])")
        self.resize = dict(resize)
        self.crop_size = None if crop_size is None else dict(crop_size)
        self.image_mean = tuple(float(m) for m in image_mean)
        self.image_std = tuple(float(s) for s in image_std)
        self.aspect_ratio = aspect_ratio
        self.squash_size = None if squash_size is None else _hw(squash_size)
        self.rescale_factor = float(rescale_factor)
        self.resample = int(resample)
        self.max_image_pixels = int(max_image_pixels)
        self.output_size = _hw(self.crop_size) if self.crop_size else _hw(self.resize)
        if "shortest_edge" in self.resize and (
            self.crop_size is None or self.resize["shortest_edge"] < min(self.output_size)
        ):
            raise ValueError(f"shortest-edge resize {self.resize} needs a centre crop no larger than it")

    @classmethod
    def for_tower(
        cls,
        tower_type: str,
        image_size: int,
        *,
        aspect_ratio: str | None = None,
        processor_config: Mapping[str, Any] | None = None,
        crop_size: Sequence[int] | None = None,
        max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    ) -> ImagePreprocessor:
        """The preprocessing NeMo training used for a `clip` / `siglip` tower of `image_size` pixels.

        `processor_config` is the tower folder's HF `preprocessor_config.json` when there is one (NeMo trained
        with that processor); `aspect_ratio` is `data.image_aspect_ratio`; `crop_size` is
        `mm_cfg.vision_encoder.crop_size` (the target of the `resize` mode).
        """
        mode = ASPECT_MODES.get(str(aspect_ratio or "").lower())
        if mode is None:
            raise ValueError(
                f"unsupported data.image_aspect_ratio {aspect_ratio!r}; supported: pad, resize, square, keep"
            )
        config = dict(processor_config or {})
        clip = tower_type == "clip"
        resize = _size_dict(config.get("size", image_size), tower_type)
        crop = None
        if clip and config.get("do_center_crop", True):
            crop = _size_dict(config.get("crop_size", image_size), "siglip")
        preprocessor = cls(
            resize=resize,
            crop_size=crop,
            image_mean=config.get("image_mean", CLIP_MEAN if clip else SIGLIP_MEAN),
            image_std=config.get("image_std", CLIP_STD if clip else SIGLIP_STD),
            aspect_ratio=mode,
            squash_size=tuple(crop_size) if crop_size is not None else (image_size, image_size),
            rescale_factor=config.get("rescale_factor", 1 / 255),
            resample=config.get("resample", Image.Resampling.BICUBIC),
            max_image_pixels=max_image_pixels,
        )
        if preprocessor.output_size != (image_size, image_size):
            raise ValueError(
                f"the image processor gives {preprocessor.output_size} pixels but the vision tower takes "
                f"{image_size}x{image_size}; check the tower folder's preprocessor_config.json"
            )
        return preprocessor

    def to_spec(self) -> dict[str, Any]:
        """A JSON-serialisable description; `from_spec` rebuilds the same preprocessor."""
        return {
            "resize": self.resize,
            "crop_size": self.crop_size,
            "image_mean": list(self.image_mean),
            "image_std": list(self.image_std),
            "aspect_ratio": self.aspect_ratio,
            "squash_size": None if self.squash_size is None else list(self.squash_size),
            "rescale_factor": self.rescale_factor,
            "resample": self.resample,
            "max_image_pixels": self.max_image_pixels,
        }

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any], **overrides: Any) -> ImagePreprocessor:
        """Rebuilds a preprocessor from `to_spec()` output; `overrides` (e.g. max_image_pixels) win."""
        return cls(**{**dict(spec), **overrides})

    def load(self, image: ImageInput) -> Image.Image:
        """An RGB PIL image from a PIL image, a uint8 array ([H,W], [H,W,1|3|4]), a path or encoded bytes."""
        name = _image_name(image)
        if isinstance(image, np.ndarray):
            image = self._from_array(image)
        elif isinstance(image, (str, os.PathLike, bytes)):
            if isinstance(image, bytes) and not image:
                raise ImageLoadError("the image is empty (0 bytes); send an encoded image file")
            try:
                image = Image.open(io.BytesIO(image) if isinstance(image, bytes) else os.fspath(image))
            except UnidentifiedImageError:
                raise ImageLoadError(f"cannot read image {name}: not an image file of a known format") from None
            except (OSError, Image.DecompressionBombError) as error:
                raise ImageLoadError(f"cannot read image {name}: {error}") from None
        elif not isinstance(image, Image.Image):
            raise ImageLoadError(
                f"unsupported image input {type(image).__name__}; pass a PIL image, a uint8 array or a path"
            )
        width, height = image.size
        if not width or not height:
            raise ImageLoadError(f"image {name} has no pixels ({width}x{height}); send an image of at least 1x1")
        if width * height > self.max_image_pixels:
            raise ImageLoadError(
                f"image {name} has {width}x{height} = {width * height} pixels, over the limit of "
                f"{self.max_image_pixels} (option max_image_pixels); downscale it or raise max_image_pixels"
            )
        try:
            image.load()
            return image if image.mode == "RGB" else image.convert("RGB")
        except OSError as error:
            raise ImageLoadError(f"cannot decode image {name}: {error}") from None

    @staticmethod
    def _from_array(array: np.ndarray) -> Image.Image:
        if array.dtype != np.uint8:
            raise ImageLoadError(f"image arrays must be uint8 [H,W,3] (0..255), got dtype {array.dtype}")
        if array.size == 0:
            raise ImageLoadError(f"the image array is empty (shape {list(array.shape)}); send at least 1x1 pixels")
        if array.ndim == 3 and array.shape[-1] == 1:
            array = array[..., 0]
        if array.ndim == 2 or (array.ndim == 3 and array.shape[-1] in (3, 4)):
            return Image.fromarray(np.ascontiguousarray(array))
        raise ImageLoadError(f"image arrays must be [H,W], [H,W,3] or [H,W,4], got shape {array.shape}")

    def _expand_to_square(self, image: Image.Image) -> Image.Image:
        width, height = image.size
        if width == height:
            return image
        side = max(width, height)
        background = tuple(int(m * 255) for m in self.image_mean)
        square = Image.new(image.mode, (side, side), background)
        square.paste(image, ((side - width) // 2, (side - height) // 2))
        return square

    def _resized(self, image: Image.Image) -> Image.Image:
        width, height = image.size
        if "shortest_edge" in self.resize:
            short, long = sorted((width, height))
            edge = self.resize["shortest_edge"]
            scaled_long = int(edge * long / short)
            target = (edge, scaled_long) if width <= height else (scaled_long, edge)
        else:
            target = (self.resize["width"], self.resize["height"])
        return image.resize(target, resample=self.resample)

    def preprocess_one(self, image: ImageInput) -> torch.Tensor:
        """One image as a float32 `[3, S, S]` tensor."""
        image = self.load(image)
        if self.aspect_ratio == "pad":
            image = self._expand_to_square(image)
        elif self.aspect_ratio == "resize":
            height, width = self.squash_size
            image = image.resize((width, height), resample=self.resample)
        pixels = np.asarray(self._resized(image))
        if self.crop_size is not None:
            crop_h, crop_w = _hw(self.crop_size)
            top, left = (pixels.shape[0] - crop_h) // 2, (pixels.shape[1] - crop_w) // 2
            pixels = pixels[top : top + crop_h, left : left + crop_w]
        scaled = (pixels.astype(np.float64) * self.rescale_factor).astype(np.float32)
        mean = np.asarray(self.image_mean, dtype=np.float32)
        std = np.asarray(self.image_std, dtype=np.float32)
        return torch.from_numpy(np.ascontiguousarray(((scaled - mean) / std).transpose(2, 0, 1)))

    def __call__(self, images: ImageInput | Sequence[ImageInput]) -> torch.Tensor:
        """A batch `[B, 3, S, S]` from one image, a list of images, or a uint8 frame array `[T, H, W, 3]`."""
        if isinstance(images, np.ndarray) and images.ndim == 4:
            images = list(images)
        elif not isinstance(images, (list, tuple)):
            images = [images]
        if not images:
            raise ImageLoadError("no images given")
        return torch.stack([self.preprocess_one(image) for image in images])
