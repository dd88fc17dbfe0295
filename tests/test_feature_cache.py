"""Encoder outputs reused across requests: the same media (by content) skips the encoder and answers the same; the
cache is a bounded LRU; different media never share an entry."""

from __future__ import annotations

import io
import threading
import time

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


# --- one encoding for media asked for at once ---------------------------------------------------------------------


def _in_thread(fn) -> tuple[threading.Thread, list]:
    """``fn`` started in a thread; the list gets its result or the exception it raised."""
    out: list = []

    def target():
        try:
            out.append(fn())
        except Exception as error:  # noqa: BLE001 - handed to the test
            out.append(error)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, out


def test_a_claimed_key_makes_other_threads_wait_for_its_block():
    cache, block = FeatureCache(), torch.ones(2, 3)
    assert cache.get_or_claim("k") is None  # this thread claims k
    waiter, got = _in_thread(lambda: cache.get_or_claim("k"))
    waiter.join(0.3)
    assert waiter.is_alive()  # waiting for this thread's block
    cache.put("k", block)
    waiter.join(5)
    assert torch.equal(got[0], block) and cache.stats()["hits"] == 1

    assert cache.get_or_claim("failed") is None
    waiter, got = _in_thread(lambda: (cache.get_or_claim("failed"), cache.get_or_claim("other")))
    waiter.join(0.3)
    assert waiter.is_alive()
    cache.release(["failed"])  # the encoding failed: the waiter claims the key and encodes it itself
    waiter.join(5)
    assert got == [(None, None)] and set(cache._claims) == {"failed", "other"}  # now the waiter's


def test_a_thread_holding_a_claim_never_waits():
    cache = FeatureCache()
    assert cache.get_or_claim("x") is None
    other, got = _in_thread(lambda: (cache.get_or_claim("y"), cache.get_or_claim("x")))
    other.join(5)  # it holds y, so it does not wait for x (this thread could be waiting for y)
    assert not other.is_alive() and got == [(None, None)]
    off = FeatureCache(max_entries=0)
    assert off.get_or_claim("x") is None and off.get_or_claim("x") is None and not off._claims


def test_requests_sent_together_about_one_image_encode_it_once(model, monkeypatch):
    exporter, calls = model
    data = (DEMO_IMAGES / "red_circle.png").read_bytes()
    slow = lambda items: (time.sleep(0.3), calls(items))[1]  # noqa: E731 - the others arrive meanwhile
    monkeypatch.setattr(exporter.engine.perception, "encode", slow)
    threads = [_in_thread(lambda question=question: ask(exporter, question, data))
               for question in (SHAPE_Q, COLOR_Q, SHAPE_Q, COLOR_Q)]
    for thread, _ in threads:
        thread.join(60)
    assert [out for _, out in threads] == [["circle"], ["red"], ["circle"], ["red"]]
    assert calls.items == [1]


def test_a_failed_encoding_wakes_the_requests_waiting_for_it(model, monkeypatch):
    exporter, calls = model
    data = (DEMO_IMAGES / "blue_triangle.png").read_bytes()
    failures = [RuntimeError("the encoder failed")]

    def flaky(items):
        time.sleep(0.3)
        if failures:
            raise failures.pop()
        return calls(items)

    monkeypatch.setattr(exporter.engine.perception, "encode", flaky)
    first, first_out = _in_thread(lambda: ask(exporter, SHAPE_Q, data))
    time.sleep(0.1)
    second, second_out = _in_thread(lambda: ask(exporter, SHAPE_Q, data))
    first.join(60)
    second.join(60)
    assert isinstance(first_out[0], RuntimeError) and second_out == ["triangle"] and calls.items == [1]
