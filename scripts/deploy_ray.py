#!/usr/bin/env python
"""Serve an exported model (or export a .nemo first) as a Ray Serve application: replicas of the engine, each with
its own in-flight scheduler on its GPUs or CPUs, behind one HTTP endpoint (--host, --port) with the
OpenAI-compatible API, Triton's HTTP routes for NeMo's clients and readiness routes.

The export, model and media flags (and --config) are deploy_triton.py's; --model_id names the model (default:
--triton_model_name, else nemo-model). Without --address a local Ray cluster is started and stopped on exit;
with --address (a cluster started by `ray start --head`) the application is deployed onto it and deleted on
exit. The engine directory (-tmr) must be at the same path on every node that runs a replica.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path

import deploy_triton as triton_script  # this folder: the export, model and media flags are deploy_triton.py's

from deploy.ray_serve import ScaleOptions, build_application  # imports Ray only when an application is built
from deploy.startup import DeployError, check_model_repository, check_port_free

LOGGER = logging.getLogger("deploy_ray")
DEFAULT_MODEL_ID = "nemo-model"

# (flag, type, default, help); NeMo's Ray scripts' flags first
RAY_OPTIONS: tuple[tuple[str, type, object, str], ...] = (
    ("--model_id", str, None, "name clients query the model by (default: --triton_model_name, else nemo-model)"),
    ("--host", str, "0.0.0.0", "address the HTTP endpoint listens on"),
    ("--port", int, 1024, "port of the HTTP endpoint"),
    ("--num_replicas", int, 1, "model replicas (fixed; see --min_replicas/--max_replicas to autoscale)"),
    ("--num_cpus", int, None, "CPUs of the local Ray cluster (default: all)"),
    ("--num_gpus", int, None, "GPUs of the local Ray cluster (default: all)"),
    ("--num_cpus_per_replica", float, 1.0, "CPUs of each replica (also its torch threads)"),
    ("--num_gpus_per_replica", float, None, "GPUs of each replica (default: 1 with --device cuda, else 0)"),
    ("--cuda_visible_devices", str, None, "comma-separated GPUs the local Ray cluster may use"),
    ("--address", str, None, "address of a running Ray cluster to deploy onto (head:6379, or auto)"),
    ("--min_replicas", int, None, "autoscaling: fewest replicas"),
    ("--max_replicas", int, None, "autoscaling: most replicas"),
    ("--target_ongoing_requests", float, None, "autoscaling: ongoing requests per replica Ray Serve aims at"),
    ("--autoscaling_config", str, None,
     "autoscaling: Ray Serve's autoscaling_config as JSON (the three flags above override its fields)"),
    ("--max_ongoing_requests", int, None,
     "requests one replica takes at once (default: twice the engine's max_batch_size); more wait in the front"),
    ("--front_replicas", int, 1, "replicas of the HTTP front (it parses requests and fetches media)"),
    ("--request_retries", int, 1,
     "times a request is sent again when its replica dies before any of its answer was sent"),
)
TRITON_SERVER_FLAGS = ("triton_port", "grpc_port", "metrics_port", "openai_port", "openai_address",
                       "triton_http_address", "streaming", "triton_model_version")
"""deploy_triton.py's flags for its own servers, refused here: this script serves on --host and --port."""


def build_parser() -> argparse.ArgumentParser:
    """The full parser: deploy_triton.py's flags, with Ray's added (Ray's --num_gpus replaces its tensor parallel
    size, which the engine keeps at 1)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     parents=[triton_script.build_parser()], conflict_handler="resolve")
    _add_ray_options(parser)
    return parser


def _add_ray_options(parser: argparse.ArgumentParser) -> None:
    for flag, kind, default, text in RAY_OPTIONS:
        shown = "" if default is None else f" (default: {default})"
        parser.add_argument(flag, type=kind, default=default, help=text + shown)
    parser.add_argument("--include_dashboard", action="store_true", help="start the Ray dashboard (local cluster)")


def parse(argv: list[str]) -> tuple[argparse.Namespace, argparse.Namespace]:
    """(Ray's settings, deploy_triton.py's settings) from the command line; ValueError for a bad combination."""
    given = build_parser().parse_args(argv)  # -h and every flag's type checked here
    ray_parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    _add_ray_options(ray_parser)
    ray_args, rest = ray_parser.parse_known_args(argv)
    refused = [f"--{name}" for name in TRITON_SERVER_FLAGS if getattr(given, name) not in (None, False)]
    if refused:
        raise ValueError(f"{', '.join(refused)} configure deploy_triton.py's servers; this script serves on "
                         "--host and --port")
    name = ray_args.model_id or given.triton_model_name
    if not name and given.config:
        name = triton_script.load_config(given.config).get("triton_model_name")
    settings = triton_script.parse_settings([*rest, "--triton_model_name", name or DEFAULT_MODEL_ID])
    ray_args.autoscaling = autoscaling_config(ray_args)
    if ray_args.autoscaling and any(arg.split("=")[0] == "--num_replicas" for arg in argv):
        raise ValueError("give --num_replicas (a fixed count) or autoscaling flags, not both")
    if ray_args.num_gpus_per_replica is None:
        ray_args.num_gpus_per_replica = 1.0 if settings.device == "cuda" else 0.0
    if settings.device == "cpu" and ray_args.num_gpus_per_replica > 0:
        raise ValueError("--device cpu replicas take no GPU; drop --num_gpus_per_replica or use --device cuda")
    if ray_args.address and (ray_args.num_cpus is not None or ray_args.num_gpus is not None
                             or ray_args.cuda_visible_devices is not None):
        raise ValueError("--num_cpus, --num_gpus and --cuda_visible_devices set up a local cluster; with --address "
                         "give them to `ray start` on each node")
    ray_args.scale = ScaleOptions(
        num_replicas=ray_args.num_replicas, autoscaling_config=ray_args.autoscaling,
        num_cpus_per_replica=ray_args.num_cpus_per_replica, num_gpus_per_replica=ray_args.num_gpus_per_replica,
        max_ongoing_requests=ray_args.max_ongoing_requests, front_replicas=ray_args.front_replicas,
        retries=ray_args.request_retries)
    return ray_args, settings


def autoscaling_config(args: argparse.Namespace) -> dict | None:
    """Ray Serve's autoscaling_config from --autoscaling_config and the three flags (None: a fixed count)."""
    config = {}
    if args.autoscaling_config:
        try:
            config = json.loads(args.autoscaling_config)
        except ValueError as error:
            raise ValueError(f"--autoscaling_config is not valid JSON ({error})") from None
        if not isinstance(config, dict):
            raise ValueError("--autoscaling_config must be a JSON object of Ray Serve's autoscaling fields")
    for name in ("min_replicas", "max_replicas", "target_ongoing_requests"):
        if getattr(args, name) is not None:
            config[name] = getattr(args, name)
    if not config:
        return None
    from ray.serve.config import AutoscalingConfig

    try:
        AutoscalingConfig(**config)
    except Exception as error:  # noqa: BLE001 - pydantic's error, made one line
        reason = " ".join(str(error).split())
        raise ValueError(f"the autoscaling config {config} is invalid: {reason[:300]}") from None
    return config


def export_or_check(settings: argparse.Namespace) -> None:
    """Export the checkpoint into the repository (nothing loaded here: the replicas load it), or check that the
    repository holds an exported model."""
    if settings.visual_checkpoint:
        triton_script.build_deployable(settings, load=False)
    else:
        check_model_repository(settings.triton_model_repository)


def start_cluster(args: argparse.Namespace) -> None:
    """Connect to the cluster at --address, or start a local one with --num_cpus / --num_gpus."""
    import ray

    if args.address:
        ray.init(address=args.address, logging_level=logging.WARNING)
        return
    if args.cuda_visible_devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = args.cuda_visible_devices  # the GPUs Ray hands out
    ray.init(num_cpus=args.num_cpus, num_gpus=args.num_gpus, include_dashboard=args.include_dashboard,
             logging_level=logging.WARNING)
    cpus, gpus = ray.cluster_resources().get("CPU", 0), ray.cluster_resources().get("GPU", 0)
    replicas = args.autoscaling.get("min_replicas", 1) if args.autoscaling else args.num_replicas
    for what, have, each, flag in (("CPUs", cpus, args.num_cpus_per_replica, "--num_cpus_per_replica"),
                                   ("GPUs", gpus, args.num_gpus_per_replica, "--num_gpus_per_replica")):
        if replicas * each > have:
            raise DeployError(f"{replicas} replicas x {each:g} {what} ({flag}) do not fit the local cluster's "
                              f"{have:g} {what}; lower {flag} or the replicas")


def deploy(args: argparse.Namespace, settings: argparse.Namespace) -> None:
    """Start Ray Serve's HTTP proxy and run the application; returns once every replica has warmed up."""
    from ray import serve

    application = build_application(
        str(Path(settings.triton_model_repository).resolve()), settings.triton_model_name, args.scale,
        engine_options=triton_script.exporter_options(settings), max_request_bytes=settings.openai_max_request_bytes)
    serve.start(http_options={"host": args.host, "port": args.port})
    try:
        serve.run(application, name=settings.triton_model_name, route_prefix="/")
    except RuntimeError as error:  # Ray's message holds the replica's traceback: its last line names the problem
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        raise DeployError(f"the application did not start: {lines[-1] if lines else error}") from None


def wait_for_stop() -> None:
    """Block until Ctrl-C or SIGTERM."""
    stop = threading.Event()
    for number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(number, lambda *_: stop.set())
    while not stop.wait(3600):
        pass


def main(argv: list[str] | None = None) -> int:
    """Run the script; returns the exit status (0 after a clean stop, 1 on an error explained on stderr)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    argv = sys.argv[1:] if argv is None else argv
    started = False
    try:
        args, settings = parse(argv)
        if not args.address:
            check_port_free(args.host, args.port, "HTTP", "--port")
        export_or_check(settings)
        start_cluster(args)
        started = True
        deploy(args, settings)
        LOGGER.info("serving %s on http://%s:%d (OpenAI API under /v1, Triton's routes under /v2/models/%s)",
                    settings.triton_model_name, args.host, args.port, settings.triton_model_name)
        wait_for_stop()
    except (DeployError, ValueError) as error:
        print(f"deploy_ray.py: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        if started:
            _stop(args, settings)
    return 0


def _stop(args: argparse.Namespace, settings: argparse.Namespace) -> None:
    """Delete the application from a cluster given by --address; shut down a local cluster."""
    import ray
    from ray import serve

    try:
        if args.address:
            serve.delete(settings.triton_model_name)
        else:
            serve.shutdown()
    finally:
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
