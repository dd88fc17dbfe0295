"""Could a long prompt's prefill run beside decoding rows on a second CUDA stream instead of inside their steps?

Issue 14 asks for two things at once while a 16k-position prompt is prefilled beside 16 decoding rows: the rows'
per-token p99 within 2x of decoding alone, and the prompt's TTFT within 1.3x of its prefill alone. With one step at a
time (the scheduler's mixed steps) a step held to L times the rows' own adds at most (L - 1) of it in prompt work, so
the prompt's TTFT is at least about 0.75 L / (L - 1) times its own at 384-position chunks, 1.5x at L = 2
(docs/performance.md, twelfth round, corrected in the fourteenth). A decode step of a few rows reads the weights at
the memory's speed and leaves the tensor cores idle; a long chunk's products are bound by compute. This probe
measures how much the two slow each other when they run at the same time on two streams.

Raw torch on LLaVA-1.5-7B's decoder shapes with random bf16 weights shared by both (no paged cache, no scheduler):
a decode step of ``--rows`` rows (products, SDPA over ``--context`` cached positions each) and a prefill chunk of
``--chunk`` positions (products, SDPA of its queries over ``--prefix`` keys); the decode step is replayed from a
CUDA graph, the chunk launched eagerly (``--eager``: two graphs replayed on two streams at once hung on an H100, with
torch 2.11). Times: each alone; then decode steps queued back to back on a high-priority stream and chunks back to
back on a low-priority one (and again with both streams at the default priority): the decode steps' p50 / p99 while
chunks run, against alone, and the chunks' time each, against alone. Writes ``$OUT/stream_overlap_probe.json``.
A watchdog (``--watchdog_s``) prints the stacks and exits if a run hangs.

    python bench/stream_overlap_probe.py                  # CUDA, about 20 s on an H100
    python bench/stream_overlap_probe.py --chunk 2048 --prefix 14336
    python bench/stream_overlap_probe.py --tiny           # tiny shapes on the CPU, eagerly: checks that it runs
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from llava_bench import save_result
from torch import Tensor

FULL = dict(layers=32, hidden=4096, intermediate=11008, heads=32, vocab=32000)
TINY = dict(layers=2, hidden=64, intermediate=172, heads=4, vocab=128)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


class Shapes:
    """Random decoder weights (qkv, o, fc1 as [gate; up], fc2 per layer; the head) on ``device``."""

    def __init__(self, config: dict, device: torch.device, dtype: torch.dtype):
        hidden, inter = config["hidden"], config["intermediate"]
        self.hidden, self.inter, self.heads = hidden, inter, config["heads"]
        self.head_dim = hidden // self.heads
        make = lambda rows, cols: torch.randn(rows, cols, device=device, dtype=dtype) * 0.02  # noqa: E731
        self.layers = [dict(qkv=make(3 * hidden, hidden), o=make(hidden, hidden), fc1=make(2 * inter, hidden),
                            fc2=make(hidden, inter)) for _ in range(config["layers"])]
        self.head = make(config["vocab"], hidden)

    def forward(self, x: Tensor, keys: Tensor) -> Tensor:
        """``x [N, hidden]`` through every layer; each layer's queries attend to ``keys [B, heads, S, d]`` (also
        the values), B = N with one query a row (decode) or B = 1 with N queries (a chunk)."""
        rows = x.shape[0]
        for weights in self.layers:
            q = (x @ weights["qkv"].T)[:, : self.hidden]
            if keys.shape[0] == rows:  # decode: one query per row
                attended = F.scaled_dot_product_attention(q.reshape(rows, self.heads, 1, self.head_dim), keys, keys)
            else:  # a chunk: the rows are one sequence's queries
                q = q.reshape(1, rows, self.heads, self.head_dim).transpose(1, 2)
                attended = F.scaled_dot_product_attention(q, keys, keys).transpose(1, 2)
            x = x + attended.reshape(rows, self.hidden) @ weights["o"].T
            gate_up = x @ weights["fc1"].T
            x = x + (F.silu(gate_up[:, : self.inter]) * gate_up[:, self.inter:]) @ weights["fc2"].T
        return x


def captured(fn: Callable[[], Tensor]) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph


def replays(launch: Callable[[], object], stream: torch.cuda.Stream, count: int) -> list[torch.cuda.Event]:
    """Queue ``count`` launches (a graph's replay, or the eager function) on ``stream``: events before the first
    and after each."""
    events = [torch.cuda.Event(enable_timing=True) for _ in range(count + 1)]
    with torch.cuda.stream(stream):
        events[0].record()
        for index in range(count):
            launch()
            events[index + 1].record()
    return events


def gaps_ms(events: list[torch.cuda.Event]) -> list[float]:
    return [a.elapsed_time(b) for a, b in zip(events, events[1:])]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]


def together(decode: Callable[[], object], chunk: Callable[[], object], decode_stream: torch.cuda.Stream,
             chunk_stream: torch.cuda.Stream, chunks: int, steps: int) -> dict:
    """Decode steps queued on one stream, then chunks on the other: the steps that ran while chunks did (queued
    in this order, eager chunks launched by the host still run beside graph-replayed steps)."""
    torch.cuda.synchronize()
    decode_events = replays(decode, decode_stream, steps)
    log(f"{steps} decode steps queued")
    chunk_events = replays(chunk, chunk_stream, chunks)
    log(f"{chunks} chunks queued")
    torch.cuda.synchronize()
    chunks_ms = chunk_events[0].elapsed_time(chunk_events[-1])
    since_chunks = [chunk_events[0].elapsed_time(event) for event in decode_events]
    during = [end - start for start, end in zip(since_chunks, since_chunks[1:]) if 0 <= start and end <= chunks_ms]
    return {"chunk_ms_each": chunks_ms / chunks, "decode_steps_during": len(during),
            "decode_p50_ms": statistics.median(during) if during else None,
            "decode_p99_ms": percentile(during, 0.99) if during else None}


def run(args: argparse.Namespace) -> dict:
    tiny = args.tiny or not torch.cuda.is_available()
    device = torch.device("cpu" if tiny else "cuda")
    dtype = torch.float32 if tiny else torch.bfloat16
    config = TINY if tiny else FULL
    rows, context, chunk_len, prefix = ((2, 8, 16, 32) if tiny else (args.rows, args.context, args.chunk, args.prefix))
    log(f"building {config['layers']} layers on {device}")
    shapes = Shapes(config, device, dtype)
    heads, head_dim = shapes.heads, shapes.head_dim
    decode_x = torch.randn(rows, shapes.hidden, device=device, dtype=dtype)
    decode_keys = torch.randn(rows, heads, context, head_dim, device=device, dtype=dtype)
    chunk_x = torch.randn(chunk_len, shapes.hidden, device=device, dtype=dtype)
    chunk_keys = torch.randn(1, heads, prefix + chunk_len, head_dim, device=device, dtype=dtype)
    decode_fn = lambda: shapes.forward(decode_x, decode_keys) @ shapes.head.T  # noqa: E731
    chunk_fn = lambda: shapes.forward(chunk_x, chunk_keys)  # noqa: E731
    result: dict = {"device": str(device) if tiny else torch.cuda.get_device_name(), "rows": rows,
                    "context": context, "chunk": chunk_len, "prefix": prefix}
    if tiny:
        result["decode_shape"] = list(decode_fn().shape)
        result["chunk_shape"] = list(chunk_fn().shape)
        return result
    decode = decode_fn if args.eager == "all" else captured(decode_fn).replay
    chunk = chunk_fn if args.eager in ("all", "chunk") else captured(chunk_fn).replay
    log(f"eager: {args.eager}")
    low, high = torch.cuda.Stream.priority_range()
    streams = {"priority": (torch.cuda.Stream(priority=high), torch.cuda.Stream(priority=low)),
               "same_priority": (torch.cuda.Stream(), torch.cuda.Stream())}
    for _ in range(2):  # the second round is kept
        decode_events = replays(decode, streams["priority"][0], args.steps)
        torch.cuda.synchronize()
        chunk_events = replays(chunk, streams["priority"][1], args.chunks)
        torch.cuda.synchronize()
    alone, chunk_alone = gaps_ms(decode_events), statistics.median(gaps_ms(chunk_events))
    result.update(decode_alone_p50_ms=statistics.median(alone), decode_alone_p99_ms=percentile(alone, 0.99),
                  chunk_alone_ms=chunk_alone)
    log(f"alone: decode {result['decode_alone_p50_ms']:.2f} ms, chunk {chunk_alone:.2f} ms")
    for name in args.modes:
        decode_stream, chunk_stream = streams[name]
        steps = args.steps_beside or int(args.chunks * chunk_alone / result["decode_alone_p50_ms"] * 3)
        measured = together(decode, chunk, decode_stream, chunk_stream, args.chunks, steps)
        measured["decode_p99_over_alone"] = (measured["decode_p99_ms"] or 0.0) / result["decode_alone_p50_ms"]
        measured["chunk_over_alone"] = measured["chunk_ms_each"] / chunk_alone
        result[name] = measured
        log(f"{name}: {json.dumps(measured)}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU, eagerly (no timing value)")
    parser.add_argument("--rows", type=int, default=16, help="decoding rows")
    parser.add_argument("--context", type=int, default=700, help="cached positions of each decoding row")
    parser.add_argument("--chunk", type=int, default=512, help="positions of a prefill chunk")
    parser.add_argument("--prefix", type=int, default=8192, help="positions cached before the chunk")
    parser.add_argument("--steps", type=int, default=50, help="decode steps timed alone")
    parser.add_argument("--chunks", type=int, default=20, help="chunks queued beside the decode steps")
    parser.add_argument("--modes", nargs="+", choices=["priority", "same_priority"],
                        default=["priority", "same_priority"], help="stream pairs to run beside each other, in order")
    parser.add_argument("--eager", choices=["none", "chunk", "all"], default="chunk",
                        help="which launch their kernels eagerly instead of as a CUDA graph (default: the chunks; "
                             "two graphs replayed on two streams at once hung on an H100)")
    parser.add_argument("--watchdog_s", type=float, default=300.0,
                        help="print every thread's stack and exit when the probe runs this long (0: never)")
    parser.add_argument("--steps_beside", type=int, default=0,
                        help="decode steps queued beside them (default: about 3x the chunks' time alone)")
    args = parser.parse_args()
    if args.watchdog_s:
        faulthandler.dump_traceback_later(args.watchdog_s, exit=True)
    result = run(args)
    save_result("stream_overlap_probe", result)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
