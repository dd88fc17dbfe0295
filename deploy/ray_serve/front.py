"""`Front`: the Ray Serve application's HTTP ingress. It serves the OpenAI-compatible API (`deploy.openai`'s app over
a `RemoteEngine`) and Triton's HTTP routes (`triton_routes`), and sends each request to the engine replicas.

The front parses bodies and fetches media; the replicas run the model. Readiness routes (`/v1/health/ready`,
`/v1/health`, `/v2/health/ready`, `/v2/models/<name>/ready` and `<name>_stream`'s) say 200 only while an engine
replica answers.
"""

from __future__ import annotations

from typing import Any

import anyio
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from deploy.openai import create_app
from deploy.openai.errors import APIError
from deploy.ray_serve.remote import RemoteEngine
from deploy.ray_serve.triton_routes import add_triton_routes, triton_error
from deploy.triton_errors import UNAVAILABLE
from exporter.media_safety import MediaPolicy
from wire import stream_model_name

READY_TIMEOUT_S = 5.0


class ReadyRoutes:
    """ASGI middleware answering the readiness routes from the engine replicas: 200 while one answers within
    `READY_TIMEOUT_S`, else 503 (OpenAI's error object on `/v1/...`, Triton's on `/v2/...`)."""

    def __init__(self, app: Any, remote: RemoteEngine, model_name: str):
        self.app, self.remote = app, remote
        self.openai_paths = {"/v1/health/ready", "/v1/health"}
        self.triton_paths = {"/v2/health/ready", f"/v2/models/{model_name}/ready",
                             f"/v2/models/{stream_model_name(model_name)}/ready"}

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path") if scope["type"] == "http" else None
        if path not in self.openai_paths and path not in self.triton_paths:
            return await self.app(scope, receive, send)
        if await anyio.to_thread.run_sync(self.remote.ready, READY_TIMEOUT_S):
            response = JSONResponse({"status": "ready"})
        elif path in self.openai_paths:
            response = APIError(UNAVAILABLE, "no model replica is ready (starting, or restarting after a failure); "
                                             "retry shortly", code="not_ready").response()
        else:
            response = triton_error(UNAVAILABLE, "no model replica is ready (starting, or restarting after a "
                                                 "failure); retry shortly")
        return await response(scope, receive, send)


def build_front_app(remote: RemoteEngine, model_name: str, media_policy: MediaPolicy | None = None,
                    max_request_bytes: int | None = None) -> FastAPI:
    """The front's app: the OpenAI-compatible API, Triton's HTTP routes and the readiness routes over `remote`."""
    app = create_app(remote, model_name, media_policy, max_request_bytes)
    add_triton_routes(app, remote, model_name)

    @app.get("/v2/health/live")
    async def live() -> dict[str, str]:
        return {"status": "live"}

    app.add_middleware(ReadyRoutes, remote=remote, model_name=model_name)
    return app


class Front:
    """The ingress deployment's class (wrapped by `serve.ingress()`): asks an engine replica for the model's facts,
    then serves `build_front_app` over the replicas of `engine` (a deployment handle)."""

    async def __init__(self, engine: Any, model_name: str, media_policy: MediaPolicy | None = None,
                       max_request_bytes: int | None = None, retries: int = 1):
        facts = await engine.facts.remote()
        self._app = build_front_app(RemoteEngine(engine, facts, retries), model_name, media_policy,
                                    max_request_bytes)

    def __serve_build_asgi_app__(self) -> FastAPI:
        return self._app
