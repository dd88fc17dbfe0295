"""The Ray Serve application of one exported model: a `Front` ingress deployment in front of an `EngineReplica`
deployment, with the replicas' count (or Ray Serve's autoscaling) and resources."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deploy.ray_serve.front import Front
from deploy.ray_serve.replica import EngineReplica
from exporter.engine import read_manifest

ENGINE_DEPLOYMENT = "Engine"
FRONT_DEPLOYMENT = "Front"
HEALTH_CHECK_PERIOD_S = 5.0
HEALTH_CHECK_TIMEOUT_S = 60.0  # a busy replica still answers health checks (its work runs in threads)


@dataclass(frozen=True)
class ScaleOptions:
    """How the model is spread over the cluster.

    `num_replicas` replicas, or Ray Serve's `autoscaling_config` (`min_replicas`, `max_replicas`,
    `target_ongoing_requests`, ...) passed through as it is. Each replica takes `num_cpus_per_replica` CPUs (also
    its torch threads) and `num_gpus_per_replica` GPUs (then it runs on CUDA), and at most `max_ongoing_requests`
    requests at once (default: twice the engine's `max_batch_size`; more wait in the front). A request whose
    replica dies before any of its answer was sent is retried on another up to `retries` times.
    """

    num_replicas: int = 1
    autoscaling_config: dict[str, Any] | None = None
    num_cpus_per_replica: float = 1.0
    num_gpus_per_replica: float = 0.0
    max_ongoing_requests: int | None = None
    front_replicas: int = 1
    front_max_ongoing_requests: int = 256
    retries: int = 1

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError(f"num_replicas must be at least 1, got {self.num_replicas}")
        if self.num_cpus_per_replica < 0 or self.num_gpus_per_replica < 0:
            raise ValueError("num_cpus_per_replica and num_gpus_per_replica cannot be negative")
        if self.max_ongoing_requests is not None and self.max_ongoing_requests < 1:
            raise ValueError(f"max_ongoing_requests must be at least 1, got {self.max_ongoing_requests}")
        if self.front_replicas < 1 or self.front_max_ongoing_requests < 1 or self.retries < 0:
            raise ValueError("front_replicas and front_max_ongoing_requests must be at least 1, retries at least 0")


def build_application(model_dir: str, model_name: str, scale: ScaleOptions = ScaleOptions(),
                      engine_options: dict[str, Any] | None = None, max_request_bytes: int | None = None) -> Any:
    """The bound Ray Serve application serving the engine in `model_dir` as `model_name`. The engine directory
    must be at `model_dir` on every node that runs a replica. `engine_options` are `TensorRTMMExporter`'s keyword
    arguments (modality, media policy, KV cache, ...; the front applies the media policy too); the device defaults
    to CUDA when the replicas get GPUs, else the CPU."""
    from ray import serve

    options = dict(engine_options or {})
    options.setdefault("device", "cuda" if scale.num_gpus_per_replica > 0 else "cpu")
    if options["device"] == "cuda" and scale.num_gpus_per_replica <= 0:
        raise ValueError("CUDA replicas need GPUs: give num_gpus_per_replica (Ray hands each replica its GPUs)")
    max_batch_size = int(read_manifest(model_dir)["limits"]["max_batch_size"])
    ongoing = scale.max_ongoing_requests or 2 * max_batch_size
    replicas: dict[str, Any] = {"autoscaling_config": scale.autoscaling_config} if scale.autoscaling_config \
        else {"num_replicas": scale.num_replicas}
    actor_options = {"num_cpus": scale.num_cpus_per_replica, "num_gpus": scale.num_gpus_per_replica}
    engine = serve.deployment(EngineReplica, name=ENGINE_DEPLOYMENT).options(
        ray_actor_options=actor_options, max_ongoing_requests=ongoing, health_check_period_s=HEALTH_CHECK_PERIOD_S,
        health_check_timeout_s=HEALTH_CHECK_TIMEOUT_S, **replicas,
    ).bind(str(model_dir), max(1, int(scale.num_cpus_per_replica)), options)
    front = serve.deployment(serve.ingress()(Front), name=FRONT_DEPLOYMENT).options(
        num_replicas=scale.front_replicas, max_ongoing_requests=scale.front_max_ongoing_requests,  # also its threads
        ray_actor_options={"num_cpus": 0},  # the front waits on the replicas: it takes no CPU from them
    )
    return front.bind(engine, model_name, options.get("media_policy"), max_request_bytes, scale.retries)
