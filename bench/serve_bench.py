"""The real server under load: `scripts/deploy_triton.py` driven from client processes over Triton HTTP, gRPC
streaming and the OpenAI front, against the in-process scheduler measured in the same run.

Closed loop at each concurrency (each client sends its next request when the last one is answered) and open loop
(Poisson arrivals at `--rate` requests/s), with a seeded mix of images, prompt lengths and output lengths. Output
tok/s counts the tokens the server generated during a phase (its metrics); time to first token (TTFT) and time per
output token (TPOT: the mean gap between a streamed request's pieces after the first) are measured by the
streaming clients; latency is a whole request's. "scheduler" is the same closed loop run in-process on the same
engine (`TensorRTMMExporter.generate` from as many threads), before the server starts. Prints a table and writes
`$OUT/serve_bench.json`.

`--target ray` serves with `scripts/deploy_ray.py` instead, once per `--ray_replicas` count (each replica
`--ray_cpus_per_replica` CPUs), over the OpenAI API (`openai_plain`: whole answers; `openai`: streamed); output
tok/s then counts the tokens the answers report (`usage`), and a last table gives each count's best throughput
over one replica's best (repeat a load, `--concurrency 32 32 32`, where other work shares the machine).

    python bench/serve_bench.py --demo                        # CPU, the bundled demo model: checks the script
    python bench/serve_bench.py --llava --engine_dir /tmp/llava_engine    # GPU: a LLaVA-1.5-7B-shaped engine
                                                              # with random bf16 weights (built once, reused)
    python bench/serve_bench.py --small_llm --target ray --ray_replicas 1 2 --protocols openai_plain \\
        --concurrency 32 32 32 --requests 96 --processes 1   # CPU: Ray Serve's throughput, 1 and 2 replicas
"""

from __future__ import annotations

import argparse
import io
import json
import multiprocessing
import os
import queue
import random
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

MODEL = "bench"
# The server's log lines once its background captures end (all captured, or stopped: the rest then run eagerly).
BACKGROUND_CAPTURED = ("phase capture the other step graphs", "background capture of the step graphs stopped")
PROTOCOLS = ("triton_http", "grpc_stream", "openai")
OPENAI_PLAIN = "openai_plain"  # the OpenAI API without streaming: one answer per request (no TTFT or TPOT)
QUESTIONS = ("Describe this image.", "What is in this picture?", "What colors do you see?", "Is there a person?")


@dataclass(frozen=True)
class Setting:
    """What a benchmark run serves and sends."""

    max_batch_size: int
    max_input_len: int
    max_output_len: int
    output_lens: tuple[int, ...]
    filler_words: tuple[int, ...]
    image_sizes: tuple[int, ...]


DEMO = Setting(max_batch_size=8, max_input_len=512, max_output_len=16, output_lens=(2, 4, 8),
               filler_words=(0, 8, 32), image_sizes=(64, 96, 128))
LLAVA = Setting(max_batch_size=32, max_input_len=1280, max_output_len=256, output_lens=(32, 64, 128, 256),
                filler_words=(0, 64, 256), image_sizes=(336, 512, 640, 1024))
SMALL_LLM = Setting(max_batch_size=8, max_input_len=512, max_output_len=256, output_lens=(128, 192, 256),
                    filler_words=(0, 8, 32), image_sizes=(56, 96))


LLAVA_SHAPE = {"vision": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                              image_size=336, patch_size=14),
               "llm": dict(vocab_size=32064, hidden_size=4096, ffn_hidden_size=11008, num_layers=32,
                           num_attention_heads=32)}
TOKENIZER_WORDS = 32000
SMALL_LLM_SHAPE = {"vision": dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                                  image_size=56, patch_size=14),
                   "llm": dict(vocab_size=2048, hidden_size=384, ffn_hidden_size=1024, num_layers=6,
                               num_attention_heads=6)}  # float32, 2000 words: decoding is CPU-bound
SMALL_LLM_WORDS = 2000
MODELS = {  # --demo, --llava, --small_llm: (setting, random shape or None for the demo, tokenizer words, dtype, title)
    "demo": (DEMO, None, 0, "float32", "demo Neva, float32"),
    "llava": (LLAVA, LLAVA_SHAPE, TOKENIZER_WORDS, "bfloat16", "LLaVA-1.5-7B shape, random bf16"),
    "small_llm": (SMALL_LLM, SMALL_LLM_SHAPE, SMALL_LLM_WORDS, "float32", "random Neva, 384-wide 6-layer LLM, float32"),
}


@dataclass(frozen=True)
class BenchRequest:
    text: str
    image: bytes
    max_output_len: int


@dataclass
class Record:
    """One request as its client saw it (time.monotonic seconds); `pieces` streamed, or None; `text`: a gRPC
    stream's answer (its tokens are counted by the engine's tokenizer: the stream does not say them)."""

    start: float
    end: float
    first: float | None = None
    last: float | None = None
    pieces: int | None = None
    tokens: int | None = None
    text: str | None = None
    error: str | None = None


# --- requests --------------------------------------------------------------------------------------------------------

def make_requests(setting: Setting, count: int, seed: int, words: list[str]) -> list[BenchRequest]:
    """A seeded mix of images (smooth random pictures as JPEG), prompt lengths and output lengths."""
    import numpy as np
    from PIL import Image

    rng = random.Random(seed)
    images = []
    for index, size in enumerate(setting.image_sizes * 2):
        coarse = np.random.default_rng(seed * 100 + index).integers(0, 256, (8, 8, 3), dtype=np.uint8)
        buffer = io.BytesIO()
        Image.fromarray(coarse).resize((size, size), Image.BICUBIC).save(buffer, "JPEG", quality=90)
        images.append(buffer.getvalue())
    requests = []
    for _ in range(count):
        filler = " ".join(rng.choice(words) for _ in range(rng.choice(setting.filler_words)))
        text = f"{rng.choice(QUESTIONS)} {filler}".strip()
        requests.append(BenchRequest(text, rng.choice(images), rng.choice(setting.output_lens)))
    return requests


# --- clients (in their own processes) --------------------------------------------------------------------------------

_local = threading.local()


def _send(protocol: str, urls: dict[str, str], request: BenchRequest) -> Record:
    if protocol == "triton_http" and not hasattr(_local, "client"):  # one client per thread, kept
        from query import NemoQueryMultimodal

        _local.client = NemoQueryMultimodal(urls["http"], MODEL, "neva")
    start = time.monotonic()
    record = Record(start, start)
    try:
        if protocol == "triton_http":
            _local.client.query(request.text, request.image, max_output_len=request.max_output_len,
                                init_timeout=600, inference_timeout=600)
        elif protocol == OPENAI_PLAIN:
            with urllib.request.urlopen(_openai_post(urls, request, stream=False), timeout=600) as response:
                record.tokens = json.loads(response.read())["usage"]["completion_tokens"]
        else:
            pieces = _grpc_stream(urls, request) if protocol == "grpc_stream" else _openai_stream(urls, request)
            record.pieces = 0
            for piece in pieces:
                if isinstance(piece, dict) and piece.get("usage"):  # the OpenAI stream's last chunk
                    record.tokens = piece["usage"]["completion_tokens"]
                    continue
                if isinstance(piece, str):
                    record.text = (record.text or "") + piece
                now = time.monotonic()
                record.first = record.first or now
                record.last = now
                record.pieces += 1
    except Exception as error:  # noqa: BLE001 - counted, not raised: the run goes on
        record.error = f"{type(error).__name__}: {error}"[:300]
    record.end = time.monotonic()
    return record


def _grpc_stream(urls: dict[str, str], request: BenchRequest):
    from query import NemoQueryMultimodal

    client = NemoQueryMultimodal(urls["grpc"], MODEL, "neva")
    return client.query_stream(request.text, request.image, max_output_len=request.max_output_len,
                               init_timeout=600, inference_timeout=600)


def _openai_post(urls: dict[str, str], request: BenchRequest, stream: bool) -> urllib.request.Request:
    import base64

    image = "data:image/jpeg;base64," + base64.b64encode(request.image).decode()
    body = {"model": MODEL, "stream": stream, "max_tokens": request.max_output_len, "messages": [{"role": "user",
            "content": [{"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": request.text}]}]}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return urllib.request.Request(urls["openai"] + "/chat/completions", data=json.dumps(body).encode(),
                                  headers={"Content-Type": "application/json"})


def _openai_stream(urls: dict[str, str], request: BenchRequest):
    with urllib.request.urlopen(_openai_post(urls, request, stream=True), timeout=600) as response:
        for line in response:
            if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[len(b"data:"):])
            if "error" in chunk:
                raise RuntimeError(chunk["error"].get("message"))
            if chunk.get("usage") or any(choice["delta"].get("content") for choice in chunk["choices"]):
                yield chunk


def client_process(protocol: str, urls: dict[str, str], requests: list[BenchRequest], threads: int,
                   rate: float | None, seed: int, ready, go, results) -> None:
    """Send `requests`: closed loop over `threads` threads, or at Poisson arrivals of `rate` per second. Each
    thread first sends one request of its own (its imports and connections), then all wait for `go`."""
    records: list[Record] = []
    warmed = threading.Barrier(max(threads, 1) + 1)

    def warm_then_wait() -> None:
        _send(protocol, urls, requests[0])
        warmed.wait()
        go.wait()

    if rate is None:
        pending: queue.Queue[BenchRequest] = queue.Queue()
        for request in requests:
            pending.put(request)

        def loop() -> None:
            warm_then_wait()
            while True:
                try:
                    request = pending.get_nowait()
                except queue.Empty:
                    return
                records.append(_send(protocol, urls, request))

        workers = [threading.Thread(target=loop) for _ in range(threads)]
        for worker in workers:
            worker.start()
        warmed.wait()
        ready.wait()
        for worker in workers:
            worker.join()
    else:
        threading.Thread(target=warm_then_wait).start()
        warmed.wait()
        ready.wait()
        go.wait()
        rng = random.Random(seed)
        with ThreadPoolExecutor(max(1, len(requests))) as pool:
            futures = []
            for request in requests:
                time.sleep(rng.expovariate(rate))
                futures.append(pool.submit(_send, protocol, urls, request))
            records = [future.result() for future in futures]
    results.put([asdict(record) for record in records])


# --- phases ----------------------------------------------------------------------------------------------------------

def _generated_tokens(urls: dict[str, str]) -> float:
    with urllib.request.urlopen(urls["metrics"], timeout=30) as response:
        for line in response.read().decode().splitlines():
            if line.startswith("nemo_mm_generated_tokens_total "):
                return float(line.split()[1])
    raise RuntimeError("the server's metrics have no nemo_mm_generated_tokens_total")


def _quantiles(values: list[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    ordered = sorted(values)
    return ordered[len(ordered) // 2], ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]


def run_phase(protocol: str, urls: dict[str, str], requests: list[BenchRequest], processes: int,
              concurrency: int | None = None, rate: float | None = None, server_pid: int | None = None,
              count_tokens: Callable[[str], int] | None = None) -> dict:
    """One phase over `processes` client processes; its numbers (with `server_pid`, also the CPU the server's
    processes used: on a shared machine, what it got). TPOT is a streamed request's time from its first piece to
    its last over its tokens after the first (a piece may hold several); `count_tokens` counts a gRPC stream's."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    count = min(processes, concurrency or processes, len(requests))
    shares = [requests[i::count] for i in range(count)]
    threads = [len(range(i, concurrency, count)) for i in range(count)] if concurrency else [0] * count
    ready, go = context.Barrier(count + 1), context.Event()
    clients = [context.Process(target=client_process, args=(protocol, urls, share, threads[i],
                                                              rate / count if rate else None, i, ready, go, results))
               for i, share in enumerate(shares)]
    for client in clients:
        client.start()
    ready.wait(timeout=600)  # every client process has warmed up
    tokens_before = _generated_tokens(urls) if "metrics" in urls else 0.0
    cpu_before = _tree_cpu_s(server_pid)
    go.set()
    records = [Record(**fields) for _ in clients for fields in results.get()]
    server_cpu_s = _tree_cpu_s(server_pid) - cpu_before
    for client in clients:
        client.join()
    time.sleep(0.2)  # the server records a request's tokens just after answering it
    tokens = _generated_tokens(urls) - tokens_before if "metrics" in urls else sum(r.tokens or 0 for r in records)
    wall = max(r.end for r in records) - min(r.start for r in records)
    streamed = [r for r in records if r.error is None and r.first is not None]
    ttft = _quantiles([(r.first - r.start) * 1e3 for r in streamed])
    for record in streamed:
        if record.tokens is None and record.text is not None and count_tokens is not None:
            record.tokens = count_tokens(record.text)
    tpot = _quantiles([(r.last - r.first) * 1e3 / (r.tokens - 1) for r in streamed if (r.tokens or 0) > 1])
    latency = _quantiles([r.end - r.start for r in records if r.error is None])
    errors = [r.error for r in records if r.error is not None]
    return {"protocol": protocol, "mode": f"c={concurrency}" if concurrency else f"rate={rate:g}/s",
            "concurrency": concurrency, "rate": rate, "requests": len(records), "errors": len(errors),
            "first_errors": errors[:3], "output_tok_s": tokens / wall, "ttft_ms": ttft, "tpot_ms": tpot,
            "latency_s": latency, "wall_s": wall, "server_cpus": server_cpu_s / wall if server_pid else None}


def _tree_cpu_s(pid: int | None) -> float:
    """CPU seconds used so far by process `pid` and its descendants (0 without a pid or psutil)."""
    try:
        import psutil
    except ImportError:
        return 0.0
    if pid is None:
        return 0.0
    total = 0.0
    try:
        root = psutil.Process(pid)
        for process in [root, *root.children(recursive=True)]:
            try:
                times = process.cpu_times()
                total += times.user + times.system
            except psutil.Error:
                pass
    except psutil.Error:
        pass
    return total


# --- the scheduler alone (in-process) --------------------------------------------------------------------------------

def token_counter(engine_dir: Path) -> Callable[[str], int]:
    """How many tokens the engine's tokenizer makes of a text (a streamed answer's, without its prompt)."""
    from exporter.engine.directory import LLM_DIR
    from exporter.llm.tokenizer import load_saved_tokenizer

    llm_dir = engine_dir / LLM_DIR
    tokenizer = load_saved_tokenizer(llm_dir, json.loads((llm_dir / "tokenizer_description.json").read_text()))
    return lambda text: len(tokenizer.encode(text))


def scheduler_only(engine_dir: Path, device: str, requests: list[BenchRequest], concurrencies: list[int]) -> dict:
    """Output tok/s of the same closed loop in-process: `TensorRTMMExporter.generate` from `c` threads."""
    import torch

    from exporter import TensorRTMMExporter
    from exporter.llm.generate import SamplingParams
    from exporter.runtime import Request

    engine = TensorRTMMExporter(engine_dir, device=device)
    engine.generate([Request(requests[0].text, requests[0].image, SamplingParams(max_output_len=2))])  # warm
    wait_for(lambda: engine.pipeline.scheduler.forward.uncaptured() == 0, "the in-process step graphs")
    result = {}
    for concurrency in concurrencies:
        share = requests[: _phase_size(concurrency, len(requests))]
        pending: queue.Queue[BenchRequest] = queue.Queue()
        for request in share:
            pending.put(request)
        tokens = [0] * concurrency

        def loop(index: int) -> None:
            while True:
                try:
                    item = pending.get_nowait()
                except queue.Empty:
                    return
                (completion,) = engine.generate([Request(item.text, item.image,
                                                         SamplingParams(max_output_len=item.max_output_len))])
                if isinstance(completion, Exception):
                    raise completion
                tokens[index] += len(completion.token_ids[0])

        started = time.monotonic()
        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(loop, range(concurrency)))
        result[concurrency] = sum(tokens) / (time.monotonic() - started)
    engine.pipeline.close()
    del engine
    if device == "cuda":
        torch.cuda.empty_cache()
    return result


def _phase_size(concurrency: int, available: int) -> int:
    return min(available, max(16, 4 * concurrency))


# --- engines ---------------------------------------------------------------------------------------------------------

def demo_engine(folder: Path, setting: Setting, device: str) -> Path:
    from exporter import TensorRTMMExporter

    TensorRTMMExporter(folder, device=device).export(
        REPO / "demo" / "neva_demo.nemo", model_type="neva", dtype="float32", max_batch_size=setting.max_batch_size,
        max_input_len=setting.max_input_len, max_output_len=setting.max_output_len,
        max_multimodal_len=setting.max_batch_size * 64, load_model=False)
    return folder


def random_engine(folder: Path, setting: Setting, words: list[str], shape: dict, dtype: str) -> Path:
    """A Neva `.nemo` of `shape` (`write_llava_nemo`) with random `dtype` weights, exported into `folder` (kept:
    later runs reuse it)."""
    import torch

    from exporter import TensorRTMMExporter

    with tempfile.TemporaryDirectory(dir=folder.parent) as tmp:
        nemo = write_llava_nemo(Path(tmp) / "random_neva.nemo", words, shape, dtype)
        tokens_per_image = (shape["vision"]["image_size"] // shape["vision"]["patch_size"]) ** 2
        TensorRTMMExporter(folder, device="cuda" if torch.cuda.is_available() else "cpu").export(
            nemo, model_type="neva", dtype=dtype, max_batch_size=setting.max_batch_size,
            max_input_len=setting.max_input_len, max_output_len=setting.max_output_len,
            max_multimodal_len=setting.max_batch_size * tokens_per_image, load_model=False)
    return folder


def write_llava_nemo(path: Path, words: list[str], shape: dict = LLAVA_SHAPE, dtype: str = "bfloat16") -> Path:
    """A Neva `.nemo` at `path` of `shape` (default LLaVA-1.5-7B's: CLIP-L/336, mlp2x_gelu, Llama-2-7B) with random
    `dtype` weights and a SentencePiece word tokenizer whose pieces are `words`' distinct words."""
    from tools.nemo_writer import write_nemo

    tokenizer = path.with_name(path.name + ".tokenizer.model")
    _train_word_tokenizer(tokenizer, words)
    try:
        write_nemo(path, _llava_config(shape, dtype), _llava_weights(shape, dtype), layout="legacy",
                   artifacts={"tokenizer.model": str(tokenizer)})
    finally:
        tokenizer.unlink()
    return path


def _train_word_tokenizer(path: Path, words: list[str]) -> None:
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(" ".join(words[i:i + 20]) for i in range(0, len(words), 20)),
                                   model_writer=model, vocab_size=len(set(words)), model_type="word", unk_id=0,
                                   bos_id=1, eos_id=2, pad_id=-1, minloglevel=2, num_threads=8)
    path.write_bytes(model.getvalue())


def _llava_config(shape: dict, dtype: str) -> dict:
    llm, vision = shape["llm"], shape["vision"]
    return {"precision": "bf16" if dtype == "bfloat16" else 32, "num_layers": llm["num_layers"],
            "hidden_size": llm["hidden_size"],
            "ffn_hidden_size": llm["ffn_hidden_size"], "num_attention_heads": llm["num_attention_heads"],
            "num_query_groups": llm["num_attention_heads"], "kv_channels": None, "normalization": "rmsnorm",
            "layernorm_epsilon": 1e-5, "activation": "fast-swiglu", "bias": False,
            "position_embedding_type": "rope", "rotary_percentage": 1.0, "rotary_base": 10000,
            "share_embeddings_and_output_weights": False, "make_vocab_size_divisible_by": 128,
            "encoder_seq_length": 4096, "max_position_embeddings": 4096,
            "tokenizer": {"library": "sentencepiece", "type": None, "model": None, "sentencepiece_legacy": True},
            "mm_cfg": {"llm": {"from_pretrained": None, "freeze": False, "model_type": "v1"},
                       "vision_encoder": {"from_pretrained": "bench/clip-l-336", "from_hf": True,
                                          "model_type": "clip", "patch_dim": vision["patch_size"],
                                          "crop_size": [vision["image_size"]] * 2, "image_size": vision["image_size"],
                                          "hidden_size": vision["hidden_size"],
                                          "num_layers": vision["num_hidden_layers"],
                                          "num_attention_heads": vision["num_attention_heads"],
                                          "ffn_hidden_size": vision["intermediate_size"], "hidden_act": "quick_gelu",
                                          "layernorm_epsilon": 1e-5, "vision_select_layer": -2,
                                          "vision_select_feature": "patch", "class_token_length": 1,
                                          "freeze": False},
                       "mm_mlp_adapter_type": "mlp2x_gelu", "use_im_start_end": False},
            "data": {"media_type": "image", "image_aspect_ratio": "square", "conv_template": "v1",
                     "image_token_len": (vision["image_size"] // vision["patch_size"]) ** 2}}


def _llava_weights(shape: dict, dtype_name: str) -> dict:
    """Random canonical weights (docs/architecture.md) drawn on the GPU (if any), in `dtype_name` on the host."""
    import torch
    from transformers import CLIPVisionConfig, CLIPVisionModel

    llm, vision = shape["llm"], shape["vision"]
    dtype = getattr(torch, dtype_name)
    hidden, ffn = llm["hidden_size"], llm["ffn_hidden_size"]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator(device).manual_seed(0)

    def rand(*size, scale=0.02):
        return (torch.randn(*size, generator=generator, device=device) * scale).to(dtype).cpu()

    weights = {"embedding.word_embeddings.weight": rand(llm["vocab_size"], hidden),
               "output_layer.weight": rand(llm["vocab_size"], hidden),
               "decoder.final_layernorm.weight": torch.ones(hidden, dtype=dtype)}
    for i in range(llm["num_layers"]):
        layer = f"decoder.layers.{i}."
        weights |= {layer + "input_layernorm.weight": torch.ones(hidden, dtype=dtype),
                    layer + "self_attention.linear_qkv.weight": rand(3 * hidden, hidden),
                    layer + "self_attention.linear_proj.weight": rand(hidden, hidden),
                    layer + "pre_mlp_layernorm.weight": torch.ones(hidden, dtype=dtype),
                    layer + "mlp.linear_fc1.weight": rand(2 * ffn, hidden),
                    layer + "mlp.linear_fc2.weight": rand(hidden, ffn)}
    torch.manual_seed(0)
    tower = CLIPVisionModel(CLIPVisionConfig(**vision, hidden_act="quick_gelu")).to(dtype)
    prefix = "embedding.word_embeddings."
    weights |= {f"{prefix}vision_encoder.vision_model.{name.removeprefix('vision_model.')}": t.detach().contiguous()
                for name, t in tower.state_dict().items()}
    projector = f"{prefix}adapter_layer.mm_projector_adapter.mm_projector."
    weights |= {projector + "0.weight": rand(hidden, vision["hidden_size"]), projector + "0.bias": rand(hidden),
                projector + "2.weight": rand(hidden, hidden), projector + "2.bias": rand(hidden)}
    return weights


def make_words(seed: int, count: int = TOKENIZER_WORDS) -> list[str]:
    """`count` distinct made-up words, each twice (the tokenizer's pieces, and the prompts' filler)."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words: set[str] = set()
    while len(words) < count:
        words.add("".join(rng.choice(letters) for _ in range(rng.randint(3, 9))))
    ordered = sorted(words)
    return ordered + ordered


# --- the server ------------------------------------------------------------------------------------------------------

def start_server(engine_dir: Path, setting: Setting, device: str, log: Path) -> tuple[subprocess.Popen, dict]:
    """`deploy_triton.py` with streaming, metrics and the OpenAI front on free loopback ports, ready."""
    from deploy.startup import free_port

    ports = {name: free_port() for name in ("http", "grpc", "metrics", "openai")}
    command = [sys.executable, str(REPO / "scripts/deploy_triton.py"), "-tmn", MODEL, "-tmr", str(engine_dir),
               "-tha", "127.0.0.1", "-trp", str(ports["http"]), "--grpc_port", str(ports["grpc"]),
               "--metrics_port", str(ports["metrics"]), "--openai_port", str(ports["openai"]),
               "-mbs", str(setting.max_batch_size), "--streaming", "--device", device]
    urls = {"http": f"127.0.0.1:{ports['http']}", "grpc": f"grpc://127.0.0.1:{ports['grpc']}",
            "metrics": f"http://127.0.0.1:{ports['metrics']}/metrics",
            "openai": f"http://127.0.0.1:{ports['openai']}/v1"}
    return _ready(command, log, urls["openai"] + "/health/ready"), urls  # the OpenAI front: only once Triton is


def start_ray_server(engine_dir: Path, device: str, replicas: int, cpus_per_replica: float,
                     log: Path) -> tuple[subprocess.Popen, dict]:
    """`deploy_ray.py` with `replicas` replicas on a local Ray cluster of just their CPUs, ready."""
    from deploy.startup import free_port

    port = free_port()
    command = [sys.executable, str(REPO / "scripts/deploy_ray.py"), "-tmn", MODEL, "-tmr", str(engine_dir),
               "--host", "127.0.0.1", "--port", str(port), "--num_replicas", str(replicas),
               "--num_cpus", str(max(1, round(replicas * cpus_per_replica))),
               "--num_cpus_per_replica", str(cpus_per_replica), "--device", device]
    urls = {"openai": f"http://127.0.0.1:{port}/v1"}
    return _ready(command, log, urls["openai"] + "/health/ready"), urls


def wait_for(done: Callable[[], bool], what: str, timeout_s: float = 900, poll_s: float = 0.5) -> None:
    """Wait until `done()` holds: the phases measure steady serving, after the step graphs the warm-up left for
    the background are captured (a first start compiles kernels for each)."""
    started = time.monotonic()
    while not done():
        if time.monotonic() - started > timeout_s:
            raise RuntimeError(f"{what} were not captured in {timeout_s:g} s")
        time.sleep(poll_s)
    print(f"{what} captured ({time.monotonic() - started:.1f} s waited)", flush=True)


def _ready(command: list[str], log: Path, ready_url: str) -> subprocess.Popen:
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_ready(process, ready_url, log, timeout_s=1200, poll_s=1)
    except RuntimeError:
        process.kill()
        raise
    return process


def wait_ready(process: subprocess.Popen, url: str, log: Path, timeout_s: float, poll_s: float) -> float:
    """Poll a server's readiness `url` every `poll_s` until it answers 200; returns `time.perf_counter()` then.
    Raises with the end of its `log` if the process exits first, or after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited; its log:\n{log.read_text()[-5000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return time.perf_counter()
        except OSError:
            time.sleep(poll_s)
    raise RuntimeError(f"the server did not become ready in {timeout_s:g} s")


# --- the table -------------------------------------------------------------------------------------------------------

def report(result: dict) -> str:
    def pair(values, scale=1.0, digits=1) -> str:
        if values is None or values[0] is None:
            return "-"
        return f"{values[0] * scale:.{digits}f} / {values[1] * scale:.{digits}f}"

    lines = [f"{result['model']} on {result['device']}, max_batch_size {result['max_batch_size']}, "
             f"{result['client_processes']} client processes",
             f"{'protocol':12} {'load':>10} {'reqs':>5} {'err':>4} {'out tok/s':>10} {'sched tok/s':>11} "
             f"{'ratio':>6} {'TTFT p50/p99 ms':>17} {'TPOT p50/p99 ms':>17} {'latency p50/p99 s':>18}  server"]
    for phase in result["phases"]:
        scheduler = result["scheduler_tok_s"].get(str(phase["concurrency"])) if phase["concurrency"] else None
        ratio = f"{phase['output_tok_s'] / scheduler:.2f}" if scheduler else "-"
        lines.append(f"{phase['protocol']:12} {phase['mode']:>10} {phase['requests']:5d} {phase['errors']:4d} "
                     f"{phase['output_tok_s']:10.1f} {(f'{scheduler:.1f}' if scheduler else '-'):>11} {ratio:>6} "
                     f"{pair(phase['ttft_ms']):>17} {pair(phase['tpot_ms'], digits=2):>17} "
                     f"{pair(phase['latency_s'], digits=3):>18}  {phase['server']}")
    return "\n".join(lines)


def scaling(result: dict) -> str:
    """Each Ray replica count's best output tok/s (over phases repeated with `--concurrency 32 32 32`: on a shared
    machine the least disturbed one) against one replica's best, per protocol and load."""
    best: dict[tuple[str, str, str], float] = {}
    for p in result["phases"]:
        key = (p["server"], p["protocol"], p["mode"])
        best[key] = max(best.get(key, 0.0), p["output_tok_s"])
    cpus = {(p["server"], p["protocol"], p["mode"], p["output_tok_s"]): p["server_cpus"] for p in result["phases"]}
    lines = [f"{'server':8} {'protocol':12} {'load':>10} {'best tok/s':>10} {'vs 1 replica':>13} {'server CPUs':>12}"]
    for (server, protocol, mode), tok_s in best.items():
        base = best.get(("ray x1", protocol, mode))
        versus = f"{tok_s / base:.2f}x" if base else "-"
        used = cpus.get((server, protocol, mode, tok_s))
        lines.append(f"{server:8} {protocol:12} {mode:>10} {tok_s:10.1f} {versus:>13} "
                     f"{(f'{used:.2f}' if used is not None else '-'):>12}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument("--demo", action="store_true", help="the bundled demo Neva (CPU unless --device cuda)")
    model.add_argument("--llava", action="store_true", help="a LLaVA-1.5-7B-shaped engine, random bf16 weights (GPU)")
    model.add_argument("--small_llm", action="store_true",
                       help="a random Neva whose 384-wide, 6-layer LLM makes decoding CPU-bound (float32)")
    parser.add_argument("--engine_dir", type=Path, help="where the engine is built, or reused if it is there")
    parser.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda with --llava, else cpu")
    parser.add_argument("--target", choices=("triton", "ray"), default="triton",
                        help="serve with deploy_triton.py (default) or deploy_ray.py (the OpenAI protocols only)")
    parser.add_argument("--ray_replicas", nargs="+", type=int, default=[1, 2], help="--target ray: replica counts")
    parser.add_argument("--ray_cpus_per_replica", type=float, default=1.0, help="--target ray: CPUs per replica")
    parser.add_argument("--protocols", nargs="+", choices=(*PROTOCOLS, OPENAI_PLAIN), default=None,
                        help=f"default: {', '.join(PROTOCOLS)} with --target triton; {OPENAI_PLAIN} (no streaming) "
                             "and openai with --target ray")
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 8, 32, 64])
    parser.add_argument("--rate", type=float, default=None, help="Poisson arrivals per second (default: none)")
    parser.add_argument("--requests", type=int, default=None,
                        help="requests per phase (default: max(16, 4 x concurrency); 64 for --rate)")
    parser.add_argument("--processes", type=int, default=min(16, os.cpu_count() or 1), help="client processes")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    ray = args.target == "ray"
    protocols = args.protocols or ([OPENAI_PLAIN, "openai"] if ray else list(PROTOCOLS))
    if ray and not set(protocols) <= {OPENAI_PLAIN, "openai"}:
        parser.error(f"--target ray serves the {OPENAI_PLAIN} and openai protocols only")
    model = "llava" if args.llava else "small_llm" if args.small_llm else "demo"
    setting, shape, words_count, dtype, title = MODELS[model]
    device = args.device or ("cuda" if args.llava else "cpu")
    words = make_words(args.seed, words_count) if shape else ["tell", "me", "more", "about", "it", "please"]
    out = Path(os.environ.get("OUT", "."))
    with tempfile.TemporaryDirectory() as tmp:
        engine_dir = args.engine_dir or Path(tmp) / "engine"
        if not (engine_dir / "manifest.json").is_file():
            engine_dir.parent.mkdir(parents=True, exist_ok=True)
            if shape:
                random_engine(engine_dir, setting, words, shape, dtype)
            else:
                demo_engine(engine_dir, setting, device)
        largest = max([*args.concurrency, 1])
        pool = make_requests(setting, args.requests or max(64, _phase_size(largest, 10**9)), args.seed, words)
        result = {"model": title, "device": device, "max_batch_size": setting.max_batch_size,
                  "client_processes": args.processes, "phases": [],
                  "scheduler_tok_s": {} if ray else {str(c): v for c, v in scheduler_only(
                      engine_dir, device, pool, args.concurrency).items()}}
        count_tokens = token_counter(engine_dir)
        servers = [(f"ray x{n}", partial(start_ray_server, engine_dir, device, n, args.ray_cpus_per_replica))
                   for n in args.ray_replicas] if ray else [("triton", partial(start_server, engine_dir, setting,
                                                                               device))]
        for label, start in servers:
            log = Path(os.environ.get("OUT", tmp)) / f"serve_bench_{label.replace(' ', '')}.log"
            server, urls = start(log)
            try:
                if device == "cuda" and not ray:
                    wait_for(lambda: any(line in log.read_text(errors="replace") for line in BACKGROUND_CAPTURED),
                             "the server's step graphs")
                loads = [{"concurrency": c} for c in args.concurrency] + ([{"rate": args.rate}] if args.rate else [])
                for protocol in protocols:
                    for load in loads:
                        count = args.requests or (_phase_size(load["concurrency"], len(pool)) if "concurrency" in load
                                                  else 64)
                        phase = run_phase(protocol, urls, pool[:count], args.processes, server_pid=server.pid,
                                          count_tokens=count_tokens, **load)
                        result["phases"].append({"server": label, **phase})
                        print(report({**result, "phases": result["phases"][-1:]}).splitlines()[-1], flush=True)
            finally:
                server.terminate()
                server.wait(120)
    (out / "serve_bench.json").write_text(json.dumps(result, indent=1))
    print(report(result))
    if ray:
        print(scaling(result))
    return result


if __name__ == "__main__":
    main()
