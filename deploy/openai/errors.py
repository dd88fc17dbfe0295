"""OpenAI error objects: `APIError` (an HTTP status and a message) and the mapping from the exceptions a request raises."""

from __future__ import annotations

import logging
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
    """The API error for an exception raised while fetching media or answering a request."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, MediaTooLargeError):
        return APIError(413, str(error), code="media_too_large")
    if isinstance(error, MediaError):
        return APIError(400, str(error), code="invalid_media")
    if isinstance(error, ValueError):  # the pipeline's input errors: limits, layout, undecodable media, parameters
        return APIError(400, f"{type(error).__name__}: {error}", code="invalid_request")
    LOGGER.error("the model failed a request", exc_info=error)
    return APIError(500, f"the model failed: {type(error).__name__}: {error}", code="internal_error")
