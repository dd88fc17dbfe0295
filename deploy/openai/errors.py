"""OpenAI error objects: `APIError` (an HTTP status and a message) and the mapping from what a request raises."""

from __future__ import annotations

import logging
import re
from typing import Any

from fastapi.responses import JSONResponse

from exporter.media_safety import MediaError, MediaTooLargeError

LOGGER = logging.getLogger(__name__)


class APIError(Exception):
    """An error answered as an OpenAI error object with an HTTP status."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ("server_error" if status >= 500 else "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def api_error(error: Exception) -> APIError:
    """The API error for an exception raised while fetching media or answering a request: one short line naming
    the problem, without the server's paths; the traceback of a server fault goes to the log."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, MediaTooLargeError):
        return APIError(413, one_line(error), code="media_too_large")
    if isinstance(error, MediaError):
        return APIError(400, one_line(error), code="invalid_media")
    if isinstance(error, ValueError):  # the pipeline's input errors: limits, layout, undecodable media, parameters
        return APIError(400, f"{type(error).__name__}: {one_line(error)}", code="invalid_request")
    LOGGER.error("the model failed a request", exc_info=error)
    return APIError(500, f"the model failed: {type(error).__name__}: {one_line(error)}", code="internal_error")


def validation_error(errors: list[dict[str, Any]]) -> APIError:
    """The API error for the first of pydantic's validation errors of a request body (400 for a body that is not
    JSON, else 422 naming the field)."""
    first = errors[0]
    if first.get("type") == "json_invalid":
        reason = (first.get("ctx") or {}).get("error", "invalid JSON")
        return APIError(400, f"the request body is not valid JSON ({reason}); send a JSON object", code="invalid_json")
    where = ".".join(str(part) for part in first.get("loc", ()))
    return APIError(422, f"{where or 'body'}: {first.get('msg', 'invalid')}", param=where or None,
                    code="invalid_parameter")


_DIRECTORIES = re.compile(r"(?<![\w:/.])/(?:[^\s/'\"]+/)+")  # "/srv/app/x.py" but not the path of a URL


def one_line(error: Exception, limit: int = 500) -> str:
    """The error's message as one line of at most `limit` characters, absolute paths cut to their file names."""
    text = " ".join(str(error).split())
    text = _DIRECTORIES.sub("", text)
    return text if len(text) <= limit else text[:limit - 3] + "..."
