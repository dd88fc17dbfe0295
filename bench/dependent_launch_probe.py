"""Does programmatic dependent launch (PDL) shorten a captured chain of decode-sized kernels? (CUDA, sm_90+)

A chain of 32 layers x (qkv, o, fc1, fc2) one-row bfloat16 products of LLaVA-7B's shapes (a plain Triton kernel
written here, not the engine's), each reading the previous output, captured in one CUDA graph, in three tile
shapes: launched plainly; as dependents waiting at the start; as dependents with the first weight tile loaded
before the wait (what `exporter.llm.triton_launch` does); and the last without PDL. Also a chain of 256 tiny
kernels. Writes ``$OUT/dependent_launch_probe.json``.

    python bench/dependent_launch_probe.py
"""
import json
import os
import sys

import torch
import triton
import triton.language as tl


@triton.jit
def gemv(w_ptr, x_ptr, y_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
         PREFETCH: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    w_rows = w_ptr + rows[:, None].to(tl.int64) * K
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    if PREFETCH:
        w0 = tl.load(w_rows + cols[None, :], mask=(cols < K)[None, :], other=0.0)
        w1 = tl.load(w_rows + BLOCK_K + cols[None, :], mask=(BLOCK_K + cols < K)[None, :], other=0.0)
        if PDL:
            tl.extra.cuda.gdc_wait()
        acc += w0.to(tl.float32) * tl.load(x_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)[None, :]
        acc += w1.to(tl.float32) * tl.load(x_ptr + BLOCK_K + cols, mask=BLOCK_K + cols < K,
                                           other=0.0).to(tl.float32)[None, :]
        start = 2 * BLOCK_K
    else:
        if PDL:
            tl.extra.cuda.gdc_wait()
        start = 0
    for k in range(start, K, BLOCK_K):
        ok = k + cols < K
        w = tl.load(w_rows + k + cols[None, :], mask=ok[None, :], other=0.0)
        x = tl.load(x_ptr + k + cols, mask=ok, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    tl.store(y_ptr + rows, tl.sum(acc, 1).to(y_ptr.dtype.element_ty))


@triton.jit
def tiny(x_ptr, y_ptr, N, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < N)
    tl.store(y_ptr + offs, x * 1.0001 + 0.5, mask=offs < N)


SHAPES = [(12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008)]


def chain(weights, x0, outs, pdl, prefetch, block_n, block_k, warps):
    x = x0
    for w, y in zip(weights, outs):
        n, k = w.shape
        gemv[(n // block_n,)](w, x, y, n, k, BLOCK_N=block_n, BLOCK_K=block_k, PDL=pdl, PREFETCH=prefetch,
                              num_warps=warps, launch_pdl=pdl)
        x = y
    return x


def time_graph(fn, reps=20):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            g.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / reps)
    return sorted(times)[2]


def main():
    out_dir = os.environ.get("OUT", ".")
    torch.manual_seed(0)
    dev = "cuda"
    layers = 32
    base = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5 for n, k in SHAPES]
    # distinct weights per layer (read from memory, not L2)
    weights = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5 for _ in range(layers) for n, k in SHAPES]
    del base
    outs = [torch.empty(w.shape[0], device=dev, dtype=torch.bfloat16) for w in weights]
    x0 = torch.randn(4096, device=dev, dtype=torch.bfloat16)
    total_bytes = sum(w.numel() * 2 for w in weights)
    result = {"device": torch.cuda.get_device_name(), "triton": triton.__version__, "torch": torch.__version__,
              "weights_GB": total_bytes / 1e9}
    ref = None
    for block_n, block_k, warps in ((8, 512, 4), (16, 256, 4), (4, 512, 2)):
        for pdl, prefetch in ((False, False), (True, False), (True, True), (False, True)):
            name = f"gemv n{block_n} k{block_k} w{warps} pdl={pdl} prefetch={prefetch}"
            try:
                ms = time_graph(lambda: chain(weights, x0, outs, pdl, prefetch, block_n, block_k, warps))
                y = outs[-1].float().clone()
                if ref is None:
                    ref = y
                err = float((y - ref).abs().max())
                result[name] = {"ms": ms, "TBps": total_bytes / ms / 1e9, "max_diff_vs_first": err}
            except Exception as error:  # noqa: BLE001
                result[name] = {"error": repr(error)[:400]}
            print(name, result[name], flush=True)
    xs = [torch.randn(4096, device=dev) for _ in range(257)]
    for pdl in (False, True):
        def tiny_chain():
            for i in range(256):
                tiny[(4,)](xs[i], xs[i + 1], 4096, BLOCK=1024, PDL=pdl, launch_pdl=pdl)
        name = f"tiny x256 pdl={pdl}"
        try:
            ms = time_graph(tiny_chain)
            result[name] = {"ms": ms, "us_per_kernel": ms * 1e3 / 256}
        except Exception as error:  # noqa: BLE001
            result[name] = {"error": repr(error)[:400]}
        print(name, result[name], flush=True)
    with open(os.path.join(out_dir, "dependent_launch_probe.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
