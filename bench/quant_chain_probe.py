"""int8 / fp8 one-row products in a captured chain (32 layers x qkv, o, fc1, fc2 of LLaVA-7B, fc2 not gated): the
engine's `fused_linear` (autotuned, whole K and split) against a plain kernel written here in ten tile shapes, its
int8 converted by `.to(float32)` or by the engine's inline PTX, launched plainly, as a programmatic dependent with
its first weight tile before the wait, or with the weight loads marked evict-first. Writes
``$OUT/quant_chain_probe.json``. (CUDA, sm_90+.)

    python bench/quant_chain_probe.py
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from dependent_launch_probe import time_graph  # noqa: E402

from exporter.llm.quant import kernels as qk  # noqa: E402
from exporter.llm.quant.formats import QuantLayout  # noqa: E402


@triton.jit
def qgemv(w_ptr, s_ptr, x_ptr, y_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
          PREFETCH: tl.constexpr, PTX: tl.constexpr, EVICT: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    w_rows = w_ptr + rows[:, None].to(tl.int64) * K
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    start = 0
    if PREFETCH:
        w0 = tl.load(w_rows + cols[None, :], mask=(cols < K)[None, :], other=0.0)
        if PDL:
            tl.extra.cuda.gdc_wait()
        if PTX:
            f0 = qk._int8_words_as_float32(w0)
        else:
            f0 = w0.to(tl.float32)
        acc += f0 * tl.load(x_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)[None, :]
        start = BLOCK_K
    else:
        if PDL:
            tl.extra.cuda.gdc_wait()
    for k in range(start, K, BLOCK_K):
        ok = k + cols < K
        if EVICT:
            w = tl.load(w_rows + k + cols[None, :], mask=ok[None, :], other=0.0, eviction_policy="evict_first")
        else:
            w = tl.load(w_rows + k + cols[None, :], mask=ok[None, :], other=0.0)
        x = tl.load(x_ptr + k + cols, mask=ok, other=0.0).to(tl.float32)
        if PTX:
            f = qk._int8_words_as_float32(w)
        else:
            f = w.to(tl.float32)
        acc += f * x[None, :]
    y = tl.sum(acc, 1) * tl.load(s_ptr + rows).to(tl.float32)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty))


SHAPES = [(12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008)]


def main():
    out_dir = os.environ.get("OUT", ".")
    torch.manual_seed(0)
    dev = "cuda"
    layers = int(os.environ.get("LAYERS", 32))
    result = {"device": torch.cuda.get_device_name(), "triton": triton.__version__}
    tiles = [(8, 512, 4), (4, 1024, 4), (8, 1024, 4), (16, 512, 4), (8, 1024, 8), (16, 1024, 8), (4, 2048, 8),
             (32, 256, 4), (16, 256, 4), (32, 512, 8)]
    for method in ("int8_wo", "fp8"):
        dtype = torch.int8 if method == "int8_wo" else torch.float8_e4m3fn
        weights, scales = [], []
        for _ in range(layers):
            for n, k in SHAPES:
                if dtype == torch.int8:
                    weights.append(torch.randint(-127, 128, (n, k), device=dev, dtype=torch.int8))
                else:
                    weights.append((torch.randn(n, k, device=dev) * 30).to(dtype))
                scales.append(torch.full((n,), 1.0 / (30 * k**0.5), device=dev, dtype=torch.bfloat16))
        outs = [torch.empty(w.shape[0], device=dev, dtype=torch.bfloat16) for w in weights]
        x0 = torch.randn(4096, device=dev, dtype=torch.bfloat16)
        total = sum(w.numel() for w in weights)
        result[f"{method} GB"] = total / 1e9

        inputs = {k: torch.randn(1, k, device=dev, dtype=torch.bfloat16) for k in (4096, 11008)}

        def engine_chain(split=False):
            for w, s in zip(weights, scales):
                layout = QuantLayout(method, w.shape[0], w.shape[1])
                qk.fused_linear(inputs[w.shape[1]], layout, w, s, split=split)

        def engine_split_chain():
            engine_chain(True)

        ref = None
        for name, fn in (("engine fused", engine_chain), ("engine split", engine_split_chain)):
            try:
                ms = time_graph(fn)
                result[f"{method} {name}"] = {"ms": ms, "TBps": total / ms / 1e9}
            except Exception as error:  # noqa: BLE001
                result[f"{method} {name}"] = {"error": repr(error)[:300]}
            print(method, name, result[f"{method} {name}"], flush=True)
        ptx_modes = (False, True) if dtype == torch.int8 else (False,)
        for block_n, block_k, warps in tiles:
            for ptx in ptx_modes:
                for pdl, prefetch, evict in ((False, False, False), (True, True, False), (False, False, True)):
                    name = f"{method} plain n{block_n} k{block_k} w{warps} ptx={ptx} pdl={pdl} evict={evict}"

                    def chain():
                        x = x0
                        for w, s, y in zip(weights, scales, outs):
                            n, k = w.shape
                            qgemv[(n // block_n,)](w, s, x, y, n, k, BLOCK_N=block_n, BLOCK_K=block_k, PDL=pdl,
                                                   PREFETCH=prefetch, PTX=ptx, EVICT=evict, num_warps=warps,
                                                   launch_pdl=pdl)
                            x = y
                    try:
                        ms = time_graph(chain)
                        y = outs[-1].float().clone()
                        ref = y if ref is None else ref
                        result[name] = {"ms": ms, "TBps": total / ms / 1e9,
                                        "diff": float((y - ref).abs().max() / ref.abs().max())}
                    except Exception as error:  # noqa: BLE001
                        result[name] = {"error": repr(error)[:300]}
                    print(name, result[name], flush=True)
        weights.clear()
        outs.clear()
        torch.cuda.empty_cache()
        with open(os.path.join(out_dir, "quant_chain_probe.json"), "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
