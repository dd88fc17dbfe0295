"""Serving on Ray Serve: replicas of one exported model behind one HTTP endpoint, on one machine or a cluster.

Modules: `application` (the bound application: `build_application`, `ScaleOptions`), `front` (the HTTP ingress:
the OpenAI-compatible API, Triton's HTTP routes, readiness), `replica` (`EngineReplica`: the engine with its
in-flight scheduler), `remote` (the replicas behind a deployment handle, retrying a request whose replica died),
`triton_routes`, `transport` (what crosses between the front and the replicas). Ray is the `[ray]` extra: only
this package imports it.
"""

from __future__ import annotations

from deploy.ray_serve.application import ENGINE_DEPLOYMENT, FRONT_DEPLOYMENT, ScaleOptions, build_application

__all__ = ["ENGINE_DEPLOYMENT", "FRONT_DEPLOYMENT", "ScaleOptions", "build_application"]
