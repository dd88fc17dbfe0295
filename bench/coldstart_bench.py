"""Cold start of a LLaVA-1.5-7B-shaped Neva, measured in one run: export, first start and restart to READY, and
the first request after READY against the steady latency.

A `.nemo` with random bf16 weights (`serve_bench.write_llava_nemo`, 13.5 GB at the 7B shape) is written into a
work folder; then, each in a fresh process and with the model's files dropped from the page cache first (the
whole cache with `drop_caches` where the process may, else each file with `posix_fadvise(DONTNEED)`; the table
says which): the export; the LLM weights read onto the device the old way (safetensors `load_file`, then `.to`
per tensor) and the new way (`exporter.engine.loading`); a first start of `scripts/deploy_triton.py` after the
export (its kernel cache as the export left it: on a GPU the export fills it, `exporter.runtime.kernel_warmup`)
until it logs READY (after Triton's model-ready endpoint answers, the server's warm-up through Triton still
runs), its first request (one image, 32 new tokens) and the median of the next ones (other images, so no encoder
output is reused); a first start with no kernel cache (`.cache/` deleted, as for the engine moved to another GPU
or software version); a restart on the same engine (kernel cache kept); and the same restart again with the page
cache kept (what the start costs beside the disk). The server's own phase lines (read,
transfer, warm-up, ...) are listed too. The disk's speed is measured first. Prints a table beside the numbers
measured before this work (issue 20) and writes `$OUT/coldstart_bench.json`.

    python bench/coldstart_bench.py                        # CUDA: the 7B shape in bf16 (about 5 minutes on an H100)
    python bench/coldstart_bench.py --tiny                 # CPU: a tiny shape, checks that the script runs
    python bench/coldstart_bench.py --mid --no-serve       # CPU: 1.5 GB of LLM weights, export and load only
    python bench/coldstart_bench.py --late_reads           # the restart also lists what it read after the stream
    python bench/coldstart_bench.py --no_export_kernel_warmup  # the export leaves the kernel warm-up to a start
    python bench/coldstart_bench.py --compare_checkout ../main  # also a restart by another checkout's server (A/B)
    python bench/coldstart_bench.py --disk_only            # the disk alone: write, cold reads by thread count
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from serve_bench import LLAVA_SHAPE, make_words, write_llava_nemo  # noqa: E402

MODEL = "coldstart"
BEFORE = {"export_s": 35.0, "first_start_s": 44.0, "first_request_s": 0.85}  # issue 20, H100, one process
SHAPES = {
    "full": LLAVA_SHAPE,
    "mid": {"vision": dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
                           image_size=336, patch_size=14),
            "llm": dict(vocab_size=32064, hidden_size=2048, ffn_hidden_size=5632, num_layers=12,
                        num_attention_heads=16)},
    "tiny": {"vision": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                            image_size=56, patch_size=14),
             "llm": dict(vocab_size=512, hidden_size=64, ffn_hidden_size=128, num_layers=2, num_attention_heads=4)},
}
WORDS = {"full": 32000, "mid": 32000, "tiny": 300}
LIMITS = {"max_batch_size": 8, "max_input_len": 2048, "max_output_len": 256}
# the starts measured, in order, and their READY targets: after the export; with no kernel cache; again
STARTS = {"first_start": "<= 20", "first_start_no_kernel_cache": "<= 20", "restart": "<= 10",
          "restart_page_cache_kept": "<= 10"}
CACHE_KEPT = "restart_page_cache_kept"  # the one start after which the page cache is not dropped: the disk left out
COMPARED = "restart_compared_checkout"  # --compare_checkout: the restart by another checkout's server
TINY_LIMITS = {"max_batch_size": 2, "max_input_len": 256, "max_output_len": 16}
PHASE_LINE = re.compile(r"phase (.+?): ([0-9.]+) s(?: \((.*)\))?$")
COMPILE_CACHE_VARIABLES = ("TRITON_CACHE_DIR",)
STEADY_OF = 3  # steady latency: the median of the last requests (the first ones may meet fresh Triton instances)
READY_LINE = re.compile(r"READY ([0-9.]+) s after the process started")
METRIC_LINE = re.compile(r"^(nemo_mm_time_\w+_seconds_(?:sum|count)) ([0-9.e+-]+)$", re.MULTILINE)
SPAN = re.compile(r"^from ([0-9.]+) to ([0-9.]+) s of the export")  # a phase's span inside the export


# --- page cache ------------------------------------------------------------------------------------------------------

CACHE_DROP = "auto"  # --cache_drop


def drop_caches(paths: list[Path]) -> str:
    """Drop the page cache: all of it where allowed (root, `--cache_drop auto`), else each file under `paths`;
    says which."""
    os.sync()
    if CACHE_DROP == "auto":
        try:
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
            return "drop_caches"
        except OSError:
            pass
    for root in paths:
        for path in [root] if root.is_file() else (p for p in root.rglob("*") if p.is_file()):
            descriptor = os.open(path, os.O_RDONLY)
            try:
                os.fdatasync(descriptor)
                os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(descriptor)
    return "fadvise"


def disk_speed(folder: Path, nbytes: int) -> dict:
    """Sequential write (fsynced) and read of one file, in GB/s; the read after dropping it from the cache, and
    again cached (if both reads are alike, the drop did not work)."""
    path = folder / "disk_probe.bin"
    block = np.random.default_rng(0).integers(0, 255, 64 << 20, dtype=np.uint8).tobytes()
    started = time.perf_counter()
    with path.open("wb") as stream:
        for _ in range(nbytes // len(block)):
            stream.write(block)
        stream.flush()
        os.fsync(stream.fileno())
    write = nbytes / (time.perf_counter() - started) / 1e9
    how = drop_caches([path])
    reads = []
    for _ in range(2):
        started = time.perf_counter()
        with path.open("rb", buffering=0) as stream:
            while stream.read(64 << 20):
                pass
        reads.append(nbytes / (time.perf_counter() - started) / 1e9)
    by_threads = parallel_reads(path, nbytes)
    path.unlink()
    return {"disk_write_GBps": write, "disk_read_cold_GBps": reads[0], "disk_read_cached_GBps": reads[1],
            "cache_drop": how, "disk_read_cold_GBps_by_threads": by_threads}


def parallel_reads(path: Path, nbytes: int, block: int = 16 << 20) -> dict[str, float | str]:
    """Cold reads of `path` in GB/s by reader threads, each reading every `threads`-th block into a buffer of its
    own, through the page cache ("buffered", as the prefetch reads) or around it ("direct": O_DIRECT), the cache
    dropped before each: whether a deeper queue gets more from the disk."""
    import mmap
    from concurrent.futures import ThreadPoolExecutor

    def read_all(threads: int, flags: int) -> None:
        buffers = [mmap.mmap(-1, block) for _ in range(threads)]  # page-aligned, as O_DIRECT needs
        descriptor = os.open(path, os.O_RDONLY | flags)

        def read(index: int) -> None:
            for offset in range(index * block, nbytes, threads * block):
                os.preadv(descriptor, [buffers[index]], offset)
        try:
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(read, range(threads)))
        finally:
            os.close(descriptor)

    speeds: dict[str, float | str] = {}
    for kind, flags in (("buffered", 0), ("direct", getattr(os, "O_DIRECT", 0))):
        for threads in (1, 4, 8, 16, 32):
            drop_caches([path])
            started = time.perf_counter()
            try:
                read_all(threads, flags)
            except OSError as error:  # O_DIRECT refused by this file system
                speeds[f"{kind} {threads}"] = f"{type(error).__name__}: {error}"
                continue
            speeds[f"{kind} {threads}"] = round(nbytes / (time.perf_counter() - started) / 1e9, 3)
    return speeds


# --- children: each measurement in a fresh process -------------------------------------------------------------------

def child_export(nemo: Path, engine: Path, device: str, limits: dict, dtype: str, warm_kernels: bool) -> dict:
    from exporter import TensorRTMMExporter

    started = time.perf_counter()
    TensorRTMMExporter(engine, load_model=False, device=device).export(
        nemo, model_type="neva", dtype=dtype, max_multimodal_len=limits["max_batch_size"] * 576,
        load_model=False, warm_kernels=warm_kernels, **limits)
    return {"export_s": time.perf_counter() - started, "export_peak_rss_GB": _peak_rss() / 1e9}


def child_load(engine: Path, device: str, way: str) -> dict:
    """The LLM weights onto `device`, the old way or the new."""
    import torch

    from exporter.engine.directory import LLM_WEIGHTS, load_llm_weights

    torch.empty(1, device=device)  # the CUDA context is no part of the load
    started = time.perf_counter()
    if way == "old":
        from safetensors.torch import load_file

        weights = {name: t.to(device) for name, t in load_file(str(engine / LLM_WEIGHTS)).items()}
    else:
        weights = load_llm_weights(engine, device)
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    return {f"load_{way}_s": seconds, f"load_{way}_GBps": nbytes / seconds / 1e9,
            f"load_{way}_peak_rss_GB": _peak_rss() / 1e9}


def _peak_rss() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))


def run_child(args: list[str], log: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    started = time.perf_counter()
    with log.open("a") as out:
        done = subprocess.run([sys.executable, __file__, "--child", *args], env=env, stdout=subprocess.PIPE,
                              stderr=out, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"child {args[0]} failed; its log:\n{log.read_text()[-4000:]}")
    return {**json.loads(done.stdout.strip().splitlines()[-1]), f"{args[0]}_process_s": time.perf_counter() - started}


# --- serving ---------------------------------------------------------------------------------------------------------

def serve_and_query(engine: Path, device: str, limits: dict, log: Path, image_size: int, new_tokens: int,
                    steady_requests: int, late_reads: Path | None = None, checkout: Path = REPO) -> dict:
    """Start deploy_triton.py of `checkout` (this one by default) on `engine`, time it to READY, then the first and
    the steady requests; with `late_reads`, through bench/late_reads.py, its report written there and added."""
    from pytriton.client import ModelClient

    from deploy.startup import free_port

    ports = [free_port() for _ in range(3)]
    script = [str(checkout / "scripts/deploy_triton.py")] if late_reads is None else [
        str(REPO / "bench/late_reads.py"), "--out", str(late_reads), "--"]
    command = [sys.executable, *script, "-tmn", MODEL, "-tmr", str(engine),
               "-tha", "127.0.0.1", "-trp", str(ports[0]), "--grpc_port", str(ports[1]),
               "--metrics_port", str(ports[2]), "-mbs", str(limits["max_batch_size"]), "--device", device]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(checkout), os.environ.get("PYTHONPATH")]))}
    for variable in COMPILE_CACHE_VARIABLES:  # compiled kernels come from the engine's .cache/ or nowhere
        env.pop(variable, None)
    with log.open("w") as out:
        started = time.perf_counter()
        server = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        ready = wait_logged_ready(server, log, timeout_s=600, poll_s=0.05) - started
        requests = [_request(seed, image_size, new_tokens) for seed in range(steady_requests + 1)]
        latencies, inside, metrics = [], [], f"http://127.0.0.1:{ports[2]}/metrics"
        with ModelClient(f"127.0.0.1:{ports[0]}", MODEL, inference_timeout_s=600) as client:
            client.wait_for_model(60)  # the client's own set-up (model config) is no part of the first request
            first_after_ready = time.perf_counter() - started - ready
            for count, inputs in enumerate(requests, 1):
                began = time.perf_counter()
                client.infer_batch(**inputs)
                latencies.append(time.perf_counter() - began)
                inside.append(scheduler_seconds(metrics, count))
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
    steady = statistics.median(latencies[-STEADY_OF:])
    inside = [(b[0] - a[0], b[1] - a[1]) for a, b in zip([(0.0, 0.0), *inside], inside)]  # per request
    return {"ready_s": ready, "first_request_s": latencies[0], "steady_request_s": steady,
            "first_over_steady": latencies[0] / steady, "first_request_after_ready_s": first_after_ready,
            "latencies_s": latencies, "to_first_token_s": [first_token for first_token, _ in inside],
            "first_request_split": split_request(latencies[0], inside[0], new_tokens),
            "steady_request_split": split_request(steady, tuple(map(statistics.median, zip(*inside[-STEADY_OF:]))),
                                                  new_tokens),
            "phases": server_phases(log.read_text()),
            **({} if late_reads is None else {"late_reads": _late_reads_summary(late_reads)})}


def _late_reads_summary(path: Path) -> dict:
    """bench/late_reads.py's report without its file list (kept in its own JSON)."""
    report = json.loads(path.read_text())
    return {key: report[key] for key in ("stream_began_s", "late_files_by_kind", "late_modules")}


def wait_logged_ready(process: subprocess.Popen, log: Path, timeout_s: float, poll_s: float) -> float:
    """Poll the server's `log` every `poll_s` until it has its READY line (what clients are told, after the warm-up
    through Triton); returns `time.perf_counter()` then. Raises if the process exits first, or after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if READY_LINE.search(log.read_text()):
            return time.perf_counter()
        if process.poll() is not None:
            raise RuntimeError(f"the server exited; its log:\n{log.read_text()[-5000:]}")
        time.sleep(poll_s)
    raise RuntimeError(f"the server did not log READY in {timeout_s:g} s")


def scheduler_seconds(url: str, answered: int, timeout_s: float = 5.0) -> tuple[float, float]:
    """The server's metrics once they count `answered` requests: the sums of the time to first token (from the
    request's submission to the scheduler) and of the mean time per later token (`deploy.metrics`)."""
    deadline = time.monotonic() + timeout_s
    while True:
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
        values = {name: float(value) for name, value in METRIC_LINE.findall(text)}
        if values.get("nemo_mm_time_to_first_token_seconds_count", 0) >= answered or time.monotonic() > deadline:
            return (values.get("nemo_mm_time_to_first_token_seconds_sum", 0.0),
                    values.get("nemo_mm_time_per_output_token_seconds_sum", 0.0))
        time.sleep(0.02)


def split_request(latency: float, sums: tuple[float, float], new_tokens: int) -> dict[str, float]:
    """A request's latency in parts: in the scheduler to the first token (prefill, and any wait there), the later
    tokens, and the rest (Triton, the image's decoding and encoding, the client). `sums`: the request's time to
    first token and mean time per later token, as the server's metrics count them."""
    first_token, per_token = sums
    decode = per_token * (new_tokens - 1)
    return {"latency_s": latency, "to_first_token_s": first_token, "later_tokens_s": decode,
            "outside_scheduler_s": latency - first_token - decode}


def _request(seed: int, image_size: int, new_tokens: int) -> dict[str, np.ndarray]:
    """One Triton request (batch axis included): a question and a random PNG image, `new_tokens` new tokens."""
    from query.media import image_bytes
    from wire.params import param_tensors

    pixels = np.random.default_rng(seed).integers(0, 255, (image_size, image_size, 3), dtype=np.uint8)
    row = {"input_text": np.array([b"Describe this image."], dtype=np.bytes_),
           "input_media_bytes": np.array([image_bytes(pixels)], dtype=object),
           **param_tensors({"max_output_len": new_tokens})}
    return {name: value[np.newaxis] for name, value in row.items()}


def server_phases(log: str) -> dict[str, str]:
    """`{phase: "seconds (detail)"}` from the phase lines of a log, and READY."""
    phases = {}
    for line in log.splitlines():
        if match := PHASE_LINE.search(line):
            phases[match[1]] = f"{float(match[2]):.2f} s" + (f" ({match[3]})" if match[3] else "")
        elif match := READY_LINE.search(line):
            phases["READY (since the process started)"] = f"{float(match[1]):.2f} s"
    return phases


def export_overlap(phases: dict[str, str]) -> float | None:
    """Seconds the LLM weights' write ran while the perception was built (from the export's phase spans)."""
    spans = {name: SPAN.match(value.split(" (", 1)[-1]) for name, value in phases.items()}
    perception, written = spans.get("perception"), spans.get("write the LLM weights")
    if not (perception and written):
        return None
    return max(0.0, min(float(perception[2]), float(written[2])) - max(float(perception[1]), float(written[1])))


# --- the run ---------------------------------------------------------------------------------------------------------

def run(args: argparse.Namespace) -> dict:
    import torch

    shape_name = "tiny" if args.tiny else "mid" if args.mid else "full"
    device = "cuda" if torch.cuda.is_available() and not (args.tiny or args.mid) else "cpu"
    limits = TINY_LIMITS if args.tiny else LIMITS
    dtype = "bfloat16"
    work = Path(tempfile.mkdtemp(prefix="coldstart-", dir=args.workdir))
    out = Path(os.environ.get("OUT", work))
    out.mkdir(parents=True, exist_ok=True)
    result: dict = {"shape": shape_name, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                    "torch": torch.__version__, "cpus": os.cpu_count(), "work": str(work), **limits}
    try:
        result.update(disk_speed(work, (256 << 20) if args.tiny else (2 << 30)))
        print(f"disk: {result['disk_write_GBps']:.2f} GB/s write, {result['disk_read_cold_GBps']:.2f} GB/s read "
              f"(cache dropped by {result['cache_drop']}), {result['disk_read_cached_GBps']:.2f} GB/s cached",
              flush=True)
        print(f"disk: cold reads by threads, GB/s: {result['disk_read_cold_GBps_by_threads']}", flush=True)
        if args.disk_only:
            return result
        nemo, engine = work / "llava_shape.nemo", work / "engine"
        tempfile.tempdir = str(work)  # write_nemo's staging folder: on the work disk, not on a small /tmp
        started = time.perf_counter()
        shape = SHAPES[shape_name]
        if args.layers:  # the same layer shapes, fewer of them (a shorter run)
            shape = {**shape, "llm": {**shape["llm"], "num_layers": args.layers}}
        result["llm_layers"] = shape["llm"]["num_layers"]
        write_llava_nemo(nemo, make_words(0, WORDS[shape_name]), shape)
        result["write_nemo_s"] = time.perf_counter() - started
        result["nemo_GB"] = nemo.stat().st_size / 1e9
        print(f"wrote {result['nemo_GB']:.2f} GB .nemo in {result['write_nemo_s']:.1f} s", flush=True)

        drop_caches([nemo])
        result["export_kernel_warmup"] = not args.no_export_kernel_warmup
        result.update(run_child(["export", str(nemo), str(engine), device, json.dumps(limits), dtype,
                                 json.dumps(result["export_kernel_warmup"])], out / "coldstart_export.log"))
        result["export_phases"] = server_phases((out / "coldstart_export.log").read_text())
        result["export_overlap_s"] = export_overlap(result["export_phases"])
        print(f"export {result['export_s']:.1f} s", flush=True)
        nemo.unlink()
        for way in ("old", "new"):
            drop_caches([engine])
            result.update(run_child(["load", str(engine), device, way], out / "coldstart_load.log"))
        if not args.no_serve:
            image = SHAPES[shape_name]["vision"]["image_size"]
            tokens, steady = (8, 4) if args.tiny else (32, 10)
            for start in STARTS:
                if start == "first_start_no_kernel_cache":
                    shutil.rmtree(engine / ".cache", ignore_errors=True)
                if start != CACHE_KEPT:
                    drop_caches([engine])
                traced = out / "coldstart_restart_late_reads.json" if args.late_reads and start == "restart" else None
                result[start] = serve_and_query(engine, device, limits, out / f"coldstart_{start}.log", image,
                                                tokens, steady, traced)
                print(f"{start}: READY in {result[start]['ready_s']:.1f} s", flush=True)
            if args.compare_checkout:  # the same restart by another checkout's server, right after this one's
                drop_caches([engine])
                result[COMPARED] = {"checkout": str(args.compare_checkout), **serve_and_query(
                    engine, device, limits, out / f"coldstart_{COMPARED}.log", image, tokens, steady,
                    checkout=Path(args.compare_checkout).resolve())}
                print(f"{COMPARED}: READY in {result[COMPARED]['ready_s']:.1f} s", flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return result


def report(result: dict) -> str:
    gb = result.get("nemo_GB", 0)
    lines = [f"{result['shape']} shape ({result.get('llm_layers')} LLM layers) on {result['device']} ({result['cpus']} CPUs), .nemo {gb:.2f} GB; disk "
             f"{result['disk_write_GBps']:.2f} GB/s write, {result['disk_read_cold_GBps']:.2f} GB/s cold read "
             f"({result['disk_read_cached_GBps']:.2f} cached); page cache dropped by {result['cache_drop']}",
             f"{'metric':44} {'now':>9} {'before (issue 20, H100 7B)':>26} {'target':>8}"]

    def row(label: str, value: float | None, before: float | None = None, target: str = "") -> None:
        shown = "-" if value is None else f"{value:9.2f}"
        lines.append(f"{label:44} {shown:>9} {'' if before is None else f'{before:.2f}':>26} {target:>8}")

    row("export s", result.get("export_s"), BEFORE["export_s"], "<= 20")
    row("export: LLM write beside the perception s", result.get("export_overlap_s"))
    row("export peak RSS GB", result.get("export_peak_rss_GB"))
    row("LLM weights to device, old way s", result.get("load_old_s"))
    row("LLM weights to device, new way s", result.get("load_new_s"))
    row("LLM weights to device, new way GB/s", result.get("load_new_GBps"))
    for start, target in (*STARTS.items(), (COMPARED, STARTS["restart"])):
        measured = result.get(start)
        if measured:
            first = start.startswith("first_start")  # issue 20's first start had no kernel cache
            row(f"{start.replace('_', ' ')}: process start to READY s", measured["ready_s"],
                BEFORE["first_start_s"] if first else None, target)
            row(f"{start.replace('_', ' ')}: first request s", measured["first_request_s"],
                BEFORE["first_request_s"] if first else None)
            row(f"{start.replace('_', ' ')}: steady request s", measured["steady_request_s"])
            row(f"{start.replace('_', ' ')}: first / steady", measured["first_over_steady"], None, "<= 1.2")
            row(f"{start.replace('_', ' ')}: first request sent after READY s", measured["first_request_after_ready_s"])
            first, steady = measured["first_request_split"], measured["steady_request_split"]
            lines.append("    each request s: " + " ".join(f"{latency:.3f}" for latency in measured["latencies_s"]))
            lines.append("    first / steady request: " + ", ".join(
                f"{part[:-2].replace('_', ' ')} {first[part]:.3f} / {steady[part]:.3f} s"
                for part in ("to_first_token_s", "later_tokens_s", "outside_scheduler_s")))
            if "late_reads" in measured:
                late = measured["late_reads"]
                lines.append("    read after the LLM weights' stream began (opened through Python): " + (", ".join(
                    f"{kind} {total['files']} files {total['bytes'] / 1e6:.2f} MB"
                    for kind, total in late["late_files_by_kind"].items()) or "nothing")
                    + f"; {len(late['late_modules'])} modules imported")
    for title, phases in (("export phases", result.get("export_phases")),
                          *((f"{s.replace('_', ' ')} phases", result[s]["phases"]) for s in (*STARTS, COMPARED)
                            if result.get(s))):
        lines.append(title + ":")
        lines.extend(f"    {name:40} {value}" for name, value in (phases or {}).items())
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--tiny", action="store_true", help="a tiny shape on the CPU: checks the script, times nothing")
    size.add_argument("--mid", action="store_true", help="1.5 GB of LLM weights on the CPU")
    parser.add_argument("--layers", type=int, default=None,
                        help="LLM layers (default: the shape's; 32 for the 7B shape): fewer for a shorter run")
    parser.add_argument("--no-serve", action="store_true", help="export and weight loading only (no server)")
    parser.add_argument("--workdir", default=None, help="where the .nemo and the engine are written (default: $TMPDIR)")
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    parser.add_argument("--disk_only", action="store_true", help="measure the disk only (reads by thread count too)")
    parser.add_argument("--late_reads", action="store_true",
                        help="start the restart through bench/late_reads.py: what it read and imported after the "
                             "LLM weights' stream began ($OUT/coldstart_restart_late_reads.json)")
    parser.add_argument("--no_export_kernel_warmup", action="store_true",
                        help="export without the kernel warm-up (warm_kernels=False): the first start runs it")
    parser.add_argument("--compare_checkout", default=None,
                        help="after the restart, restart the same engine with the server of this other checkout "
                        "(a git worktree of another commit, say), for an A/B in one run")
    parser.add_argument("--cache_drop", choices=("auto", "files"), default="auto",
                        help="auto: the whole page cache where allowed, else the model's files; files: only those "
                        "(on a machine shared with others)")
    parser.add_argument("--child", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        import logging

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
        kind, *rest = args.child
        if kind == "export":
            nemo, engine, device, limits, dtype, warm_kernels = rest
            measured = child_export(Path(nemo), Path(engine), device, json.loads(limits), dtype,
                                    json.loads(warm_kernels))
        else:
            engine, device, way = rest
            measured = child_load(Path(engine), device, way)
        print(json.dumps(measured))
        return
    global CACHE_DROP
    CACHE_DROP = args.cache_drop
    result = run(args)
    with open(os.path.join(os.environ.get("OUT", "."), "coldstart_bench.json"), "w") as stream:
        json.dump(result, stream, indent=1)
    print(report(result))


if __name__ == "__main__":
    main()
