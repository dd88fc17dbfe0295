"""Start-up phases on a full-size CLIP-L/336 Neva perception beside a one-layer 4096-wide LLM, several runs each:
the perception's load alone (`kind.load_perception`, in a fresh process) and `scripts/deploy_triton.py` to READY
with its phase lines; prints per-run seconds and medians and writes `$OUT/startup_bench.json`.

The engine (about 1 GB: the tower and projector 0.6 GB, the LLM 0.44 GB) is exported once into a work folder;
the page cache is left warm, so the numbers are the host's work, not the disk's (`coldstart_bench.py` measures
with the cache dropped).

    python bench/startup_bench.py                 # the device torch sees (CUDA where there is one), 5 runs each
    python bench/startup_bench.py --runs 3 --device cpu
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from coldstart_bench import PHASE_LINE, READY_LINE, wait_logged_ready  # noqa: E402
from serve_bench import LLAVA_SHAPE, make_words, write_llava_nemo  # noqa: E402

SHAPE = {"vision": LLAVA_SHAPE["vision"],
         "llm": dict(vocab_size=2048, hidden_size=4096, ffn_hidden_size=11008, num_layers=1, num_attention_heads=32)}
LIMITS = {"max_batch_size": 2, "max_input_len": 2048, "max_output_len": 64}


def export(work: Path, device: str) -> Path:
    """The engine of `SHAPE` in bf16, written into `work`."""
    from exporter import TensorRTMMExporter

    nemo, engine = work / "startup.nemo", work / "engine"
    tempfile.tempdir = str(work)
    write_llava_nemo(nemo, make_words(0, 2000), SHAPE)
    TensorRTMMExporter(engine, load_model=False, device=device).export(
        nemo, model_type="neva", dtype="bfloat16", max_multimodal_len=LIMITS["max_batch_size"] * 576,
        load_model=False, **LIMITS)
    nemo.unlink()
    return engine


def child_perception(engine: str, device: str) -> None:
    """Load the perception once in this process; print its seconds and the memory it holds as JSON."""
    import torch

    from exporter.engine.directory import read_manifest, torch_dtype
    from exporter.models import get_model_type

    manifest = read_manifest(engine)
    kind = get_model_type(manifest["model_type"])
    if device == "cuda":
        torch.empty(1, device=device)  # the CUDA context is no part of the load
    started = time.perf_counter()
    perception = kind.load_perception(Path(engine) / kind.perception_dir, device=device,
                                      dtype=torch_dtype(manifest["dtype"]))
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    held = sum(p.numel() * p.element_size() for p in perception.encoder.parameters())
    with open("/proc/self/status") as status:
        rss = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else rss
    print(json.dumps({"seconds": seconds, "weights_GB": held / 1e9, "peak_GB": peak / 1e9}))


def perception_runs(engine: Path, device: str, runs: int) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return [json.loads(subprocess.run([sys.executable, __file__, "--child", str(engine), device], env=env,
                                      check=True, capture_output=True, text=True).stdout.splitlines()[-1])
            for _ in range(runs)]


def serve_once(engine: Path, device: str, log: Path) -> dict[str, float]:
    """deploy_triton.py on `engine` until READY; its phase lines' seconds and READY's."""
    from deploy.startup import free_port

    ports = [free_port() for _ in range(3)]
    command = [sys.executable, str(REPO / "scripts/deploy_triton.py"), "-tmn", "startup", "-tmr", str(engine),
               "-tha", "127.0.0.1", "-trp", str(ports[0]), "--grpc_port", str(ports[1]), "--metrics_port",
               str(ports[2]), "-mbs", str(LIMITS["max_batch_size"]), "--device", device]
    with log.open("w") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                  env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        wait_logged_ready(server, log, timeout_s=600, poll_s=0.05)
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
    text = log.read_text()
    phases = {match[1]: float(match[2]) for match in map(PHASE_LINE.search, text.splitlines()) if match}
    phases["READY"] = float(READY_LINE.search(text).group(1))
    return phases


def table(rows: dict[str, list[float]]) -> str:
    return "\n".join(f"  {name:52} {' '.join(f'{v:6.2f}' for v in values)}   median {statistics.median(values):6.2f}"
                     for name, values in rows.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child_perception(*args.child)
        return
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    work = Path(tempfile.mkdtemp(prefix="startup-", dir=args.workdir))
    out = Path(os.environ.get("OUT", work))
    out.mkdir(parents=True, exist_ok=True)
    try:
        engine = export(work, device)
        loads = perception_runs(engine, device, args.runs)
        served: dict[str, list[float]] = {}
        for run in range(args.runs):
            for name, seconds in serve_once(engine, device, out / f"startup_serve_{run}.log").items():
                served.setdefault(name, []).append(seconds)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    peak = f"peak {'GPU memory' if device == 'cuda' else 'RSS'} of that process (GB)"
    perception = {"perception load alone (s)": [r["seconds"] for r in loads],
                  "perception weights held (GB)": [r["weights_GB"] for r in loads],
                  peak: [r["peak_GB"] for r in loads]}
    print(f"{device}, {args.runs} runs: CLIP-L/336 + mlp2x_gelu perception, 1-layer 4096-wide LLM")
    print(table(perception))
    print("deploy_triton.py phases (s):")
    print(table(served))
    (out / "startup_bench.json").write_text(json.dumps({"device": device, "perception": perception,
                                                        "served": served}, indent=2))


if __name__ == "__main__":
    main()
