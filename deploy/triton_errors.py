"""The one-line error a client sees for a failed request, with its status, and how it crosses to Triton.

A failed request reaches the client as one line naming the problem: `400` for bad input (a `ValueError`, such as
the wire format's, the engine's limits and media errors, or a feature not supported), `503` while the server
stops, `500` for anything else. PyTriton sends a failed request's exception to Triton's Python backend as its
formatted traceback; the backend model `deploy/triton_stub_model.py` finds the marker line written here and
answers the message alone with the status's Triton error code (HTTP 400/500/503, gRPC INVALID_ARGUMENT /
INTERNAL / UNAVAILABLE). The traceback stays in the server log.

Standard library only: this file is also copied next to the backend model, into Triton's model repository.
"""

from __future__ import annotations

import re

BAD_REQUEST = 400
INTERNAL = 500
UNAVAILABLE = 503

TRITON_CODES = {BAD_REQUEST: "INVALID_ARG", INTERNAL: "INTERNAL", UNAVAILABLE: "UNAVAILABLE"}
"""Client status -> the `TritonError` code that Triton maps to that HTTP status and gRPC code."""

UNKNOWN_FAILURE = "internal server error; the server log has the details"
INPUT_CAPS_FILE = "input_caps.json"
"""Next to the backend model: input name -> the most bytes that input of one request may hold."""
MAX_MESSAGE_CHARS = 400

_MARKER = "nemo-mm-deploy status="
_MARKER_LINE = re.compile(re.escape(_MARKER) + r"(\d{3}): ([^\n]*)")
_SERVER_PATH = re.compile(r"(?<![\w:/.~-])/(?:[^\s/'\"]+/)+[^\s/'\":,;)\]]*")


class RequestFailed(Exception):
    """A request's failure as its client is told it: a status and a one-line message."""

    def __init__(self, status: int, message: str):
        self.status = status
        self.message = message
        super().__init__(f"{_MARKER}{status}: {message}")


def one_line(text: str) -> str:
    """`text` on one line, server paths replaced by `<path>`, cut at MAX_MESSAGE_CHARS."""
    flat = " ".join(_SERVER_PATH.sub("<path>", text).split())
    return flat if len(flat) <= MAX_MESSAGE_CHARS else flat[: MAX_MESSAGE_CHARS - 3] + "..."


def client_failure(error: BaseException, stopping: bool = False) -> RequestFailed:
    """What the client of a request that raised `error` is told (`stopping`: the server is shutting down)."""
    if isinstance(error, RequestFailed):
        return error
    described = one_line(f"{type(error).__name__}: {error}")
    if stopping:
        return RequestFailed(UNAVAILABLE, f"the server is stopping ({described}); retry on a running server")
    if isinstance(error, (ValueError, NotImplementedError)):
        return RequestFailed(BAD_REQUEST, described)
    return RequestFailed(INTERNAL, f"internal server error: {described}")


def parse_failure(text: str) -> tuple[int, str]:
    """The status and message of the last failure marked in `text`; (500, a generic message) when none is."""
    found = _MARKER_LINE.findall(text)
    if not found:
        return INTERNAL, UNKNOWN_FAILURE
    status, message = found[-1]
    status = int(status)
    return (status if status in TRITON_CODES else INTERNAL), message
