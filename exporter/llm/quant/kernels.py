"""Matrix products with quantized weights: `y = x W^T (+ b)` where W is stored as `formats.QuantLayout` says.

On CUDA (with Triton) each product has candidates, and the first call of each (method, weight shape, dtype, row
bucket) times them and keeps the fastest (`gemv.fastest`), so a candidate can only help:

- `fused`: one Triton kernel dequantizes each weight tile in registers and multiplies it, each program one output
  tile over the whole of K. Up to 8 rows (decode) it accumulates with FMAs; more rows use tensor cores (`tl.dot`
  of `W x^T`, the converted weight tile wgmma's register operand on Hopper), and so do the `fused_mma` /
  `split_mma` candidates of 2 to 8 rows (rows padded to a 16-row tile). Autotuned per (N, K, group, rows) over a
  focused space of tile shapes. int4 has only the 2-to-8-row tensor-core tiles of it
  (`packed` is faster elsewhere, or dequantize + cuBLAS above 64 rows).
- `split` (up to 64 rows): the same kernel with K split over SPLIT_K programs per output tile (a decode step or a
  32-row batch has too few output tiles to keep every SM streaming), each storing its float32 partial sum; the
  slice that finishes last (its ticket from a counter of the weight's, `_tickets`) adds the partials in slice
  order, adds the bias and stores the tile in the activation dtype, and sets the counter back to zero: one kernel
  a product, its sums in a fixed order (the same output every run). SPLIT_K and the tile are autotuned.
- `packed`, `packed_split` (int4, up to 64 rows): tensor-core tiles of a copy of the weight repacked so that one
  shift and mask of a tile of words gives a whole group (`pack_int4_words`), kept as tinygemm's copy is.
- `dequant`: a Triton kernel writes the whole weight in the activation dtype, then cuBLAS multiplies.
- `tinygemm` (int4 with bfloat16 activations, up to 8 rows, on CUDA builds of torch that have it): torch's
  `_weight_int4pack_mm` on a copy of the weight repacked into its tiled layout when first timed. The copy is
  dropped if the product chose another candidate, else kept while the weight lives (int4 weights that chose it
  take their bytes twice).
- `scaled_mm` (FP8 weights on GPUs with FP8, sm_89+): one Triton kernel quantizes the activations to e4m3 per row
  (a program a row: its amax, then the scaled values cast) and `torch._scaled_mm` runs the product on FP8 tensor cores
  (per-row activation and per-channel weight scales).

fc2 of a SwiGLU MLP (`gated_silu`) has each Triton candidate twice: computing `silu(gate) * up` as it reads its
`[gate; up]` input (every output tile's program computes it again), and as `act+<name>`, the activation kernel
first, then the plain kernel (`gemv.activation_first`); the others run the activation kernel first.

The kernels read int4 weights as int32 words of eight nibbles (nibble i of word w is column 8w + i, the stored
byte order), and turn int4 and int8 values into floats with exponent bit tricks (an OR and a subtraction, exact)
rather than conversion instructions, which run at a fraction of the FMA rate; int8 tensor-core tiles of bfloat16
activations do the same in inline PTX, two weights a byte permute (`_int8_pairs_as_bfloat16`), and so do the
int8 FMA tiles, four weights of a word (`_int8_words_as_float32`).

Everywhere else (CPU, no Triton) the reference runs: `formats.dequantize`, then `F.linear`. Nothing here syncs
with the host once a key's choice is made (made outside graph capture: the capture's warm-up runs come first), so
all of it can be captured in CUDA graphs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from ..gemv import ACTIVATION_FIRST, activation_first, chosen, fastest, measure_ms, register_tuned
from ..triton_launch import INTERPRETED, dependent_launch
from .formats import FP8_MAX, QuantLayout, dequantize

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton (CPU-only installs): the reference everywhere
    triton = None

DECODE_ROWS = 8  # up to this many rows the fused kernel accumulates with FMAs; more use tensor cores
SPLIT_ROWS = 64  # above this many rows the output tiles alone fill the GPU: no split-K candidate
# copy -> the candidates that read it: a weight's tensors in a form only they read ("tinygemm": an int4 weight in
# torch's tiled layout and its scales and offsets, "packed": `pack_int4_words`, "scaled_mm": an fp8 weight's scales
# in float32, as `_scaled_mm` takes them, so a product does not cast them each call)
_COPY_READERS = {"tinygemm": ("tinygemm",), "packed": ("packed", "packed_split"), "scaled_mm": ("scaled_mm",)}
# copy name -> {weight -> its copy}, made when a reader first runs (by identity: a tensor's == is elementwise)
_COPIES = {name: WeakIdKeyDictionary() for name in _COPY_READERS}
# copy name -> {weight -> how its copy is made from it: make(weight)} (for `remake_copies`)
_MAKERS = {name: WeakIdKeyDictionary() for name in _COPY_READERS}
# copy name -> the weights some product chose a reader of that copy for (-> True): those copies stay (a captured
# graph may read them)
_COPIES_KEPT = {name: WeakIdKeyDictionary() for name in _COPY_READERS}


def quantized_linear(x: Tensor, layout: QuantLayout, weight: Tensor, scale: Tensor, zero: Tensor | None = None,
                     input_scale: Tensor | None = None, bias: Tensor | None = None,
                     gated_silu: Callable[[Tensor], Tensor] | None = None) -> Tensor:
    """`x [..., K]` times the stored weight (the tensors `formats.quantize` made), plus `bias`: `[..., N]`.
    `gated_silu`: `x` is a gated MLP's `[gate; up]` (`[..., 2K]`), the input `silu(gate) * up`, which
    `gated_silu(x)` computes for the candidates that do not compute it as they read x."""
    if triton is None or not x.is_cuda:
        return reference_linear(x if gated_silu is None else gated_silu(x), layout, weight, scale, zero,
                                input_scale, bias)
    flat = x.reshape(-1, x.shape[-1])
    if not flat.is_contiguous():
        flat = flat.contiguous()
    capability = _capability(x.device.index if x.device.index is not None else torch.cuda.current_device())
    found = candidates(flat, layout, weight, scale, zero, input_scale, bias, capability, gated_silu)
    key = (layout.method, layout.out_features, layout.in_features, layout.group, x.dtype, _row_bucket(flat.shape[0]),
           *(("gated",) if gated_silu is not None else ()))
    out = fastest(key, found, "dequant")
    _settle_copies(weight, key)
    return out.view(*x.shape[:-1], layout.out_features)


def candidates(x: Tensor, layout: QuantLayout, weight: Tensor, scale: Tensor, zero: Tensor | None,
               input_scale: Tensor | None, bias: Tensor | None, capability: tuple[int, int],
               gated_silu: Callable[[Tensor], Tensor] | None = None) -> dict:
    """The equivalent ways to compute the product of `x [M, K]` (contiguous, CUDA; `[M, 2K]` with `gated_silu`,
    as `quantized_linear` says) on a GPU of `capability`, by name: what `quantized_linear` times (and
    `bench/quant_kernel_probe.py`)."""
    rows, fp8_gpu, gated = x.shape[0], capability >= (8, 9), gated_silu is not None
    tensors = (weight, scale, zero, input_scale, bias)

    def activated(product, *args, **kwargs):  # a candidate that takes silu(gate) * up made by gated_silu
        if not gated:
            return functools.partial(product, x, *args, **kwargs)
        return lambda: product(gated_silu(x), *args, **kwargs)

    triton_reads_weight = layout.method != "fp8" or fp8_gpu  # Triton converts float8 e4m3 on sm_89+ only
    found = {"dequant": activated(_dequant_linear, layout, *tensors, on_device=triton_reads_weight)}
    products = _triton_products(layout, tensors, rows) if triton_reads_weight else {}
    found.update({name: functools.partial(product, x, gated=gated) for name, product in products.items()})
    if gated:  # the activation kernel, then the plain kernel: faster where many programs would compute the gate
        found.update(activation_first(products, x, gated_silu))
    if capability >= (8, 0) and rows <= DECODE_ROWS and _tinygemm_fits(layout, x):  # slower above (the probe)
        found["tinygemm"] = activated(_tinygemm_linear, layout, *tensors)
    if (layout.method == "fp8" and fp8_gpu and x.dtype == torch.bfloat16
            and layout.in_features % 16 == 0 and layout.out_features % 16 == 0):
        found["scaled_mm"] = activated(_fp8_scaled_mm, weight, scale, bias)
    return found


def _triton_products(layout: QuantLayout, tensors: tuple, rows: int) -> dict[str, Callable[..., Tensor]]:
    """The Triton candidates of a product of `rows` rows, by name: each `product(x, gated=...)`.

    int4 takes the packed kernel up to 64 rows and the word-tile kernel only as 2-to-8-row tensor-core tiles: the
    H100 probe (`bench/results/quant_kernel_probe_h100_fifth.json`) found its FMA and split tiles slower than the
    packed ones at 1 and 32 rows on every LLaVA shape, and its whole-K kernel 2.5 to 3.5x slower than dequantize +
    cuBLAS at 608 rows; leaving them out saves compiling and timing them."""
    def kernel(function, **options):
        return functools.partial(function, layout=layout, weight=tensors[0], scale=tensors[1], zero=tensors[2],
                                 input_scale=tensors[3], bias=tensors[4], **options)

    found = {}
    if not layout.int4:
        found["fused"] = kernel(fused_linear)
        if rows <= SPLIT_ROWS:
            found["split"] = kernel(fused_linear, split=True)
    if 1 < rows <= DECODE_ROWS:  # a few rows: the tensor-core tiles too (rows padded to 16)
        found["fused_mma"] = kernel(fused_linear, dot=True)
        found["split_mma"] = kernel(fused_linear, split=True, dot=True)
    if layout.int4 and rows <= SPLIT_ROWS:  # tensor-core tiles of a repacked copy (rows padded to 16)
        found["packed"] = kernel(packed_linear)
        found["packed_split"] = kernel(packed_linear, split=True)
    return found


def reference_linear(x: Tensor, layout: QuantLayout, weight: Tensor, scale: Tensor, zero: Tensor | None = None,
                     input_scale: Tensor | None = None, bias: Tensor | None = None) -> Tensor:
    """Dequantize, then `F.linear` in the activation dtype: the CPU path and what the kernels must equal."""
    if input_scale is not None:
        x = x * input_scale
    return F.linear(x, dequantize(layout, weight, scale, zero, x.dtype), bias)


def fused_linear(x: Tensor, layout: QuantLayout, weight: Tensor, scale: Tensor, zero: Tensor | None = None,
                 input_scale: Tensor | None = None, bias: Tensor | None = None,
                 config: dict[str, int] | None = None, split: bool = False, dot: bool | None = None,
                 gated: bool = False) -> Tensor:
    """The fused Triton kernel on `x [M, K]` (contiguous); `split`: K split over several programs per output tile
    (the `split` candidate); `dot`: tensor-core tiles (by default above 8 rows), else FMAs; `gated`: x is a gated
    MLP's `[gate; up]` (`[M, 2K]`) and the input silu(gate) * up, computed as x is read. `config` (BLOCK_N,
    BLOCK_K, BLOCK_M with `dot`, SPLIT_K when split) runs one tile shape instead of the autotuned choice: for
    tests, also under `TRITON_INTERPRET=1` on CPU."""
    rows, n, k = x.shape[0], layout.out_features, layout.in_features
    dot = rows > DECODE_ROWS if dot is None else dot
    split = split or (config or {}).get("SPLIT_K", 1) > 1
    arguments = dict(
        INT4=layout.int4, G=layout.group or 1, HAS_INPUT_SCALE=input_scale is not None, HAS_BIAS=bias is not None,
        GATED=gated, DOT=dot, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        INT8_PTX=layout.method == "int8_wo" and not INTERPRETED and (not dot or x.dtype == torch.bfloat16))
    if not dot:
        arguments["BLOCK_M"] = triton.next_power_of_2(rows)
    weight = _weight_words(layout, weight)
    dummy = scale
    tensors = (x, weight, scale, dummy if zero is None else zero, dummy if input_scale is None else input_scale,
               dummy if bias is None else bias)
    sizes = (rows, n, k, weight.shape[1], layout.groups, _row_bucket(rows))
    return _launch(_TUNED_KERNELS[dot, split], _qlinear_kernel, x, n, tensors, sizes, arguments, config, split,
                   weight)


def _launch(tuned, kernel, x: Tensor, n: int, tensors: tuple, sizes: tuple, arguments: dict,
            config: dict[str, int] | None, split: bool, weight: Tensor) -> Tensor:
    """Run the autotuned `tuned`, or `kernel` at the tile shape `config`, over `[M, n]` output tiles and K slices
    (grid axes 0, 1, 2): the output in x's dtype. Split, the slices' float32 partial sums go to a buffer
    `[SPLIT_K, M, n]` and the tickets saying which slice finishes a tile to `weight`'s counters (`_tickets`)."""
    rows = x.shape[0]
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if not split:
        arguments["SPLIT_K"] = 1
    if config is not None:
        tuned, arguments = kernel, arguments | config
    if split:  # buffers for the largest split and tile count any configuration may take
        tiles = [config] if config is not None else [c.kwargs for c in tuned.configs]
        shapes = [(tile.get("BLOCK_M", arguments.get("BLOCK_M")), tile["BLOCK_N"], tile.get("SPLIT_K", 1))
                  for tile in tiles]
        partials = torch.empty(max(s for _, _, s in shapes), rows, n, dtype=torch.float32, device=x.device)
        tickets = _tickets(weight, max(triton.cdiv(rows, m) * triton.cdiv(n, b) for m, b, _ in shapes))
    else:
        partials = tickets = out  # not read
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), triton.cdiv(rows, meta["BLOCK_M"]),  # noqa: E731
                         meta["SPLIT_K"])
    pdl = dependent_launch(x.device)
    tuned[grid](*tensors, out, partials, tickets, *sizes, **arguments, PDL=pdl, launch_pdl=pdl)
    return out


# weight -> its split products' ticket counters (int32 zeros, each set back to zero by the slice that finishes its
# tile), the last the one in use; a grown weight keeps the smaller ones, which captured graphs may still read
_TICKETS = WeakIdKeyDictionary()


def _tickets(weight: Tensor, count: int) -> Tensor:
    """At least `count` ticket counters of `weight`'s split products (whatever their rows: one weight's products
    never run at once, its model being stepped by one thread)."""
    held = _TICKETS.setdefault(weight, [])
    if not held or held[-1].numel() < count:
        held.append(torch.zeros(max(count, 2 * held[-1].numel() if held else 0), dtype=torch.int32,
                                device=weight.device))
    return held[-1]


def pack_int4_words(layout: QuantLayout, weight: Tensor) -> Tensor:
    """The stored int4 bytes `[N, Kp / 2]` as int32 words in the layout `packed_linear` reads: K cut into chunks of
    8 groups (zero-padded to whole chunks), chunk c's word j holding column `8Gc + Gi + j` in nibble i, so that
    one shift-and-mask of a chunk's words gives the whole of its group i: `[N, chunks * G]` int32."""
    n, group = layout.out_features, layout.group
    chunk = 8 * group
    q = torch.stack([weight & 15, weight >> 4], dim=-1).view(n, layout.padded_in_features)
    width = -(-q.shape[1] // chunk) * chunk
    q = torch.cat([q, q.new_zeros(n, width - q.shape[1])], dim=1).view(n, width // chunk, 8, group).transpose(2, 3)
    return (q[..., 0::2] | (q[..., 1::2] << 4)).contiguous().view(torch.int32).view(n, width // 8)


def packed_linear(x: Tensor, layout: QuantLayout, weight: Tensor, scale: Tensor, zero: Tensor,
                  input_scale: Tensor | None = None, bias: Tensor | None = None,
                  config: dict[str, int] | None = None, split: bool = False, gated: bool = False) -> Tensor:
    """int4 `x [M, K]` (contiguous) times the weight on tensor cores, reading its `pack_int4_words` copy (made at
    the first call, kept as `_settle_copies` says): each word tile's 8 shifts are 8 group-wide tiles of the
    weight, each dequantized and multiplied by the matching `[M, G]` slice of x. `split`: K split over several
    programs per output tile; `gated`: as `fused_linear`'s. `config` (BLOCK_M, BLOCK_N, BLOCK_K a multiple of 8
    groups, SPLIT_K when split) runs one tile shape instead of the autotuned choice (for tests, also under
    `TRITON_INTERPRET=1`)."""
    rows, n, k = x.shape[0], layout.out_features, layout.in_features
    words = _copy_of("packed", weight, functools.partial(pack_int4_words, layout))
    split = split or (config or {}).get("SPLIT_K", 1) > 1
    arguments = dict(G=layout.group, HAS_INPUT_SCALE=input_scale is not None, HAS_BIAS=bias is not None,
                     GATED=gated, PRECISION="ieee" if x.dtype == torch.float32 else "tf32")
    tensors = (x, words, scale, zero, scale if input_scale is None else input_scale, scale if bias is None else bias)
    sizes = (rows, n, k, words.shape[1], layout.groups, _row_bucket(rows))
    return _launch(_TUNED_PACKED[split], _packed_kernel, x, n, tensors, sizes, arguments, config, split, weight)


def dequantize_on_device(layout: QuantLayout, weight: Tensor, scale: Tensor, zero: Tensor | None,
                         dtype: torch.dtype) -> Tensor:
    """`formats.dequantize` as one Triton kernel (CUDA, or CPU under `TRITON_INTERPRET=1`)."""
    n, k = layout.out_features, layout.in_features
    out = torch.empty(n, k, dtype=dtype, device=weight.device)
    weight = _weight_words(layout, weight)
    block_n, block_k = 16, 512  # wide rows: contiguous stores, and several int4 groups a tile
    _dequantize_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
        weight, scale, scale if zero is None else zero, out, n, k, weight.shape[1], layout.groups,
        INT4=layout.int4, G=layout.group or 1, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)
    return out


def quantize_rows_fp8(x: Tensor, dtype: torch.dtype = torch.float8_e4m3fn) -> tuple[Tensor, Tensor]:
    """`x [M, K]` (contiguous) as float8 e4m3 with one float32 scale a row (`x ~ q * scale`, scale = the row's
    absolute maximum / 448): one Triton kernel, a program a row. `dtype` float32 keeps the scaled values
    unrounded (Triton's interpreter casts to e4m3 inexactly, so CPU checks look at the values before the cast)."""
    rows, k = x.shape
    quantized = torch.empty(rows, k, dtype=dtype, device=x.device)
    scales = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    _fp8_rows_kernel[(rows,)](x, quantized, scales, k, FP8_MAX, BLOCK=min(2048, triton.next_power_of_2(k)),
                              num_warps=4)
    return quantized, scales


def tinygemm_nibbles(weight: Tensor) -> Tensor:
    """Our packed int4 bytes (even column in the low nibble) in the order `_convert_weight_to_int4pack` takes on
    CUDA (even column in the high nibble)."""
    return (weight << 4) | (weight >> 4)


def tinygemm_scales_and_zeros(scale: Tensor, zero: Tensor) -> Tensor:
    """`[groups, N, 2]` bfloat16 scales and offsets for `_weight_int4pack_mm`, whose weight is `(q - 8) * s + o`:
    ours is `(q - z) * s`, so `o = (8 - z) * s` (computed in float32, rounded once)."""
    s = scale.float()
    return torch.stack([s, (8.0 - zero.float()) * s], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)


def _tinygemm_fits(layout: QuantLayout, x: Tensor) -> bool:
    """Whether torch's int4 kernel takes this product (on sm_80+ GPUs): a torch with the op, bfloat16
    activations, no padded columns, K a multiple of 64 and N of 8."""
    k = layout.in_features
    return (layout.int4 and x.dtype == torch.bfloat16 and layout.padded_in_features == k and k % 64 == 0
            and layout.out_features % 8 == 0 and hasattr(torch.ops.aten, "_weight_int4pack_mm"))


def _settle_copies(weight: Tensor, key: tuple) -> None:
    """After the product `key` of `weight`: a copy of it that was made for timing (tinygemm's, the packed
    kernel's, `_scaled_mm`'s float32 scales) is kept for good if `key` chose a candidate that reads it (also
    after the activation kernel), else dropped (unless another product of the weight chose one)."""
    for name, readers in _COPY_READERS.items():
        if weight in _COPIES[name] and weight not in _COPIES_KEPT[name]:
            if (chosen(key) or "").removeprefix(ACTIVATION_FIRST) in readers:
                _COPIES_KEPT[name][weight] = True
            else:
                del _COPIES[name][weight]
                _MAKERS[name].pop(weight, None)


def _copy_of(name: str, weight: Tensor, make: Callable[[Tensor], object]) -> object:
    """The copy `name` of `weight`, made by `make(weight)` the first time (`make` must not hold `weight` itself:
    the copies are kept by weak reference to it)."""
    copy = _COPIES[name].get(weight)
    if copy is None:
        copy = _COPIES[name][weight] = make(weight)
        _MAKERS[name][weight] = make
    return copy


def remake_copies(weights: Iterable[Tensor]) -> int:
    """Make the copies of `weights` (and of their scales) again, in place (the addresses captured CUDA graphs
    read stay), from the values they hold now: after weights were filled in while kernels already ran on them
    (`exporter.engine.loading.PendingWeights`). Returns how many copies were made again."""
    remade = 0
    for weight in weights:
        for name, copies in _COPIES.items():
            copy = copies.get(weight)
            if copy is None:
                continue
            fresh = _MAKERS[name][weight](weight)
            olds, news = (copy, fresh) if isinstance(copy, tuple) else ((copy,), (fresh,))
            for old, new in zip(olds, news, strict=True):
                old.copy_(new)
            remade += 1
    return remade


def _tinygemm_linear(x: Tensor, layout: QuantLayout, weight: Tensor, scale: Tensor, zero: Tensor,
                     input_scale: Tensor | None, bias: Tensor | None) -> Tensor:
    inner_k_tiles = next(tiles for tiles in (8, 4, 2) if layout.in_features % (tiles * 16) == 0)
    packed = _copy_of("tinygemm", weight, lambda stored: (
        torch.ops.aten._convert_weight_to_int4pack(tinygemm_nibbles(stored).contiguous(), inner_k_tiles),
        tinygemm_scales_and_zeros(scale, zero)))
    if input_scale is not None:
        x = x * input_scale
    out = torch.ops.aten._weight_int4pack_mm(x, packed[0], layout.group, packed[1])
    return out if bias is None else out + bias


def _weight_words(layout: QuantLayout, weight: Tensor) -> Tensor:
    """The weight as the kernels read it: int4 bytes as int32 words (K is padded to whole groups of at least 32
    columns, so a row is whole words), other methods as stored."""
    return weight.view(torch.int32) if layout.int4 else weight


def _dequant_linear(x: Tensor, layout: QuantLayout, weight: Tensor, scale: Tensor, zero: Tensor | None,
                    input_scale: Tensor | None, bias: Tensor | None, on_device: bool = True) -> Tensor:
    """Dequantize the whole weight (by the Triton kernel, or by torch), then `F.linear` (cuBLAS)."""
    if not on_device:
        return reference_linear(x, layout, weight, scale, zero, input_scale, bias)
    if input_scale is not None:
        x = x * input_scale
    return F.linear(x, dequantize_on_device(layout, weight, scale, zero, x.dtype), bias)


def _fp8_scaled_mm(x: Tensor, weight: Tensor, scale: Tensor, bias: Tensor | None) -> Tensor:
    x_fp8, x_scale = quantize_rows_fp8(x)
    weight_scale = _copy_of("scaled_mm", weight, lambda _: scale.float()[None, :])
    out = torch._scaled_mm(x_fp8, weight.t(), scale_a=x_scale, scale_b=weight_scale, out_dtype=x.dtype)
    return out if bias is None else out + bias


@functools.cache
def _capability(device_index: int) -> tuple[int, int]:
    """The GPU's compute capability: float8 e4m3 from (8, 9) (Ada, Hopper), torch's int4 kernel from (8, 0)."""
    return torch.cuda.get_device_capability(device_index)


def _row_bucket(rows: int) -> int:
    """Rows rounded up to a power of two: products in one bucket share a timing choice and an autotuned tile."""
    return 1 << max(rows - 1, 0).bit_length()


if triton is not None:
    from ..gemv import silu_gated
    from ..triton_launch import start_dependents, wait_for_producers

    @triton.jit
    def _exact_float(v, OFFSET: tl.constexpr):
        """`v - OFFSET` as float32 for int32 `v` in [0, 2**23): v is put in the mantissa of 2**23 (exact)."""
        return (v | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + OFFSET)

    @triton.jit
    def _int8_pairs_as_bfloat16(w):
        """int8 weights as exact bfloat16, two of a 16-bit half at a time in inline PTX (the layout of a tensor-core
        operand hands each thread adjacent byte pairs): XOR 0x80 gives w + 128 as unsigned bytes, each put under
        float32's exponent of 2**23 by a byte permute, less 2**23 + 128, packed two a register. CUDA only."""
        return tl.inline_asm_elementwise(
            """{
            .reg .b32 t, f0, f1;
            cvt.u32.u16 t, $1;
            xor.b32 t, t, 0x8080;
            prmt.b32 f0, t, 0x4B000000, 0x7650;
            prmt.b32 f1, t, 0x4B000000, 0x7651;
            sub.f32 f0, f0, 0f4B000080;
            sub.f32 f1, f1, 0f4B000080;
            cvt.rn.bf16x2.f32 $0, f1, f0;
            }""", "=r,h", [w], dtype=tl.bfloat16, is_pure=True, pack=2)

    @triton.jit
    def _int8_words_as_float32(w):
        """int8 weights as exact float32, four of a 32-bit word at a time in inline PTX (the FMA tiles' loads give
        each thread whole words): as `_int8_pairs_as_bfloat16`, without the packing. CUDA only."""
        return tl.inline_asm_elementwise(
            """{
            .reg .b32 t;
            xor.b32 t, $4, 0x80808080;
            prmt.b32 $0, t, 0x4B000000, 0x7650;
            prmt.b32 $1, t, 0x4B000000, 0x7651;
            prmt.b32 $2, t, 0x4B000000, 0x7652;
            prmt.b32 $3, t, 0x4B000000, 0x7653;
            sub.f32 $0, $0, 0f4B000080;
            sub.f32 $1, $1, 0f4B000080;
            sub.f32 $2, $2, 0f4B000080;
            sub.f32 $3, $3, 0f4B000080;
            }""", "=f,=f,=f,=f,r", [w], dtype=tl.float32, is_pure=True, pack=4)

    @triton.jit
    def _nibble(packed, s, z, i: tl.constexpr):
        """Nibble i of each int32 word, dequantized with the word's scale and zero (float32)."""
        return (_exact_float((packed >> (4 * i)) & 15, 0.0) - z) * s

    @triton.jit
    def _weight_tile(w_ptr, s_ptr, z_ptr, rows, row_ok, k0, W_STRIDE, NG, INT4: tl.constexpr, G: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INT8_PTX: tl.constexpr = False,
                     DOT: tl.constexpr = False):
        """Weight rows `rows` (BLOCK_N of them) x columns `[k0, k0 + BLOCK_K)` in float32, `[BLOCK_N, BLOCK_K]`;
        k0 is a multiple of BLOCK_K. int8 and fp8 are unscaled (the per-row scale multiplies the finished
        product); int4 is dequantized with its groups' scales and zeros. Columns past the stored ones are 0.
        INT8_PTX: int8 is converted by inline PTX, as bfloat16 (the same values) for a tensor-core tile (`DOT`).

        int4 is read as int32 words, column 8w + i being nibble i of word w; each word's scale and zero (its 8
        nibbles share a group) are loaded once a word, in the words' layout. The 8 nibble tiles are put back in
        column order by three rounds of `tl.interleave` (each keeps the new pairs within a thread): pairing
        nibbles 4 apart, then 2 apart, then 1 apart puts nibble 4a + 2b + c at column 8w + 4a + 2b + c."""
        if INT4:
            words = k0 // 8 + tl.arange(0, BLOCK_K // 8)
            word_ok = row_ok[:, None] & (words < W_STRIDE)[None, :]
            packed = tl.load(w_ptr + rows[:, None] * W_STRIDE + words[None, :], mask=word_ok, other=0,
                             eviction_policy="evict_first")
            group = words * 8 // G
            offsets = rows[:, None] * NG + group[None, :]
            group_ok = row_ok[:, None] & (group < NG)[None, :]  # a tile may reach past the last group
            s = tl.load(s_ptr + offsets, mask=group_ok, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + offsets, mask=group_ok, other=0.0).to(tl.float32)
            even = tl.interleave(tl.interleave(_nibble(packed, s, z, 0), _nibble(packed, s, z, 4)),
                                 tl.interleave(_nibble(packed, s, z, 2), _nibble(packed, s, z, 6)))
            odd = tl.interleave(tl.interleave(_nibble(packed, s, z, 1), _nibble(packed, s, z, 5)),
                                tl.interleave(_nibble(packed, s, z, 3), _nibble(packed, s, z, 7)))
            return tl.interleave(even, odd)
        else:
            cols = k0 + tl.arange(0, BLOCK_K)
            w = tl.load(w_ptr + rows[:, None] * W_STRIDE + cols[None, :],
                        mask=row_ok[:, None] & (cols < W_STRIDE)[None, :], other=0.0, eviction_policy="evict_first")
            if w.dtype == tl.int8 and INT8_PTX and DOT:
                return _int8_pairs_as_bfloat16(w)
            elif w.dtype == tl.int8 and INT8_PTX:
                return _int8_words_as_float32(w)
            elif w.dtype == tl.int8:  # x + 128 as an unsigned byte, into the mantissa
                return _exact_float((w.to(tl.uint8, bitcast=True) ^ 128).to(tl.int32), 128.0)
            else:
                return w.to(tl.float32)

    @triton.jit
    def _activations(x_ptr, xs_ptr, tokens, token_ok, cols, col_ok, K, HAS_INPUT_SCALE: tl.constexpr,
                     GATED: tl.constexpr):
        """x[tokens, cols] in float32, times AWQ's input scale of each column. GATED: x is `[gate; up]` (`[M, 2K]`)
        and the input silu(gate) * up."""
        mask = token_ok[:, None] & col_ok[None, :]
        if GATED:
            x = silu_gated(x_ptr, tokens[:, None] * (2 * K) + cols[None, :], mask, K)
        else:
            x = tl.load(x_ptr + tokens[:, None] * K + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_INPUT_SCALE:
            x = x * tl.load(xs_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        return x

    # the row count and the number of groups are not specialized on (8 or 608 rows, 32 or 86 groups: one compile)
    @triton.jit(do_not_specialize=["M", "NG", "M_BUCKET"])
    def _qlinear_kernel(x_ptr, w_ptr, s_ptr, z_ptr, xs_ptr, b_ptr, y_ptr, p_ptr, c_ptr, M, N, K, W_STRIDE, NG,
                        M_BUCKET,
                        INT4: tl.constexpr, G: tl.constexpr, HAS_INPUT_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
                        GATED: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr, INT8_PTX: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                        PDL: tl.constexpr = False):
        """y[m, n] = sum_k x[m, k] (* xs[k]) W[n, k] (+ b[n]) for a BLOCK_M x BLOCK_N tile, in float32, over the
        program's slice of K (axis 2 of the grid: SPLIT_K slices of whole BLOCK_K tiles).

        DOT: tensor-core products of each dequantized tile (BLOCK_M >= 16), its operands rounded to the activation
        dtype as the reference's are, computed transposed (`W x^T`): the converted weight tile is then the register
        operand of Hopper's wgmma, not written back to shared memory (x^T is read from there); otherwise FMAs into
        a per-thread accumulator reduced once at the end (few rows: the weight read dominates). INT8_PTX (int8
        weights compiled for CUDA; bfloat16 activations with DOT): int8 tiles converted by inline PTX. SPLIT_K > 1:
        `_store_tile` finishes the tile from the slices' partials (`p_ptr`, `[SPLIT_K, M, N]` float32) and tickets
        (`c_ptr`). M_BUCKET only keys the autotuning. PDL (launched as a dependent, `triton_launch`): FMA tiles
        load their first weight tile before the wait for x, tensor-core ones wait first."""
        start_dependents(PDL)
        rows, row_ok, tokens, token_ok = _program_tile(M, N, BLOCK_M, BLOCK_N)
        part = tl.program_id(2)
        dtype = x_ptr.dtype.element_ty
        width = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
        ONE_ROW: tl.constexpr = BLOCK_M == 1 and not DOT
        if DOT:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        elif ONE_ROW:  # a 2-D accumulator: the weight tile keeps the layout it is loaded in
            acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
        PEELED: tl.constexpr = BLOCK_K if PDL and not DOT else 0  # K columns read before the loop
        if PEELED:  # the slice's first weight tile (inside it, or past K: zeros) is read before the wait
            w = _weight_tile(w_ptr, s_ptr, z_ptr, rows, row_ok, part * width, W_STRIDE, NG, INT4, G, BLOCK_N,
                             BLOCK_K, INT8_PTX, DOT)
            wait_for_producers(PDL)
            cols = part * width + tl.arange(0, BLOCK_K)
            x = _activations(x_ptr, xs_ptr, tokens, token_ok, cols, cols < K, K, HAS_INPUT_SCALE, GATED)
            if ONE_ROW:
                acc += w * x
            else:
                acc += w[None, :, :] * x[:, None, :]
        else:
            wait_for_producers(PDL)
        for k0 in range(part * width + PEELED, tl.minimum(part * width + width, K), BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            x = _activations(x_ptr, xs_ptr, tokens, token_ok, cols, cols < K, K, HAS_INPUT_SCALE, GATED)
            w = _weight_tile(w_ptr, s_ptr, z_ptr, rows, row_ok, k0, W_STRIDE, NG, INT4, G, BLOCK_N, BLOCK_K,
                             INT8_PTX, DOT)
            if DOT:
                acc = tl.dot(w.to(dtype), tl.trans(x.to(dtype)), acc, input_precision=PRECISION)
            elif ONE_ROW:
                acc += w * x
            else:
                acc += w[None, :, :] * x[:, None, :]
        if DOT:
            y = tl.trans(acc)
        elif ONE_ROW:
            y = tl.sum(acc, axis=1)[None, :]
        else:
            y = tl.sum(acc, axis=2)
        if not INT4:
            y = y * tl.load(s_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[None, :]
        _store_tile(y, b_ptr, y_ptr, p_ptr, c_ptr, rows, row_ok, tokens, token_ok, M, N, part, HAS_BIAS, SPLIT_K)

    @triton.jit
    def _program_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """This program's output tile (grid axes 0 and 1): its weight rows and tokens, and which of them exist."""
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        tokens = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        return rows, rows < N, tokens, tokens < M

    @triton.jit
    def _store_tile(y, b_ptr, y_ptr, p_ptr, c_ptr, rows, row_ok, tokens, token_ok, M, N, part,
                    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr):
        """A program's float32 output tile `y [tokens, rows]` plus the bias, stored in y's dtype. With SPLIT_K > 1,
        y is slice `part`'s partial: stored in `p_ptr` (`[SPLIT_K, M, N]`); the slice that takes the tile's last
        ticket (`c_ptr`, by output tile) sets the counter back to zero and stores the sum of the slices' partials
        in slice order (read past the L1 cache: other programs wrote them)."""
        mask = token_ok[:, None] & row_ok[None, :]
        offsets = tokens[:, None] * N + rows[None, :]
        if SPLIT_K > 1:
            tl.store(p_ptr + part * M * N + offsets, y, mask=mask)
            tl.debug_barrier()  # every thread's partial stored before the ticket is taken (released with it)
            tile = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
            if tl.atomic_add(c_ptr + tile, 1, sem="acq_rel") == SPLIT_K - 1:
                tl.store(c_ptr + tile, 0)
                total = tl.load(p_ptr + offsets, mask=mask, other=0.0, cache_modifier=".cg")
                for other in tl.static_range(1, SPLIT_K):
                    total += tl.load(p_ptr + other * M * N + offsets, mask=mask, other=0.0, cache_modifier=".cg")
                _store_with_bias(total, b_ptr, y_ptr + offsets, rows, row_ok, mask, HAS_BIAS)
        else:
            _store_with_bias(y, b_ptr, y_ptr + offsets, rows, row_ok, mask, HAS_BIAS)

    @triton.jit
    def _store_with_bias(y, b_ptr, out_ptrs, rows, row_ok, mask, HAS_BIAS: tl.constexpr):
        """`y` plus the bias of its weight rows, in the output's dtype."""
        if HAS_BIAS:
            y += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptrs, y.to(out_ptrs.dtype.element_ty), mask=mask)

    # the row count and the number of groups are not specialized on
    @triton.jit(do_not_specialize=["M", "NG", "M_BUCKET"])
    def _packed_kernel(x_ptr, w_ptr, s_ptr, z_ptr, xs_ptr, b_ptr, y_ptr, p_ptr, c_ptr, M, N, K, WORDS, NG,
                       M_BUCKET,
                       G: tl.constexpr, HAS_INPUT_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
                       GATED: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, PDL: tl.constexpr = False):
        """y = x W^T (+ b) for a BLOCK_M x BLOCK_N tile over the program's slice of K, W int4 in the
        `pack_int4_words` layout (WORDS words a row, chunks of 8 groups; BLOCK_K a multiple of a chunk).

        Each chunk's `[BLOCK_N, G]` words are loaded once; shift i and a mask give group i of the chunk (a plain
        tile in the words' own layout: no reordering), dequantized by one FMA with its rows' scale and scale x
        zero, rounded to x's dtype and multiplied on tensor cores by x's columns of that group. PDL: launched as a
        dependent (`triton_launch`), it waits first."""
        start_dependents(PDL)
        wait_for_producers(PDL)
        rows, row_ok, tokens, token_ok = _program_tile(M, N, BLOCK_M, BLOCK_N)
        part = tl.program_id(2)
        dtype = x_ptr.dtype.element_ty
        CHUNKS: tl.constexpr = BLOCK_K // (8 * G)
        chunks = WORDS // G
        width = tl.cdiv(tl.cdiv(chunks, SPLIT_K), CHUNKS) * CHUNKS
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for c0 in range(part * width, tl.minimum(part * width + width, chunks), CHUNKS):
            for c in tl.static_range(CHUNKS):
                chunk = c0 + c
                words = chunk * G + tl.arange(0, G)
                packed = tl.load(w_ptr + rows[:, None] * WORDS + words[None, :],
                                 mask=row_ok[:, None] & (words < WORDS)[None, :], other=0,
                                 eviction_policy="evict_first")
                for i in tl.static_range(8):
                    group = chunk * 8 + i
                    cols = group * G + tl.arange(0, G)
                    x = _activations(x_ptr, xs_ptr, tokens, token_ok, cols, cols < K, K, HAS_INPUT_SCALE, GATED)
                    group_ok = row_ok & (rows * 0 + group < NG)  # a tensor: the interpreter masks no scalars
                    s = tl.load(s_ptr + rows * NG + group, mask=group_ok, other=0.0).to(tl.float32)
                    z = tl.load(z_ptr + rows * NG + group, mask=group_ok, other=0.0).to(tl.float32)
                    w = _exact_float((packed >> (4 * i)) & 15, 0.0) * s[:, None] - (z * s)[:, None]
                    acc = tl.dot(x.to(dtype), tl.trans(w.to(dtype)), acc, input_precision=PRECISION)
        _store_tile(acc, b_ptr, y_ptr, p_ptr, c_ptr, rows, row_ok, tokens, token_ok, M, N, part, HAS_BIAS,
                    SPLIT_K)

    @triton.jit
    def _dequantize_kernel(w_ptr, s_ptr, z_ptr, out_ptr, N, K, W_STRIDE, NG, INT4: tl.constexpr, G: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """out[n, k] = W[n, k] in out's dtype, for a BLOCK_N x BLOCK_K tile."""
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        k0 = tl.program_id(1) * BLOCK_K
        row_ok = rows < N
        w = _weight_tile(w_ptr, s_ptr, z_ptr, rows, row_ok, k0, W_STRIDE, NG, INT4, G, BLOCK_N, BLOCK_K)
        if not INT4:
            w = w * tl.load(s_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
        cols = k0 + tl.arange(0, BLOCK_K)
        tl.store(out_ptr + rows[:, None] * K + cols[None, :], w.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & (cols < K)[None, :])

    @triton.jit
    def _fp8_rows_kernel(x_ptr, q_ptr, s_ptr, K, FP8_MAX, BLOCK: tl.constexpr):
        """One row of x: its absolute maximum, then x / scale in float8 e4m3 and the scale (amax / FP8_MAX)."""
        row = tl.program_id(0).to(tl.int64) * K
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            cols = k0 + tl.arange(0, BLOCK)
            amax = tl.maximum(amax, tl.abs(tl.load(x_ptr + row + cols, mask=cols < K, other=0.0).to(tl.float32)))
        scale = tl.maximum(tl.max(amax, axis=0), 1e-12) / FP8_MAX
        for k0 in range(0, K, BLOCK):
            cols = k0 + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + row + cols, mask=cols < K, other=0.0).to(tl.float32)
            q = tl.minimum(tl.maximum(tl.div_rn(x, scale), -FP8_MAX), FP8_MAX)  # IEEE division, as torch
            tl.store(q_ptr + row + cols, q.to(q_ptr.dtype.element_ty), mask=cols < K)
        tl.store(s_ptr + tl.program_id(0), scale)

    def _bench(kernel_call, quantiles):
        """A tile shape's time (for each quantile the autotuner asks) as the candidates are timed: from a CUDA
        graph, the weight evicted from the L2 cache (`gemv.measure_ms`)."""
        ms = measure_ms(kernel_call)
        return ms if quantiles is None else [ms] * len(quantiles)

    def _fits_registers(configs, named_args, **kwargs):
        """FMA tiles whose accumulator (BLOCK_M x BLOCK_N x BLOCK_K float32) stays within 128 registers a
        thread at this BLOCK_M."""
        rows = kwargs.get("BLOCK_M", 1)
        kept = [config for config in configs
                if rows * config.kwargs["BLOCK_N"] * config.kwargs["BLOCK_K"] <= 128 * 32 * config.num_warps]
        return kept or configs[:1]

    def _fits_rows(configs, named_args, **kwargs):
        """Tensor-core tiles no taller than the rows (rounded up to a power of two, at least 16)."""
        bucket = named_args.get("M_BUCKET", kwargs.get("M_BUCKET", 16))
        kept = [c for c in configs if c.kwargs["BLOCK_M"] <= max(16, bucket)]
        return kept or configs[:1]

    def _fits_packed(configs, named_args, **kwargs):
        """Packed tiles no taller than the rows (as `_fits_rows`) whose BLOCK_K is whole chunks of 8 groups."""
        group = named_args.get("G", kwargs.get("G", 128))
        kept = [c for c in _fits_rows(configs, named_args, **kwargs) if c.kwargs["BLOCK_K"] % (8 * group) == 0]
        return kept or [triton.Config(configs[0].kwargs | {"BLOCK_K": 8 * group}, num_warps=configs[0].num_warps,
                                      num_stages=configs[0].num_stages)]

    def _tuned(name: str, tiles, fma: bool, split: bool):
        """`_qlinear_kernel` autotuned over `tiles` ((BLOCK_N, BLOCK_K, SPLIT_K, warps, stages) for FMA tiles,
        with BLOCK_M first for tensor-core ones), registered as `name` with the kernel cache."""
        configs = []
        for tile in tiles:
            *blocks, warps, stages = tile
            names = ("BLOCK_N", "BLOCK_K", "SPLIT_K") if fma else ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K")
            values = dict(zip(names, blocks))
            if not split:
                values.pop("SPLIT_K", None)
            configs.append(triton.Config(values, num_warps=warps, num_stages=stages))
        return register_tuned(name, triton.autotune(
            configs=configs, key=["N", "K", "G", "HAS_INPUT_SCALE", "GATED", "BLOCK_M" if fma else "M_BUCKET"],
            prune_configs_by={"early_config_prune": _fits_registers if fma else _fits_rows},
            do_bench=_bench)(_qlinear_kernel))

    # (dot, split) -> the autotuned kernel; SPLIT_K is ignored (absent) in the unsplit spaces
    _TUNED_KERNELS = {
        # the last rows of each: wider K tiles and more warps (more bytes in flight a program), for products with
        # few output rows (int8/fp8's 4096 x 4096 and 4096 x 11008 at one row)
        (False, False): _tuned("quant_mv", (
            (2, 1024, 1, 4, 3), (4, 512, 1, 4, 3), (4, 1024, 1, 8, 4), (8, 256, 1, 4, 4), (8, 512, 1, 4, 3),
            (16, 256, 1, 4, 3), (16, 512, 1, 8, 3), (32, 128, 1, 4, 4),
            (2, 2048, 1, 8, 3), (4, 2048, 1, 8, 3), (8, 1024, 1, 8, 3), (4, 1024, 1, 4, 5)), fma=True, split=False),
        (False, True): _tuned("quant_mv_split", (
            (2, 1024, 4, 4, 3), (4, 512, 4, 4, 3), (4, 1024, 2, 4, 3), (8, 512, 2, 4, 3), (8, 512, 4, 4, 3),
            (16, 256, 4, 4, 3), (16, 512, 4, 8, 3), (32, 128, 4, 4, 4),
            (8, 1024, 2, 8, 3), (16, 1024, 2, 8, 3), (4, 2048, 2, 8, 3), (8, 512, 8, 4, 3), (16, 256, 8, 4, 4)),
            fma=True, split=True),
        (True, False): _tuned("quant_mm", (
            (16, 64, 128, 1, 4, 4), (16, 128, 128, 1, 4, 3), (16, 32, 256, 1, 4, 3), (32, 64, 128, 1, 4, 4),
            (32, 128, 128, 1, 4, 3), (64, 128, 64, 1, 4, 4),
            (64, 128, 128, 1, 8, 3), (128, 128, 64, 1, 8, 3), (128, 256, 64, 1, 8, 3),
            # wider K tiles for 16 to 32 rows (int8's 128-column tiles are 128 bytes a row)
            (32, 64, 256, 1, 4, 3), (32, 128, 256, 1, 8, 3), (16, 64, 512, 1, 4, 3)), fma=False, split=False),
        (True, True): _tuned("quant_mm_split", (
            (16, 64, 128, 4, 4, 4), (16, 128, 128, 4, 4, 3), (16, 32, 256, 8, 4, 3), (32, 64, 128, 2, 4, 4),
            (32, 64, 128, 4, 4, 4), (32, 128, 128, 4, 4, 3),
            (64, 64, 128, 2, 4, 3), (32, 64, 256, 2, 4, 3), (16, 64, 512, 4, 4, 3)), fma=False, split=True),
    }

    def _tuned_packed(name: str, tiles, split: bool):
        """`_packed_kernel` autotuned over `tiles` ((BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, warps, stages)),
        registered as `name` with the kernel cache."""
        configs = []
        for block_m, block_n, block_k, split_k, warps, stages in tiles:
            values = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k}
            if split:
                values["SPLIT_K"] = split_k
            configs.append(triton.Config(values, num_warps=warps, num_stages=stages))
        return register_tuned(name, triton.autotune(
            configs=configs, key=["N", "K", "G", "HAS_INPUT_SCALE", "GATED", "M_BUCKET"],
            prune_configs_by={"early_config_prune": _fits_packed}, do_bench=_bench)(_packed_kernel))

    # split -> the autotuned packed kernel: 16 to 64 rows (1 row padded to 16) in 16- or 32-row tiles (64-row ones
    # take Hopper's wgmma, whose shared buffers exceed 228 KB at a chunk of 1024 columns; 32-row ones fit at 2
    # stages with the gate's two loads, and take 8 warps: at 4 a thread's words and accumulator need more than 255
    # registers, and they spill), whole chunks of K (a chunk is 1024 columns at LLaVA's group of 128, 256 at
    # a group of 32), split K for products with few output tiles; few shapes: each is compiled and timed per key
    _TUNED_PACKED = {
        False: _tuned_packed("quant_packed", (
            (16, 32, 1024, 1, 4, 3), (16, 64, 1024, 1, 4, 2), (16, 128, 1024, 1, 8, 2), (16, 64, 2048, 1, 4, 2),
            (32, 64, 1024, 1, 8, 2), (16, 32, 256, 1, 4, 4), (32, 64, 512, 1, 4, 3)), split=False),
        True: _tuned_packed("quant_packed_split", (
            (16, 32, 1024, 2, 4, 3), (16, 64, 1024, 4, 4, 2), (16, 32, 1024, 4, 4, 3), (16, 64, 1024, 8, 4, 2),
            (32, 64, 1024, 2, 8, 2), (32, 64, 1024, 4, 8, 2), (16, 32, 256, 4, 4, 4)), split=True),
    }
