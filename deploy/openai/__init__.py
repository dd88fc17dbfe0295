"""The OpenAI-compatible front: `create_app` (the FastAPI app over an exporter) and `OpenAIServer` (uvicorn in a thread).

Modules: `schema` (the request body), `translate` (body → pipeline request, answer → response objects), `errors`
(OpenAI error objects), `app` (routes, server-sent events, the body cap), `server` (the uvicorn runner).
"""

from __future__ import annotations

from deploy.openai.app import create_app
from deploy.openai.server import OpenAIServer

__all__ = ["OpenAIServer", "create_app"]
