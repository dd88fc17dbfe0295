"""The OpenAI front in tests: an app served by uvicorn on loopback, the `openai` client on it, chat messages with an
image, and the check of OpenAI's error object."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import openai

from deploy.openai import OpenAIServer
from support.demo import MODEL
from support.media import data_url
from support.ports import free_port


@contextlib.contextmanager
def serving(app) -> Iterator[str]:
    """`app` served by uvicorn on a free loopback port; yields its base URL (`http://127.0.0.1:N/v1`)."""
    server = OpenAIServer(app, host="127.0.0.1", port=free_port())
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


def client(url: str) -> openai.OpenAI:
    """The `openai` client on base URL `url` (no retries)."""
    return openai.OpenAI(base_url=url, api_key="unused", timeout=60, max_retries=0)


def image_message(question: str, url: str) -> list[dict]:
    """One user message: the image at `url` (a data URL or an http URL), then `question`."""
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": question}]}]


def chat(url: str, question: str, image: bytes, model: str = MODEL, **params):
    """A chat completion of `question` about `image` (PNG bytes, sent as a data URL) from the front at `url`."""
    return client(url).chat.completions.create(model=model, messages=image_message(question, data_url(image)),
                                               **params)


def assert_error_object(status: int, body: dict, expected_status: int, *words: str) -> None:
    """`body` is OpenAI's error object with `expected_status`, its message naming each of `words`."""
    assert status == expected_status, body
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["type"] == ("server_error" if expected_status >= 500 else "invalid_request_error")
    for word in words:
        assert word in body["error"]["message"], body
