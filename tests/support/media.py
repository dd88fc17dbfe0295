"""Media made in the test: random pictures, PNG bytes and data URLs, and videos encoded with PyAV."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image


def random_image(seed: int, size=(56, 40)) -> Image.Image:
    """A non-square random RGB picture (so resizing, cropping and padding matter)."""
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))



def png_bytes(image: Image.Image) -> bytes:
    """`image` as PNG file bytes."""
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()



def data_url(data: bytes, mime: str = "image/png") -> str:
    """A `data:` URL holding `data`."""
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"



def first_available(*codecs: str) -> str:
    """The first of `codecs` this FFmpeg build has; the test is skipped if none."""
    import av  # PyAV on first use: image tests run where it is not installed (the GPU machine)

    for codec in codecs:
        if codec in av.codecs_available:
            return codec
    pytest.skip(f"none of the codecs {codecs} is in this FFmpeg build")



def encode_video(frames: np.ndarray, container: str, codec: str, rate: int = 5, pix_fmt: str = "yuv420p") -> bytes:
    """`frames` [T, H, W, 3] uint8 encoded into a `container` file, returned as bytes."""
    import av

    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format=container) as output:
        stream = output.add_stream(codec, rate=rate)
        stream.height, stream.width = frames.shape[1:3]
        stream.pix_fmt = pix_fmt
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                output.mux(packet)
        for packet in stream.encode():
            output.mux(packet)
    return buffer.getvalue()



def lossless_video(frames: np.ndarray) -> bytes:
    """`frames` in a Matroska file, FFV1 (lossless: decoded frames equal them)."""
    return encode_video(frames, "matroska", first_available("ffv1"), pix_fmt="bgr0")



def random_frames(count: int, seed: int = 0) -> np.ndarray:
    """`count` random 24x32 RGB frames."""
    return np.random.default_rng(seed).integers(0, 256, (count, 24, 32, 3), dtype=np.uint8)



def encode_mp4(seed: int, frames: int, size: int = 48) -> bytes:
    """An MP4 (MPEG-4 Part 2, 5 fps) of `frames` random `size`x`size` frames."""
    rng = np.random.default_rng(seed)
    images = np.stack([rng.integers(0, 256, (size, size, 3), dtype=np.uint8) for _ in range(frames)])
    return encode_video(images, "mp4", "mpeg4")
