"""The decoder's fused elementwise Triton kernels (`exporter.llm.fused_triton`), against the decoder's op-by-op
functions (`exporter.llm.model`), and the decoder run through them against transformers' models.

Triton takes `TRITON_INTERPRET=1` into account only if it is set before Triton is imported, so in an ordinary run
this file runs itself again in a child pytest with the variable set, where the kernel checks are collected. The
interpreter converts to bfloat16 and float8 inexactly (it rounds half up and drops the carry), so the checks here
use float32 and float16, and a float8 cache is checked twice: the scaled and clamped values written into a float32
cache (what the kernel then casts), and a real float8 cache with values on the e4m3 grid (no rounding: the layout
and the clamp); `test_kernels_on_cuda_match_the_op_by_op_functions` checks bfloat16 and the float8 cast on a GPU.
The kernels are also compiled for the H100 (sm_90) without a GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")

from exporter.llm import Decoder, DecoderConfig, SamplingParams, fused_triton  # noqa: E402
from exporter.llm import model as model_module  # noqa: E402
from exporter.llm.paged_attention import FP8_DTYPE, FP8_MAX  # noqa: E402
from exporter.runtime.scheduler import generate  # noqa: E402
from support.decoders import random_ids, scheduler_decoder  # noqa: E402
from support.decoding import captured_decode_logits, check_logits_and_cache, hf_greedy, relative_error  # noqa: E402
from support.kernels import TRITON_INTERPRETED, run_under_triton_interpreter  # noqa: E402
from support.llm_families import FAMILIES  # noqa: E402

FAMILY_VOCAB = 384
ACTIVATIONS = [("swiglu", True, "none"), ("reglu", True, "none"), ("geglu", True, "none"), ("geglu", True, "tanh"),
               ("gelu", False, "none"), ("gelu", False, "tanh"), ("openai-gelu", False, "none"),
               ("squared-relu", False, "none")]
# (KV groups, query heads per group, head size, rotary dims or None): GQA with full RoPE, MHA with half of each
# head rotated, MQA of an unaligned head size with partial RoPE, GQA without RoPE (learned positions)
HEADS = [(2, 2, 8, 8), (4, 1, 16, 8), (1, 5, 24, 12), (2, 3, 8, None)]


@pytest.fixture(scope="module")
def interpreted():
    if not TRITON_INTERPRETED:
        pytest.skip("runs in the child pytest (TRITON_INTERPRET=1)")


def test_kernels_under_the_triton_interpreter():
    run_under_triton_interpreter(__file__)


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def assert_within_one_rounding(got: torch.Tensor, expected: torch.Tensor, steps: int = 1) -> None:
    """Equal shapes and dtypes, and values apart by at most one rounding step of a 16-bit dtype (both compute in
    float32 and round once; `steps` where a rounded value is multiplied again), within 1e-5 (relative and
    absolute) in float32 (the order of float32 operations and the libraries' erf differ)."""
    assert got.shape == expected.shape and got.dtype == expected.dtype
    relative = 1e-5 if expected.dtype == torch.float32 else steps * torch.finfo(expected.dtype).eps
    allowed = relative * expected.float().abs() + (1e-5 if expected.dtype == torch.float32 else 1e-6)
    excess = (got.float() - expected.float()).abs() - allowed
    assert excess.max() <= 0, f"off by {excess.max()} more than a rounding step allows"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("width", [64, 100, 4096])
@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("layernorm", [False, True], ids=["rmsnorm", "layernorm"])
@pytest.mark.parametrize("zero_centered", [False, True])
def test_triton_norm_matches_the_op_by_op_norm(interpreted, dtype, width, tokens, layernorm, zero_centered):
    generator = _generator(width + tokens)
    x, delta = (torch.randn(tokens, width, generator=generator).to(dtype) * 2 for _ in range(2))
    weight = (torch.randn(width, generator=generator) * 0.5).to(dtype)
    bias = torch.randn(width, generator=generator).to(dtype) if layernorm else None
    same, alone = fused_triton.norm(x, None, weight, bias, 1e-5, zero_centered)
    assert same is x
    assert_within_one_rounding(alone, model_module._norm(x, weight, bias, 1e-5, zero_centered))
    total, normed = fused_triton.norm(x, delta, weight, bias, 1e-5, zero_centered)
    assert torch.equal(total, x + delta)  # the residual sum rounded as torch rounds it
    assert_within_one_rounding(normed, model_module._norm(x + delta, weight, bias, 1e-5, zero_centered))


def test_triton_norm_reads_strided_rows(interpreted):
    """Rows of a wider tensor (row stride larger than the width): the kernel reads them in place."""
    wide = torch.randn(3, 80, generator=_generator(1))
    x, weight = wide[:, :64], torch.randn(64, generator=_generator(2))
    assert_within_one_rounding(fused_triton.norm(x, None, weight, None, 1e-6, False)[1],
                               model_module._norm(x, weight, None, 1e-6, False))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("activation, gated, approximation", ACTIVATIONS)
@pytest.mark.parametrize("tokens, width", [(1, 48), (3, 1500)])
def test_triton_activation_matches_the_op_by_op_one(interpreted, dtype, activation, gated, approximation, tokens,
                                                     width):
    """Each activation, gated and plain, one block of columns and two (1500 > 1024), rounded as the op-by-op
    code rounds (the activation to the dtype, then its product with up: a step apart in the activation can make
    two in the product)."""
    h = (torch.randn(tokens, 2 * width if gated else width, generator=_generator(width)) * 3).to(dtype)
    got = fused_triton.activate(h, activation, gated, approximation)
    assert_within_one_rounding(got, model_module._activate(h, activation, gated, approximation), 2 if gated else 1)


def _split_inputs(tokens: int, groups: int, per_group: int, dim: int, rotary: int | None, dtype: torch.dtype,
                  seed: int):
    generator = _generator(seed)
    qkv = torch.randn(tokens, groups * (per_group + 2) * dim, generator=generator).to(dtype)
    if rotary is None:
        return qkv, None, None
    angles = torch.rand(tokens, 1, rotary // 2, generator=generator) * 6.0
    angles = torch.cat([angles, angles], dim=-1)
    return qkv, angles.cos(), angles.sin()


def _static_cache(dtype: torch.dtype, tokens: int, groups: int, dim: int):
    """Layer 1 of a static cache `[layers, 2, rows, max_seq, groups, d]` and each token's distinct (row, position)."""
    data = torch.zeros(2, 2, 3, 9, groups, dim, dtype=dtype)
    slots = torch.randperm(3 * 9, generator=_generator(tokens))[:tokens]
    return data, data[1], slots // 9, slots % 9


def _paged_cache(dtype: torch.dtype, tokens: int, groups: int, dim: int, device: str = "cpu"):
    """Layer 1 of a paged pool stored head-major, `[layers, 2, blocks, kv_heads, block_size, d]`, seen as the
    decoder sees it (`Decoder.new_paged_kv_cache`): `[2, blocks, block_size, kv_heads, d]` through its strides."""
    data = torch.zeros(2, 2, 6, groups, 4, dim, dtype=dtype, device=device).transpose(3, 4)
    slots = (torch.randperm(5 * 4, generator=_generator(tokens))[:tokens] + 4).to(device)  # never null block 0
    return data, data[1], slots // 4, slots % 4


def _scales(groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A pool's float8 scales `[layers, 2, kv_heads]` and layer 1's view as the decoder passes it."""
    scales = torch.rand(2, 2, groups, generator=_generator(groups)) * 0.02 + 0.004
    return scales, scales[1][:, None, :, None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("groups, per_group, dim, rotary", HEADS)
@pytest.mark.parametrize("tokens", [1, 7])
@pytest.mark.parametrize("cache", [None, "static", "paged", "paged scaled"])
def test_triton_split_heads_matches_the_op_by_op_one(interpreted, dtype, groups, per_group, dim, rotary, tokens,
                                                      cache):
    """Queries, keys and values, and the whole cache after the write (other slots untouched); "paged scaled": a
    float8 pool's scaled and clamped values, written into a float32 pool (the kernel's cast is to the pool's
    dtype; the interpreter's float8 cast is inexact)."""
    qkv, cos, sin = _split_inputs(tokens, groups, per_group, dim, rotary, dtype, seed=tokens * 10 + groups)
    rotary_dim = rotary or 0
    layers = layer = rows = positions = scale = None
    if cache is not None:
        layers, layer, rows, positions = (_static_cache if cache == "static" else _paged_cache)(
            torch.float32 if cache == "paged scaled" else dtype, tokens, groups, dim)
        if cache == "paged scaled":
            qkv = qkv * 6  # some values over FP8_MAX * scale: clamped
            scale = _scales(groups)[1]
    expected_layers = None if layers is None else layers.clone()
    expected_layer = None if layers is None else expected_layers[1]
    expected = model_module._split_heads(qkv, cos, sin, expected_layer, rows, positions, scale, groups, per_group,
                                         rotary_dim)
    got = fused_triton.split_heads(qkv, cos, sin, layer, rows, positions, scale, groups, per_group, rotary_dim)
    for got_part, expected_part in zip(got, expected):
        assert_within_one_rounding(got_part, expected_part)
    if rotary is None or rotary_dim < dim:  # values, and the dims RoPE leaves, are copied exactly
        assert torch.equal(got[1][1], expected[1][1]) and torch.equal(got[0][..., rotary_dim:],
                                                                      expected[0][..., rotary_dim:])
    if layers is not None:
        assert_within_one_rounding(layers, expected_layers)
        assert torch.equal(layers == 0, expected_layers == 0)  # the same slots written
    if cache == "paged scaled":
        assert layers.abs().max() == FP8_MAX


@pytest.mark.parametrize("tokens", [1, 6])
def test_triton_split_heads_writes_a_float8_pool(interpreted, tokens):
    """A real float8 e4m3 pool (head-major), without RoPE: keys and values on the e4m3 grid times each head's
    power-of-two scale, some past FP8_MAX (clamped), land in their blocks exactly as the op-by-op write puts
    them."""
    groups, per_group, dim = 2, 2, 16
    grid = torch.randn(tokens, groups * (per_group + 2) * dim, generator=_generator(tokens)) * 200
    grid = grid.to(FP8_DTYPE).float()
    scales = torch.tensor([[[0.5, 0.25], [0.125, 2.0]]] * 2)  # [layers, 2, kv_heads]
    per_column = scales[1].repeat_interleave(dim, dim=1)  # [2, groups*d]: each column's key or value scale
    qkv = grid.view(tokens, groups, per_group + 2, dim).clone()
    qkv[:, :, per_group] *= per_column[0].view(groups, dim)
    qkv[:, :, per_group + 1] *= per_column[1].view(groups, dim)
    qkv = qkv.view(tokens, -1)
    qkv[0, per_group * dim] = 1000.0  # past FP8_MAX * 0.5: stored as FP8_MAX
    layers, layer, rows, positions = _paged_cache(FP8_DTYPE, tokens, groups, dim)
    expected_layers = layers.clone()
    scale = scales[1][:, None, :, None]
    model_module._split_heads(qkv, None, None, expected_layers[1], rows, positions, scale, groups, per_group, 0)
    fused_triton.split_heads(qkv, None, None, layer, rows, positions, scale, groups, per_group, 0)
    assert torch.equal(layers.view(torch.uint8), expected_layers.view(torch.uint8))
    assert layers.float().max() == FP8_MAX


def _counting(monkeypatch) -> dict[str, int]:
    """Send the decoder's elementwise work through the kernels on the CPU (the interpreter runs them) and count
    each kernel's calls."""
    calls = {}
    for name in ("norm", "split_heads", "activate"):
        kernel = getattr(fused_triton, name)

        def counted(*args, kernel=kernel, name=name):
            calls[name] = calls.get(name, 0) + 1
            return kernel(*args)

        monkeypatch.setattr(fused_triton, name, counted)
    monkeypatch.setattr(model_module, "_on_triton", lambda x: True)
    return calls


@pytest.mark.parametrize("name", list(FAMILIES))
def test_families_through_the_kernels_match_transformers(interpreted, monkeypatch, name):
    """Every family's decoder with its elementwise work in the kernels: logits within 1e-5 of transformers' (whole
    sequence and through the static cache) and its greedy tokens through the scheduler's paged cache."""
    family = FAMILIES[name](seed=1)
    decoder = Decoder.from_state_dict(DecoderConfig.from_nemo(family.config, vocab_size=FAMILY_VOCAB),
                                      family.weights)
    calls = _counting(monkeypatch)
    check_logits_and_cache(decoder, family.hf)
    prompts = [[5, 17, 99, 250, 7], [42, 8, 9]]
    ours = generate(decoder, [decoder.embed(torch.tensor(p)) for p in prompts], prompts,
                    [SamplingParams(max_output_len=5)] * 2, eos_id=2)
    assert [beams[0] for beams in ours] == [hf_greedy(family.hf, p, 5, eos_id=2) for p in prompts]
    assert calls["norm"] and calls["split_heads"] and calls["activate"]


def test_greedy_tokens_through_the_kernels_equal_op_by_op(interpreted, monkeypatch):
    """The scheduler's model (GQA, SwiGLU, RMSNorm), prompts of several chunks and decode steps of several rows."""
    decoder = scheduler_decoder()
    prompts = [random_ids(seed, length) for seed, length in ((1, 23), (2, 4), (3, 11))]
    params = [SamplingParams(max_output_len=8)] * len(prompts)
    expected = generate(decoder, [decoder.embed(torch.tensor(p)) for p in prompts], prompts, params, eos_id=-1)
    calls = _counting(monkeypatch)
    got = generate(decoder, [decoder.embed(torch.tensor(p)) for p in prompts], prompts, params, eos_id=-1)
    assert got == expected and calls["split_heads"] >= 2 * 8


def test_the_kernel_path_imports_no_torch_dynamo():
    """A fresh process generates through the kernels (on a GPU; here under the interpreter) without importing
    torch._dynamo (torch.compile's tracer: seconds at every start)."""
    if TRITON_INTERPRETED:
        pytest.skip("runs a process of its own")
    root = Path(__file__).resolve().parents[1]
    cuda = torch.cuda.is_available()
    code = ("import sys, torch; from exporter.llm import SamplingParams, fused_triton, model; "
            "from exporter.runtime.scheduler import generate; from support.decoders import scheduler_decoder; "
            "calls = []; split = fused_triton.split_heads; "
            "fused_triton.split_heads = lambda *a: calls.append(1) or split(*a); "
            + ("decoder = scheduler_decoder().to('cuda'); " if cuda else
               "model._on_triton = lambda x: True; decoder = scheduler_decoder(); ")
            + "ids = [5, 6, 7]; generate(decoder, [decoder.embed(torch.tensor(ids, device=decoder.device))], [ids], "
            "[SamplingParams(max_output_len=3)]); print(bool(calls), 'torch._dynamo' in sys.modules)")
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(root), str(root / "tests"), os.environ.get("PYTHONPATH")]))}
    if not cuda:
        environment["TRITON_INTERPRET"] = "1"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=root,
                            env=environment)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "True False"  # the kernels ran; no torch._dynamo


def test_fused_functions_run_op_by_op_on_the_cpu():
    """Without CUDA the decoder's functions never reach the kernels."""
    assert not model_module._on_triton(torch.zeros(1))


def test_a_residual_add_of_another_dtype_runs_op_by_op(monkeypatch):
    """The norm kernel rounds the sum to x's dtype; torch promotes `x + delta`: a wider delta takes the op-by-op
    path, whose residual stream keeps the wider dtype."""
    monkeypatch.setattr(model_module, "_on_triton", lambda x: True)
    monkeypatch.setattr(fused_triton, "norm", lambda *args: pytest.fail("the kernel took a float32 delta"))
    x, delta = torch.randn(3, 8).to(torch.bfloat16), torch.randn(3, 8)
    total, _ = model_module._residual_norm(x, delta, torch.ones(8), None, 1e-5, False)
    assert total.dtype == torch.float32 and torch.equal(total, x + delta)


# (kernel, arguments as name:type, constants) at LLaVA-1.5-7B's shapes (H 4096, 32 heads of 128, fc1 2 x 11008),
# a GQA model's split (8 groups of 4), and float8 pools
def _hopper_cases():
    norm = ("x:*bf16", "delta:*bf16", "total:*bf16", "w:*bf16", "b:*bf16", "out:*bf16", "H:i32", "x_stride:i32",
            "delta_stride:i32", "eps:fp32")
    split = ("qkv:*bf16", "cos:*fp32", "sin:*fp32", "q:*bf16", "kv:*bf16", "cache:{cache}", "rows:*i64",
             "positions:*i64", "scale:*fp32", "qkv_stride:i32", "cos_stride:i32", "sin_stride:i32", "kv_stride:i32",
             "s0:i32", "s1:i32", "s2:i32", "s3:i32", "s4:i32", "s5:i32", "s6:i32", "fp8_max:fp32")
    activate = ("h:*bf16", "out:*bf16", "F:i32", "h_stride:i32")
    cases = []
    for residual in (False, True):
        for layernorm in (False, True):
            cases.append(("_fused_norm_kernel", norm, {"RESIDUAL": residual, "LAYERNORM": layernorm,
                                                       "ZERO_CENTERED": layernorm, "BLOCK": 4096, "PDL": True}, 8))
    for per_group, rotary, cache in ((1, 128, "*bf16"), (4, 64, "*fp8e4nv"), (4, 0, "*bf16")):
        cases.append(("_fused_split_heads_kernel", tuple(a.format(cache=cache) for a in split),
                      {"QPG": per_group, "DIM": 128, "ROTARY": rotary, "CACHE": True, "SCALED": cache == "*fp8e4nv",
                       "BLOCK_Q": per_group, "BLOCK_D": 128, "PDL": True}, 4 if per_group * 128 >= 2048 else 2))
    for code in range(5):
        cases.append(("_fused_activate_kernel", activate, {"ACTIVATION": code, "GATED": code < 2, "BLOCK": 1024, "PDL": True},
                      4))
    return cases


@pytest.mark.parametrize("case", _hopper_cases(), ids=lambda c: f"{c[0]}-{'-'.join(map(str, c[2].values()))}")
def test_kernels_compile_for_the_h100(case):
    """Each kernel variant builds for sm_90 (no GPU needed: Triton's own ptxas), so the CUDA path cannot fail to
    compile on the server."""
    if TRITON_INTERPRETED:
        pytest.skip("compiles in the parent run")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler import compile as compile_kernel

    name, arguments, constants, warps = case
    kernel = getattr(fused_triton, name)
    names = list(kernel.arg_names)
    kinds = [argument.split(":")[1] for argument in arguments]
    signature = dict(zip([n for n in names if n not in constants], kinds, strict=True))
    signature.update({n: "constexpr" for n in constants})
    built = compile_kernel(ASTSource(fn=kernel, signature={n: signature[n] for n in names}, constexprs=constants),
                           target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    assert built.metadata.num_warps == warps and built.asm["cubin"]
    assert "griddepcontrol.wait" in built.asm["ptx"]  # launched as a dependent (`triton_launch`)


@pytest.mark.skipif(not torch.cuda.is_available() or TRITON_INTERPRETED, reason="needs a CUDA GPU (and no interpreter)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_kernels_on_cuda_match_the_op_by_op_functions(dtype):
    """On a GPU: the three kernels in each dtype against the op-by-op functions on the same GPU (within one
    rounding step), into a pool of the dtype and a float8 one (values clamped at FP8_MAX)."""
    cuda = torch.device("cuda")
    generator = _generator(0)
    x, delta = (torch.randn(5, 4096, generator=generator).to(dtype).to(cuda) for _ in range(2))
    weight, bias = (torch.randn(4096, generator=generator).to(dtype).to(cuda) for _ in range(2))
    for norm_bias in (None, bias):
        total, normed = fused_triton.norm(x, delta, weight, norm_bias, 1e-5, norm_bias is not None)
        assert torch.equal(total, x + delta)
        assert_within_one_rounding(normed, model_module._norm(x + delta, weight, norm_bias, 1e-5,
                                                              norm_bias is not None))
    h = (torch.randn(3, 2 * 11008, generator=generator) * 3).to(dtype).to(cuda)
    for activation, gated, approximation in ACTIVATIONS:
        assert_within_one_rounding(fused_triton.activate(h, activation, gated, approximation),
                                   model_module._activate(h, activation, gated, approximation), 2 if gated else 1)
    for cache_dtype in (dtype, FP8_DTYPE):
        qkv, cos, sin = _split_inputs(6, 8, 4, 128, 128, dtype, seed=5)
        qkv, cos, sin = (qkv * 6).to(cuda), cos.to(cuda), sin.to(cuda)
        layers, layer, rows, positions = _paged_cache(cache_dtype, 6, 8, 128, "cuda")
        scale = _scales(8)[1].to(cuda) if cache_dtype == FP8_DTYPE else None
        expected_layers = layers.clone()
        expected = model_module._split_heads(qkv, cos, sin, expected_layers[1], rows, positions, scale, 8, 4, 128)
        got = fused_triton.split_heads(qkv, cos, sin, layer, rows, positions, scale, 8, 4, 128)
        for got_part, expected_part in zip(got, expected):
            assert_within_one_rounding(got_part, expected_part)
        # values are copied (and scaled and cast) as the op-by-op write does it: the same bytes; rotated keys
        # within one step of the pool's dtype
        assert torch.equal(layers[1, 1].view(torch.uint8), expected_layers[1, 1].view(torch.uint8))
        assert_within_one_rounding(layers[1, 0], expected_layers[1, 0])


@pytest.mark.skipif(not torch.cuda.is_available() or TRITON_INTERPRETED, reason="needs a CUDA GPU (and no interpreter)")
def test_captured_steps_through_the_kernels_equal_op_by_op():
    """float32 on a GPU: a prefill and 10 decode steps of 3 rows through captured graphs (the kernels inside CUDA
    graphs) give the op-by-op path's logits (within 1e-5) and the same greedy tokens."""
    decoder = scheduler_decoder().to("cuda")
    ids = torch.tensor([random_ids(seed, 16) for seed in (1, 2, 3)])
    fused, _ = captured_decode_logits(decoder, ids, 6)
    model_module.FUSE_ON_CUDA = False
    try:
        op_by_op, _ = captured_decode_logits(decoder, ids, 6)
    finally:
        model_module.FUSE_ON_CUDA = True
    assert relative_error(fused, op_by_op) < 1e-5
    assert torch.equal(fused.argmax(-1), op_by_op.argmax(-1))
