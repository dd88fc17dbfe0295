"""What a start of deploy_triton.py reads and imports after the LLM weights' stream began, until READY: the reads
that wait behind the stream on a cold disk (docs/performance.md, "Cold start"; `exporter/engine/read_ahead.py`
reads what it knows of before the stream).

    python bench/late_reads.py -- <deploy_triton.py arguments>   # serves as deploy_triton.py does; reports at READY
    python bench/late_reads.py --stop_at_ready -- <arguments>    # and stops there
    python bench/late_reads.py --tiny                            # CPU: the demo exported, restarted, stopped at READY

It runs scripts/deploy_triton.py in this process with an audit hook (`sys.addaudithook`) recording each file opened
through Python (its thread, its time), and takes `sys.modules` when the stream begins (the first read of the LLM
weights by the prefetch's or the fill's threads) and at READY. Writes `$OUT/late_reads.json` (or `--out`) and
prints what was read late, by kind, and the modules imported late. Not seen: files opened by compiled code (the
perception's weights through safetensors, libraries the CUDA driver or torch loads) and page faults in mapped
libraries; the warm-up's phase line gives the bytes its thread read from the disk.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "scripts")]

STREAM_THREADS = ("engine-prefetch", "engine-fill", "engine-reader")  # the load's prefetch and fill
LLM_WEIGHTS_NAME = "model"  # llm_engine/model.safetensors, llm_engine/model.rank<r>.safetensors


class Recorder:
    """The files opened through Python (first open: thread, seconds since the start) and the modules loaded when
    the stream began."""

    def __init__(self, repository: Path):
        self.repository = Path(os.path.abspath(repository))  # as deploy_triton.py opens it: not resolved
        self.started = time.perf_counter()
        self.opened: dict[str, tuple[str, float]] = {}
        self.stream_began: float | None = None
        self.modules_at_stream: set[str] = set()

    def __call__(self, event: str, args: tuple) -> None:
        if event != "open" or not isinstance(args[0], str):
            return
        path, thread = os.path.abspath(args[0]), threading.current_thread().name
        if self.stream_began is None and thread.startswith(STREAM_THREADS) and self._llm_weights(path):
            self.stream_began = time.perf_counter() - self.started
            self.modules_at_stream = set(sys.modules.copy())
        if not thread.startswith(STREAM_THREADS):
            self.opened.setdefault(path, (thread, time.perf_counter() - self.started))

    def _llm_weights(self, path: str) -> bool:
        name = Path(path)
        return name.parent == self.repository / "llm_engine" and name.name.startswith(LLM_WEIGHTS_NAME)

    def report(self, ready_s: float) -> dict:
        """What was opened after the stream began (its own files left out) and the modules loaded since."""
        began = self.stream_began
        late = [] if began is None else [
            {"path": path, "bytes": _size(path), "thread": thread, "at_s": round(at, 3), "kind": self._kind(path)}
            for path, (thread, at) in self.opened.items() if at >= began and not self._llm_weights(path)]
        kinds: dict[str, dict[str, int]] = {}
        for entry in late:
            kind = kinds.setdefault(entry["kind"], {"files": 0, "bytes": 0})
            kind["files"] += 1
            kind["bytes"] += entry["bytes"]
        modules = [] if began is None else sorted(set(sys.modules.copy()) - self.modules_at_stream)
        return {"stream_began_s": began, "ready_s": ready_s, "late_files_by_kind": kinds, "late_modules": modules,
                "late_files": late}

    def _kind(self, path: str) -> str:
        resolved = Path(path)
        if resolved.is_relative_to(self.repository / ".cache"):
            return "kernel cache"
        if resolved.is_relative_to(self.repository):
            return "engine"
        if resolved.suffix in (".py", ".pyc"):
            return "python module"
        if ".so" in resolved.suffixes:
            return "library"
        return "other"


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size if os.path.isfile(path) else 0
    except OSError:
        return 0


def print_report(report: dict) -> None:
    print(f"stream began {report['stream_began_s'] or 0:.2f} s, READY {report['ready_s']:.2f} s after the start")
    print("read after the stream began, by kind (files opened through Python):")
    for kind, total in sorted(report["late_files_by_kind"].items(), key=lambda item: -item[1]["bytes"]):
        print(f"    {kind:15} {total['files']:5d} files {total['bytes'] / 1e6:10.2f} MB")
    print(f"modules imported after the stream began: {len(report['late_modules'])}")
    for name in report["late_modules"]:
        print(f"    {name}")


def tiny_arguments(folder: Path) -> list[str]:
    """The demo exported into `folder` (CPU, in a process of its own: its imports are no part of the restart's),
    and deploy_triton.py's arguments to serve it on free ports."""
    from deploy.startup import free_port

    export = ("import sys; from exporter import TensorRTMMExporter; "
              "TensorRTMMExporter(sys.argv[1], device='cpu', load_model=False).export("
              "visual_checkpoint_path=sys.argv[2], model_type='neva', llm_model_type='llama', max_input_len=512, "
              "max_output_len=16, max_batch_size=2, max_multimodal_len=1024, dtype='float32', load_model=False)")
    subprocess.run([sys.executable, "-c", export, str(folder), str(REPO / "demo/neva_demo.nemo")], check=True,
                   env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    return ["--config", "demo", "-tmr", str(folder), "-tmn", "demo", "-mbs", "2",
            "--triton_port", str(free_port()), "--grpc_port", str(free_port()), "--metrics_port", str(free_port())]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="the demo on the CPU, stopped at READY")
    parser.add_argument("--stop_at_ready", action="store_true", help="stop the server once the report is written")
    parser.add_argument("--out", type=Path, help="the report (default $OUT/late_reads.json, else ./late_reads.json)")
    parser.add_argument("serve", nargs=argparse.REMAINDER, help="-- then deploy_triton.py's arguments")
    args = parser.parse_args()
    out = args.out or Path(os.environ.get("OUT", ".")) / "late_reads.json"
    serve = args.serve[1:] if args.serve[:1] == ["--"] else args.serve
    with tempfile.TemporaryDirectory(prefix="late_reads_") as folder:
        if args.tiny:
            serve = tiny_arguments(Path(folder))
        return run(serve, out, stop_at_ready=args.stop_at_ready or args.tiny)


def run(serve: list[str], out: Path, stop_at_ready: bool) -> int:
    """deploy_triton.main(serve) under the recorder; the report written to `out` at READY."""
    import deploy_triton

    recorder = Recorder(Path(deploy_triton.parse_settings(serve).triton_model_repository))
    sys.addaudithook(recorder)

    class AtReady(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith("READY"):
                report = recorder.report(time.perf_counter() - recorder.started)
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(json.dumps(report, indent=1))
                print_report(report)
                if stop_at_ready:  # in 2 s: once serve() has taken SIGTERM over
                    threading.Timer(2.0, os.kill, (os.getpid(), signal.SIGTERM)).start()

    logging.getLogger("deploy_triton").addHandler(AtReady())
    return deploy_triton.main(serve)


if __name__ == "__main__":
    sys.exit(main())
