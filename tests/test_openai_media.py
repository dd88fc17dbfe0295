"""The OpenAI front under slow media hosts and bad media: one deadline per URL, a front that keeps answering,
short errors without tracebacks or server paths, and the body and text caps."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from deploy.openai import create_app
from deploy.openai.app import default_max_request_bytes
from deploy.openai.translate import MAX_TEXT_BYTES
from exporter import TensorRTMMExporter
from exporter.media_safety import MediaPolicy
from support.media import data_url, png_bytes, random_image
from support.media_host import MediaHost
from support.openai_front import assert_error_object, image_message, serving
from support.servers import get, post
from support.vlm import tiny_neva

SLOW_REQUESTS = 40
DEADLINE_S = 3.0


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Neva exported in-process, and a PNG it can take."""
    return tiny_neva(tmp_path_factory.mktemp("tiny"), max_output_len=4), png_bytes(random_image(1))


def create_app_for(exporter: TensorRTMMExporter, policy: MediaPolicy):
    return create_app(exporter, "tiny", policy)


def _ask(url: str) -> dict:
    return {"model": "tiny", "max_tokens": 2, "messages": image_message("What is this?", url)}


def test_slow_hosts_do_not_stall_the_front(tiny):
    """40 requests whose image host trickles its headers one byte a second: each ends with a 400 naming the
    deadline within deadline + 1 s, while the model list and health answer in under 1 s throughout."""
    exporter, png = tiny
    policy = MediaPolicy(timeout_s=DEADLINE_S, allow_private_networks=True, max_fetches_per_host=SLOW_REQUESTS)
    with MediaHost(trickle_s=1.0) as host, serving(create_app_for(exporter, policy)) as url:
        answers: list[tuple[float, int, dict]] = []

        def slow_request() -> None:
            started = time.monotonic()
            status, body = post(url + "/chat/completions", _ask(host.url + "/trickle-headers"))
            answers.append((time.monotonic() - started, status, body))

        threads = [threading.Thread(target=slow_request) for _ in range(SLOW_REQUESTS)]
        for thread in threads:
            thread.start()
        latencies = []
        while any(thread.is_alive() for thread in threads):
            for route in ("/models", "/health/ready"):
                started = time.monotonic()
                assert get(url + route)[0] == 200
                latencies.append(time.monotonic() - started)
            time.sleep(0.1)
        for thread in threads:
            thread.join()
        assert host.peak == SLOW_REQUESTS  # every fetch was held by the slow host at once
        assert len(latencies) >= 10 and max(latencies) < 1.0, latencies
        assert len(answers) == SLOW_REQUESTS
        for elapsed, status, body in answers:
            assert_error_object(status, body, 400, f"longer than {DEADLINE_S:g} s", "media_timeout_s",
                                "waiting for the response headers")
            assert body["error"]["code"] == "invalid_media" and body["error"]["param"] == "messages[0].content"
            assert DEADLINE_S - 0.1 < elapsed < DEADLINE_S + 1.0, elapsed
        status, body = post(url + "/chat/completions", _ask(data_url(png)))
        assert status == 200 and body["usage"]["completion_tokens"] >= 1, body


def test_fetches_from_one_host_are_bounded(tiny):
    """Over `max_fetches_per_host`, fetches wait for a slot, and the wait counts in their own deadline."""
    exporter, _ = tiny
    policy = MediaPolicy(timeout_s=1.5, allow_private_networks=True, max_fetches_per_host=2)
    with MediaHost(trickle_s=0.5) as host, serving(create_app_for(exporter, policy)) as url:
        answers = []

        def slow_request() -> None:
            started = time.monotonic()
            answers.append((time.monotonic() - started, *post(url + "/chat/completions",
                                                              _ask(host.url + "/trickle-headers"))))

        threads = [threading.Thread(target=slow_request) for _ in range(4)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 1.2
        while host.held < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.1)
        assert host.held == 2  # the other two wait for a slot
        for thread in threads:
            thread.join()
    for elapsed, status, body in answers:
        assert_error_object(status, body, 400, "longer than 1.5 s")
        assert elapsed < 1.5 + 1.0


def test_empty_media_and_redirects_name_their_reason(tiny):
    exporter, png = tiny
    policy = MediaPolicy(allow_private_networks=True)
    with MediaHost({"image.png": png}) as host, serving(create_app_for(exporter, policy)) as url:
        cases = {
            "data:image/png;base64,": "is empty (0 bytes)",
            host.url + "/redirect?to=file:///etc/passwd": "redirects to a file: URL",
            host.url + "/redirect": "redirected more than 3 times",
            host.url + "/missing": "HTTP 404",
        }
        for source, reason in cases.items():
            assert_error_object(*post(url + "/chat/completions", _ask(source)), 400, reason)
        assert post(url + "/chat/completions", _ask(host.url + "/redirect?to=/image.png"))[0] == 200


def test_a_server_fault_is_one_line_without_paths_and_logged_in_full(tiny, monkeypatch, caplog):
    exporter, png = tiny

    def failing(requests):
        raise OSError(2, "No such file or directory", "/srv/private/engine/llm_engine/model.safetensors")

    monkeypatch.setattr(exporter, "generate", failing)
    with serving(create_app_for(exporter, MediaPolicy())) as url, caplog.at_level(logging.ERROR):
        status, body = post(url + "/chat/completions", _ask(data_url(png)))
    assert_error_object(status, body, 500, "the model failed", "No such file", "model.safetensors")
    message = body["error"]["message"]
    assert "/srv/" not in message and "Traceback" not in message and "\n" not in message
    logged = [record for record in caplog.records if record.exc_info]
    assert logged and "/srv/private" in str(logged[0].exc_info[1])


def test_body_cap_follows_the_media_caps_and_text_is_capped(tiny):
    exporter, png = tiny
    policy = MediaPolicy(max_items=1, max_bytes=len(png))
    cap = default_max_request_bytes(policy)
    assert cap == len(png) * 4 // 3 + MAX_TEXT_BYTES + 65536
    assert default_max_request_bytes(MediaPolicy()) < 32 * 2**20 * 4 // 3 + 2 * 2**20  # the defaults: ~44 MiB
    with serving(create_app_for(exporter, policy)) as url:
        most = _ask(data_url(png))
        most["messages"][0]["content"].append({"type": "text", "text": "x" * (MAX_TEXT_BYTES - 100)})
        status, body = post(url + "/chat/completions", most)  # under both caps: the engine's prompt limit answers
        assert_error_object(status, body, 400, "max_input_len")
        most["messages"][0]["content"][-1]["text"] += "x" * 200
        assert_error_object(*post(url + "/chat/completions", most), 413, "bytes of text", str(MAX_TEXT_BYTES))
        most["messages"][0]["content"][-1]["text"] += "x" * 70_000
        assert_error_object(*post(url + "/chat/completions", most), 413, "openai_max_request_bytes")


def test_media_of_one_request_are_capped_together(tiny):
    exporter, png = tiny
    policy = MediaPolicy(max_items=2, max_bytes=len(png), max_request_bytes=len(png) + 1)
    with serving(create_app_for(exporter, policy)) as url:
        two = _ask(data_url(png))
        two["messages"][0]["content"].append({"type": "image_url", "image_url": {"url": data_url(png)}})
        assert_error_object(*post(url + "/chat/completions", two), 413, "media_max_request_bytes",
                            str(2 * len(png)))
