"""Encoder outputs reused across requests: the same media (by content) skips the encoder and answers the same; the
cache is a bounded LRU; different media never share an entry."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from exporter.llm.generate import SamplingParams
from exporter.runtime import Request
from exporter.runtime.feature_cache import FeatureCache, media_key
from support.demo import (
    COLOR_Q,
    DEMO_IMAGES,
    SHAPE_Q,
    load_demo_builder,
)


class EncoderCalls:
    """Wraps the perception's `encode` and records how many items each call encoded."""

    def __init__(self, perception):
        self.items: list[int] = []
        self._encode = perception.encode

    def __call__(self, items):
        self.items.append(len(items))
        return self._encode(items)


@pytest.fixture
def model(demo_exporter, monkeypatch):
    """(exporter with an empty cache of its own, encoder call log)."""
    monkeypatch.setattr(demo_exporter.pipeline, "feature_cache", FeatureCache())
    calls = EncoderCalls(demo_exporter.engine.perception)
    monkeypatch.setattr(demo_exporter.engine.perception, "encode", calls)
    return demo_exporter, calls


def png(image: Image.Image | np.ndarray) -> bytes:
    buffer = io.BytesIO()
    (image if isinstance(image, Image.Image) else Image.fromarray(image)).save(buffer, "PNG")
    return buffer.getvalue()


def ask(exporter, question: str, media) -> str:
    return exporter.forward(question, media, max_output_len=4)[0][0]


def test_same_media_skips_the_encoder_and_answers_the_same(model):
    exporter, calls = model
    cache = exporter.pipeline.feature_cache
    path = DEMO_IMAGES / "red_circle.png"
    data = path.read_bytes()
    assert ask(exporter, SHAPE_Q, data) == "circle"
    assert calls.items == [1] and cache.stats() == {"entries": 1, "bytes": cache.nbytes, "hits": 0, "misses": 1}
    assert ask(exporter, COLOR_Q, data) == "red"
    assert ask(exporter, SHAPE_Q, str(path)) == "circle"  # a path is keyed by its file's bytes: the same entry
    assert calls.items == [1] and cache.stats()["hits"] == 2 and len(cache) == 1
    pixels = np.asarray(Image.open(path).convert("RGB"))
    assert ask(exporter, SHAPE_Q, pixels) == "circle"  # decoded pixels are keyed apart from the file
    assert ask(exporter, COLOR_Q, pixels.copy()) == "red"
    assert calls.items == [1, 1] and len(cache) == 2 and cache.stats()["hits"] == 3


def test_cached_features_are_the_encoder_output(model):
    exporter, calls = model
    data = (DEMO_IMAGES / "green_square.png").read_bytes()
    perception = exporter.engine.perception
    fresh = calls._encode(perception.load_media(data))[0]
    first = exporter.generate([Request(SHAPE_Q, data, SamplingParams(max_output_len=4))])[0]
    cached = exporter.pipeline.feature_cache.get(media_key(data))
    assert torch.equal(cached, fresh)
    again = exporter.generate([Request(SHAPE_Q, data, SamplingParams(max_output_len=4))])[0]
    assert calls.items == [1] and again.token_ids == first.token_ids and again.texts == ["square"]


def test_the_same_media_twice_in_one_batch_is_encoded_once(model):
    exporter, calls = model
    data = (DEMO_IMAGES / "blue_triangle.png").read_bytes()
    answers = exporter.forward([SHAPE_Q, COLOR_Q, SHAPE_Q], [data, data, str(DEMO_IMAGES / "red_circle.png")],
                               max_output_len=4)
    assert answers == [["triangle"], ["blue"], ["circle"]]
    assert calls.items == [2]  # blue triangle once, red circle once


def test_the_cache_is_a_bounded_lru(model, monkeypatch):
    exporter, calls = model
    a, b, c, d = ((DEMO_IMAGES / f"{name}.png").read_bytes()
                  for name in ("red_circle", "blue_triangle", "green_square", "yellow_circle"))
    ask(exporter, SHAPE_Q, a)
    block_bytes = exporter.pipeline.feature_cache.nbytes  # one image's features
    for cache in (FeatureCache(max_entries=2), FeatureCache(max_bytes=2 * block_bytes + block_bytes // 2)):
        monkeypatch.setattr(exporter.pipeline, "feature_cache", cache)
        calls.items.clear()
        for data in (a, b, c):
            ask(exporter, SHAPE_Q, data)
        assert len(cache) == 2 and cache.nbytes == 2 * block_bytes and calls.items == [1, 1, 1]
        assert ask(exporter, COLOR_Q, b) == "blue" and calls.items == [1, 1, 1]  # b is now the most recent
        assert ask(exporter, COLOR_Q, d) == "yellow" and calls.items == [1, 1, 1, 1]  # evicts c, not b
        assert ask(exporter, SHAPE_Q, b) == "triangle" and calls.items == [1, 1, 1, 1]
        assert ask(exporter, SHAPE_Q, c) == "square" and calls.items == [1, 1, 1, 1, 1]
        assert ask(exporter, SHAPE_Q, a) == "circle" and calls.items == [1, 1, 1, 1, 1, 1]  # evicted long ago
        assert len(cache) == 2


def test_different_images_do_not_collide(model):
    exporter, calls = model
    drawn = load_demo_builder().sample_examples(np.random.default_rng(31), 7)
    images = [png(image) for image, _, _ in drawn]
    pixels = np.asarray(drawn[0][0]).copy()
    pixels[0, 0, 0] ^= 1  # one bit of one pixel
    images.append(png(pixels))
    cache = exporter.pipeline.feature_cache
    for question in (SHAPE_Q, COLOR_Q):
        cached = exporter.forward([question] * len(images), images, max_output_len=4)
        exporter.pipeline.feature_cache = FeatureCache(max_entries=0)  # caching off
        alone = [exporter.forward(question, image, max_output_len=4)[0] for image in images]
        exporter.pipeline.feature_cache = cache
        assert cached == alone
    assert len(cache) == len(images) and len({media_key(image) for image in images}) == len(images)
    assert calls.items[0] == len(images) and cache.stats()["hits"] == len(images)
