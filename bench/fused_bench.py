"""The decoder's fused elementwise kernels (`exporter.llm.fused_triton`) against the same work op by op, at
LLaVA-1.5-7B's shapes (hidden 4096, 32 heads of 128, FFN 11008, paged pools of 32-position blocks in bfloat16 and
float8), per call as a captured step runs them (a CUDA graph of 20 calls, replayed; the median of 5) at 1, 8 and
512 tokens, with a decode step's share (32 layers: two residual norms, the split, the activation; the final norm);
and what the first calls compiled, from an empty Triton cache (a first start) and again from the filled one (a
restart: the same kernels, loaded). Prints a table, writes ``$OUT/fused_bench.json``.

    python bench/fused_bench.py            # CUDA (the H100), under a minute
    python bench/fused_bench.py --tiny     # tiny shapes on the CPU under Triton's interpreter (timings mean nothing)
"""

from __future__ import annotations

import os
import sys

if "--tiny" in sys.argv:  # Triton reads this only when first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402

import torch  # noqa: E402
from llava_bench import bench_main  # noqa: E402

from exporter.llm import fused_triton  # noqa: E402
from exporter.llm import model as model_module  # noqa: E402
from exporter.llm.paged_attention import FP8_DTYPE  # noqa: E402

SHAPE = {"hidden": 4096, "groups": 32, "per_group": 1, "dim": 128, "ffn": 11008, "block": 32, "blocks": 80}
TINY_SHAPE = {"hidden": 64, "groups": 2, "per_group": 2, "dim": 16, "ffn": 96, "block": 4, "blocks": 40}
TOKENS, TINY_TOKENS = (1, 8, 512), (1, 8)
LAYERS = 32
COMPILE_PROBE = "--compile-probe"  # the child process that times the first calls against a given Triton cache


def _per_call_ms(run: Callable[[], object], device: torch.device, calls: int = 20) -> float:
    """One call's time: replays of a CUDA graph of `calls` calls (the median of 5), or eager calls on the CPU."""
    run()
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(3):
            run()
        return (time.perf_counter() - start) * 1e3 / 3
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            run()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def _cases(shape: dict, tokens: int, device: torch.device) -> dict[str, tuple[Callable, Callable]]:
    """name -> (the kernel's call, the op-by-op call) on random inputs of `tokens` rows."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16  # the interpreter rounds bfloat16 inexactly
    hidden, groups, per_group, dim = shape["hidden"], shape["groups"], shape["per_group"], shape["dim"]

    def rand(*size):
        return torch.randn(*size, device=device).to(dtype)

    x, delta, weight, bias = rand(tokens, hidden), rand(tokens, hidden), rand(hidden), rand(hidden)
    qkv = rand(tokens, groups * (per_group + 2) * dim)
    angles = torch.rand(tokens, 1, dim // 2, device=device) * 6
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    slots = torch.randperm(shape["blocks"] * shape["block"], device=device)[:tokens] + shape["block"]
    blocks, offsets = slots // shape["block"], slots % shape["block"]
    h = rand(tokens, 2 * shape["ffn"])
    pools = {}
    for name, pool_dtype in (("bf16", dtype), ("fp8", FP8_DTYPE)):
        pool = torch.zeros(2, shape["blocks"] + 1, groups, shape["block"], dim, dtype=pool_dtype, device=device)
        pools[name] = pool.transpose(2, 3)  # head-major, as `Decoder.new_paged_kv_cache` stores it
    scale = torch.full((2, 1, groups, 1), 0.02, device=device)
    split = (groups, per_group)
    return {
        "first norm (RMS)": (lambda: fused_triton.norm(x, None, weight, None, 1e-5, False),
                             lambda: model_module._first_norm(x, weight, None, 1e-5, False)),
        "residual + RMSNorm": (lambda: fused_triton.norm(x, delta, weight, None, 1e-5, False),
                               lambda: model_module._residual_norm(x, delta, weight, None, 1e-5, False)),
        "residual + LayerNorm": (lambda: fused_triton.norm(x, delta, weight, bias, 1e-5, False),
                                 lambda: model_module._residual_norm(x, delta, weight, bias, 1e-5, False)),
        "split + RoPE + bf16 pool": (
            lambda: fused_triton.split_heads(qkv, cos, sin, pools["bf16"], blocks, offsets, None, *split, dim),
            lambda: model_module._split_heads(qkv, cos, sin, pools["bf16"], blocks, offsets, None, *split, dim)),
        "split + RoPE + fp8 pool": (
            lambda: fused_triton.split_heads(qkv, cos, sin, pools["fp8"], blocks, offsets, scale, *split, dim),
            lambda: model_module._split_heads(qkv, cos, sin, pools["fp8"], blocks, offsets, scale, *split, dim)),
        "SiLU(gate) * up": (lambda: fused_triton.activate(h, "swiglu", True, "none"),
                            lambda: model_module._activate(h, "swiglu", True, "none")),
    }


def _op_by_op(run: Callable[[], object]) -> Callable[[], object]:
    def call():
        model_module.FUSE_ON_CUDA = False
        try:
            return run()
        finally:
            model_module.FUSE_ON_CUDA = True

    return call


def compile_probe() -> None:
    """(Child) The first call of every case at every token count, against the Triton cache in TRITON_CACHE_DIR:
    prints the seconds and Triton's compile summary."""
    from exporter.engine.kernel_cache import compile_summary, count_compiles

    count_compiles()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tiny = os.environ.get("TRITON_INTERPRET") == "1"
    start = time.perf_counter()
    for tokens in TINY_TOKENS if tiny else TOKENS:
        for kernel, _ in _cases(TINY_SHAPE if tiny else SHAPE, tokens, device).values():
            kernel()
    if device.type == "cuda":
        torch.cuda.synchronize()
    print(f"{time.perf_counter() - start:.3f}|{compile_summary()}")


def _first_calls(cache: str) -> tuple[float, str]:
    """(seconds, compile summary) of `compile_probe` in a fresh process over the Triton cache folder `cache`
    (NaN and the error's end where it failed)."""
    environment = {**os.environ, "TRITON_CACHE_DIR": cache}
    done = subprocess.run([sys.executable, __file__, COMPILE_PROBE, *sys.argv[1:]], env=environment,
                          capture_output=True, text=True, timeout=600, check=False)
    if done.returncode:
        return float("nan"), "failed: " + (done.stderr.strip().splitlines() or ["no output"])[-1][:300]
    seconds, summary = done.stdout.strip().splitlines()[-1].split("|", 1)
    return float(seconds), summary


def run(tiny: bool) -> dict:
    device = torch.device("cpu" if tiny or not torch.cuda.is_available() else "cuda")
    shape = TINY_SHAPE if tiny else SHAPE
    result: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "shape": shape}
    for tokens in TINY_TOKENS if tiny else TOKENS:
        for name, (kernel, op_by_op) in _cases(shape, tokens, device).items():
            result[f"{name} | {tokens}"] = {"kernel_us": _per_call_ms(kernel, device) * 1e3,
                                            "op_by_op_us": _per_call_ms(_op_by_op(op_by_op), device) * 1e3}
    with tempfile.TemporaryDirectory() as cache:
        for start in ("first start", "restart"):
            seconds, summary = _first_calls(cache)
            result[f"first calls, {start}"] = {"seconds": seconds, "summary": summary}
    return result


def report(result: dict) -> str:
    rows = [f"fused elementwise kernels on {result['device']} ({result['shape']})",
            f"{'work | tokens':34} {'kernel us':>10} {'op by op us':>12}"]
    step = {"kernel_us": 0.0, "op_by_op_us": 0.0}
    for key, value in result.items():
        if isinstance(value, dict) and "kernel_us" in value:
            rows.append(f"{key:34} {value['kernel_us']:10.1f} {value['op_by_op_us']:12.1f}")
            name, tokens = key.split(" | ")
            per_step = {"residual + RMSNorm": 2 * LAYERS + 1, "split + RoPE + bf16 pool": LAYERS,
                        "SiLU(gate) * up": LAYERS}.get(name, 0)
            if tokens == "1":
                for field in step:
                    step[field] += per_step * value[field]
    rows.append(f"{'a decode step (1 token, 32 layers)':34} {step['kernel_us']:10.1f} {step['op_by_op_us']:12.1f}")
    for start in ("first start", "restart"):
        value = result[f"first calls, {start}"]
        rows.append(f"first calls, {start}: {value['seconds']:.2f} s ({value['summary'] or 'nothing compiled'})")
    return "\n".join(rows)


if __name__ == "__main__":
    if COMPILE_PROBE in sys.argv:
        compile_probe()
    else:
        bench_main(__doc__, "fused_bench", run, report)
