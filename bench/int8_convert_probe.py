"""int8 weight conversions inside a 32-row tensor-core tile (the decode batch of 32), against fp8 weights.

The engine's int8_wo and fp8 products at 32 rows run the same `W x^T` tile (`exporter/llm/quant/kernels.py`); with
the pure Triton int8 conversion int8's took 1.4x fp8's time (the difference is how a weight becomes bfloat16), which
is why the engine now converts with `prmt2` on CUDA. This probe runs one simplified
copy of that tile (unsplit, per-row scale at the end) in five modes:

- `exponent`: the engine's pure Triton int8 conversion, the one the interpreter runs (the byte under float32's exponent of 2**23, a subtraction, bfloat16);
- `prmt4`: the same arithmetic as inline PTX, four weights of one 32-bit word at a time (an XOR, four byte
  permutes, four subtractions, two packing conversions);
- `prmt2`: the same, two weights of a 16-bit half at a time (`kernels._int8_pairs_as_bfloat16`, what the engine's
  int8 tensor-core tiles run on CUDA). The weight operand's layout gives each thread pairs of bytes (16-bit
  shared-memory loads), so `prmt4` first spends byte permutes gathering them into words;
- `fp8`: fp8 weights through the engine's conversion;
- `f16`: the product in float16, where int8 is exact: one byte permute puts two weights under float16's exponent
  of 1024, an XOR and one packed subtraction finish them; the activations are converted to float16 (a quarter as
  many values as the weights at 32 rows).

On CUDA it times each mode on LLaVA-1.5-7B's four product shapes at two tile shapes (`gemv.measure_ms`: from a CUDA
graph, the weight evicted from the L2 cache) and checks the int8 modes against float32 dequantize-then-matmul.
`--tiny` (CPU, no GPU): compiles each mode for sm_90 with Triton's own ptxas and counts the SASS instructions a
weight in the K loop (inline PTX cannot run under Triton's interpreter, so there is no numeric check on the CPU).
Writes `$OUT/int8_convert_probe.json`.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from exporter.llm.quant.kernels import _exact_float, _int8_pairs_as_bfloat16  # noqa: E402  (the engine's conversions)

MODES = {"exponent": 0, "prmt4": 1, "prmt2": 2, "fp8": 3, "f16": 4}
SHAPES = ((12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008))  # qkv, o, fc1 (gate; up), fc2
TILES = ((128, 256, 8, 3), (64, 256, 4, 3))  # (BLOCK_N, BLOCK_K, warps, stages), BLOCK_M 32
ROWS = 32


@triton.jit
def _int8_word_as_bfloat16(w):
    """Four int8 weights of a 32-bit word as four exact bfloat16: XOR 0x80 gives w + 128 as unsigned bytes, each put
    under float32's exponent of 2**23 by a byte permute, less 2**23 + 128, packed two a register."""
    return tl.inline_asm_elementwise(
        """{
        .reg .b32 t, f0, f1, f2, f3;
        xor.b32 t, $2, 0x80808080;
        prmt.b32 f0, t, 0x4B000000, 0x7650;
        prmt.b32 f1, t, 0x4B000000, 0x7651;
        prmt.b32 f2, t, 0x4B000000, 0x7652;
        prmt.b32 f3, t, 0x4B000000, 0x7653;
        sub.f32 f0, f0, 0f4B000080;
        sub.f32 f1, f1, 0f4B000080;
        sub.f32 f2, f2, 0f4B000080;
        sub.f32 f3, f3, 0f4B000080;
        cvt.rn.bf16x2.f32 $0, f1, f0;
        cvt.rn.bf16x2.f32 $1, f3, f2;
        }""", "=r,=r,r", [w], dtype=tl.bfloat16, is_pure=True, pack=4)


@triton.jit
def _int8_pair_as_float16(w):
    """Two int8 weights of a 16-bit half as two float16 (exact): each byte put under float16's exponent of 1024 by
    one byte permute, XOR 0x80 for w + 128, less 1152 in one packed subtraction."""
    return tl.inline_asm_elementwise(
        """{
        .reg .b32 t, h, c;
        cvt.u32.u16 t, $1;
        prmt.b32 h, t, 0x64646464, 0x5140;
        xor.b32 h, h, 0x00800080;
        mov.b32 c, 0x64806480;
        sub.rn.f16x2 $0, h, c;
        }""", "=r,h", [w], dtype=tl.float16, is_pure=True, pack=2)


@triton.jit
def _tile_kernel(x_ptr, w_ptr, s_ptr, y_ptr, N, K, MODE: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y[:BLOCK_M] = x W^T * s for BLOCK_N weight rows a program, computed as `W x^T` (N, K multiples of the tile)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    tokens = tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + tokens[:, None] * K + cols[None, :])
        w = tl.load(w_ptr + rows[:, None] * K + cols[None, :], eviction_policy="evict_first")
        if MODE == 0:  # as `kernels._weight_tile` converts int8
            weights = _exact_float((w.to(tl.uint8, bitcast=True) ^ 128).to(tl.int32), 128.0).to(tl.bfloat16)
        elif MODE == 1:
            weights = _int8_word_as_bfloat16(w)
        elif MODE == 2:
            weights = _int8_pairs_as_bfloat16(w)
        elif MODE == 3:
            weights = w.to(tl.float32).to(tl.bfloat16)
        else:
            weights = _int8_pair_as_float16(w)
            x = x.to(tl.float16)
        acc = tl.dot(weights, tl.trans(x), acc)
    y = tl.trans(acc) * tl.load(s_ptr + rows)[None, :]
    tl.store(y_ptr + tokens[:, None] * N + rows[None, :], y.to(tl.bfloat16))


def _sass_a_weight(mode: int, tile: tuple[int, int, int, int]) -> tuple[float, dict[str, int], int]:
    """SASS instructions a weight in the K loop of `mode` compiled for sm_90, the loop's commonest instructions,
    and the shared memory a program."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    block_n, block_k, warps, stages = tile
    signature = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv" if mode == MODES["fp8"] else "*i8", "s_ptr": "*fp32",
                 "y_ptr": "*bf16", "N": "i32", "K": "i32"} | dict.fromkeys(("MODE", "BLOCK_M", "BLOCK_N", "BLOCK_K"),
                                                                         "constexpr")
    source = ASTSource(fn=_tile_kernel, signature=signature,
                       constexprs={"MODE": mode, "BLOCK_M": ROWS, "BLOCK_N": block_n, "BLOCK_K": block_k},
                       attrs={(i,): [["tt.divisibility", 16]] for i in range(6)})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps, "num_stages": stages})
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        listing = subprocess.run([str(tools / "cuobjdump"), "-sass", cubin.name], capture_output=True, text=True,
                                 check=True).stdout
    code = [re.sub(r"^\s+/\*[0-9a-f]{4}\*/\s+", "", line).split(";")[0]
            for line in listing.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", line)]
    products = [i for i, line in enumerate(code) if "GMMA" in line or "HMMA" in line]
    first, last = products[0], products[-1]  # widened to the loop's branches
    while first > 0 and "BRA" not in code[first - 1]:
        first -= 1
    while last < len(code) - 1 and "BRA" not in code[last]:
        last += 1
    loop = code[first:last + 1]
    names = collections.Counter(line.split()[1] if line.startswith("@") else line.split()[0] for line in loop)
    weights_a_thread = block_n * block_k / (32 * warps)
    return len(loop) / weights_a_thread, dict(names.most_common(8)), compiled.metadata.shared


def _time_modes() -> dict[str, dict]:
    """Each mode's time and relative error (int8 modes) on each shape and tile, on CUDA."""
    from exporter.llm import gemv

    results = {}
    generator = torch.Generator("cuda").manual_seed(0)
    for n, k in SHAPES:
        x = torch.randn(ROWS, k, device="cuda", dtype=torch.bfloat16, generator=generator)
        int8 = torch.randint(-128, 128, (n, k), device="cuda", dtype=torch.int8, generator=generator)
        fp8 = (torch.randn(n, k, device="cuda", generator=generator) * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
        scale = torch.rand(n, device="cuda", generator=generator) * 1e-2
        reference = x.float() @ (int8.float() * scale[:, None]).T
        for block_n, block_k, warps, stages in TILES:
            for mode, code in MODES.items():
                y = torch.empty(ROWS, n, device="cuda", dtype=torch.bfloat16)

                def run(w=fp8 if mode == "fp8" else int8, y=y, code=code, block_n=block_n, block_k=block_k,
                        warps=warps, stages=stages):
                    _tile_kernel[(n // block_n,)](x, w, scale, y, n, k, MODE=code, BLOCK_M=ROWS, BLOCK_N=block_n,
                                                  BLOCK_K=block_k, num_warps=warps, num_stages=stages)

                run()
                error = None if mode == "fp8" else ((y.float() - reference).norm() / reference.norm()).item()
                ms = statistics.median(gemv.measure_ms(run) for _ in range(3))
                key = f"{n}x{k} tile {block_n}x{block_k} w{warps} s{stages} {mode}"
                results[key] = {"us": ms * 1e3, "relative_error": error}
                print(f"{key:45s} {ms * 1e3:8.1f} us" + ("" if error is None else f"   error {error:.1e}"),
                      flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="CPU: sm_90 SASS counts only, no timing")
    arguments = parser.parse_args()
    report: dict[str, object] = {"sass_a_weight": {}}
    print("int8 conversions, SASS a weight in the K loop (sm_90, 32 rows):")
    for tile in TILES:
        for mode, code in MODES.items():
            count, names, shared = _sass_a_weight(code, tile)
            key = f"tile {tile[0]}x{tile[1]} w{tile[2]} s{tile[3]} {mode}"
            report["sass_a_weight"][key] = {"instructions": count, "commonest": names, "shared_bytes": shared}
            print(f"  {key:32s} {count:5.2f}  {names}")
    if not arguments.tiny:
        report["device"] = torch.cuda.get_device_name()
        report["timings"] = _time_modes()
    Path(os.environ.get("OUT", "."), "int8_convert_probe.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
