"""The demo Neva (demo/neva_demo.nemo, which names the shape and colour in 64x64 pictures): its questions, its
builder's fresh images, and the demo exported and served in this process or by `deploy_triton.py --config demo`.
The serving side (PyTriton, Triton's client) is imported only by the functions that serve, so the GPU tests that
use the demo's engine import on a machine without it."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from exporter import TensorRTMMExporter

if TYPE_CHECKING:
    from support.servers import ScriptServer

REPO = Path(__file__).resolve().parents[2]
DEMO_NEMO = REPO / "demo" / "neva_demo.nemo"
DEMO_IMAGES = REPO / "demo" / "images"
MODEL = "demo"  # the name the demo is served by
SHAPE_Q, COLOR_Q = "What shape is this?", "What color is the shape?"
FRESH_SEED = 20261122  # not the training seed
FRESH_IMAGES = 200  # how many fresh images the accuracy checks draw


def load_demo_builder() -> ModuleType:
    """The demo builder, tools/make_demo_checkpoint.py (its image generator and labels)."""
    from tools import make_demo_checkpoint

    return make_demo_checkpoint


@contextmanager
def demo_script_server(folder: Path, *flags: str) -> Iterator[ScriptServer]:
    """`deploy_triton.py --config demo` exporting the demo Neva into `folder`, with the OpenAI front, on free
    loopback ports, its output in `folder/server.log`; ready when entered (its OpenAI front answers only then),
    stopped as by Ctrl-C on exit."""
    from support.ports import free_port
    from support.servers import DEPLOY_SCRIPT, ScriptServer, poll_ready, stop_server

    ports = {name: free_port() for name in ("http", "grpc", "openai", "metrics")}
    command = [sys.executable, str(DEPLOY_SCRIPT), "--config", "demo", "-vc", str(DEMO_NEMO), "-tmr",
               str(folder / "repo"), "-trp", str(ports["http"]), "--grpc_port", str(ports["grpc"]), "--openai_port",
               str(ports["openai"]), "--metrics_port", str(ports["metrics"]), *flags]
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    log = folder / "server.log"
    with log.open("w") as out:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    server = ScriptServer(process, f"127.0.0.1:{ports['http']}", f"grpc://127.0.0.1:{ports['grpc']}",
                          f"http://127.0.0.1:{ports['openai']}/v1", f"http://127.0.0.1:{ports['metrics']}/metrics",
                          log)
    try:
        poll_ready(process, f"{server.openai}/health/ready")
        yield server
    finally:
        stop_server(process, 120)


@contextmanager
def demo_deployed(engine_dir: Path, max_batch_size: int, max_output_len: int, streaming: bool = False,
                  max_beam_width: int = 1, model_type: str = "neva") -> Iterator[tuple[str, str, object]]:
    """The demo Neva exported into `engine_dir` (float32, CPU, max_input_len 200) as `model_type` and served in this
    process by `DeployPyTriton` on free loopback ports: (HTTP URL, gRPC URL, the deployer), stopped on exit."""
    from deploy import DeployPyTriton
    from support.ports import free_port

    exporter = TensorRTMMExporter(engine_dir, device="cpu")
    exporter.export(DEMO_NEMO, model_type=model_type, dtype="float32", max_batch_size=max_batch_size,
                    max_input_len=200, max_output_len=max_output_len, max_multimodal_len=max_batch_size * 64,
                    max_beam_width=max_beam_width)
    http_port, grpc_port = free_port(), free_port()
    deployer = DeployPyTriton(exporter, MODEL, max_batch_size=max_batch_size, http_port=http_port,
                              grpc_port=grpc_port, address="127.0.0.1", streaming=streaming)
    deployer.deploy()
    try:
        deployer.run()
        yield f"127.0.0.1:{http_port}", f"grpc://127.0.0.1:{grpc_port}", deployer
    finally:
        deployer.stop()
