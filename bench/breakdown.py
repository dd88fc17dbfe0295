"""Where the time of a batch-1 decode step and of a prompt's prefill goes on CUDA (used by ``llava_bench.py``).

For each: with the fused elementwise kernels and op by op (fusion off), and a kernel profile of the fused one
grouped by kind; for the decode step also graphs of its matrix products alone (the practical floor of a step),
by cuBLAS and by the kernel ``gemv.linear`` chose per shape, and one layer's attention by the paged decode kernel
and, over a contiguous cache, under each SDPA backend; for the prefill also the host's time to queue it eagerly
(close to the total: the host is the limit). Steps run as the scheduler runs them (``ForwardStep`` over a paged
cache of 32-position blocks).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable

import torch
import torch.nn.functional as F

from exporter.llm import gemv, paged_triton
from exporter.llm import model as model_module
from exporter.llm.model import Decoder
from exporter.llm.sampling import TokenChooser
from exporter.runtime.cuda_graphs import ForwardStep, Piece, decode_splits

BLOCK_SIZE = 32

KERNEL_KINDS = (("matmul", ("gemm", "gemv", "nvjet", "xmma", "cutlass", "splitk",
                            # the quantized products' kernels (`exporter.llm.quant.kernels`, torch's int4 kernel)
                            "_qlinear_kernel", "_packed_kernel", "_dequantize_kernel", "_fp8_rows_kernel", "int4pack")),
                ("attention", ("fmha", "attention", "flash", "_paged_")),
                ("fused elementwise (triton)", ("_fused_",)))  # `exporter.llm.fused_triton`'s kernels


def _per_call_ms(fn: Callable[[], object], calls: int = 50) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3 / calls


def _with_fusion(fused: bool, fn: Callable[[], object]) -> object:
    model_module.FUSE_ON_CUDA = fused
    try:
        return fn()
    finally:
        model_module.FUSE_ON_CUDA = True


def _kernel_profile(label: str, fn: Callable[[], object], calls: int = 5, top: int = 10) -> dict:
    """GPU time per call by kernel kind, kernel counts, and the `top` most expensive kernels."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    by_kind: dict[str, float] = defaultdict(float)
    counts: dict[str, float] = defaultdict(float)
    kernels = []
    for event in profile.key_averages():
        micros = getattr(event, "self_device_time_total", 0) or getattr(event, "self_cuda_time_total", 0)
        if micros <= 0:
            continue
        lowered = event.key.lower()
        kind = next((k for k, marks in KERNEL_KINDS if any(m in lowered for m in marks)), "other")
        by_kind[kind] += micros / calls
        counts[kind] += event.count / calls
        kernels.append((micros / calls, event.count / calls, event.key[:90]))
    kernels.sort(reverse=True)
    return {f"breakdown_{label}_kernel_us_by_kind": {k: round(v, 1) for k, v in by_kind.items()},
            f"breakdown_{label}_kernel_count_by_kind": {k: round(v, 1) for k, v in counts.items()},
            f"breakdown_{label}_top_kernels_us": [f"{us:8.1f} us x{n:5.1f} {name}" for us, n, name in kernels[:top]]}


def prefill_breakdown(decoder: Decoder, length: int) -> dict:
    """One fresh ``length``-token prompt's forward into a one-row cache (last logits only); eagerly, and as the
    scheduler runs a lone prompt (a captured graph, then the copy into its row)."""
    prompt = torch.randn(1, length, decoder.config.hidden_size, device=decoder.device, dtype=decoder.dtype) * 0.02
    cache = decoder.new_kv_cache(1, length)
    last = torch.tensor([length - 1], device=decoder.device)

    def prefill() -> None:
        decoder(prompt, kv_cache=cache, output_index=last)

    def host_ms() -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        prefill()
        elapsed = (time.perf_counter() - start) * 1e3
        torch.cuda.synchronize()
        return elapsed

    result = {}
    for fused, name in ((False, "unfused"), (True, "fused")):
        result[f"breakdown_prefill_ms_{name}"] = _with_fusion(fused, lambda: _per_call_ms(prefill, 10))
        result[f"breakdown_prefill_host_ms_{name}"] = _with_fusion(fused, host_ms)
    result.update(_kernel_profile("prefill", prefill))
    graphed, table = _paged_step(decoder, length, max_chunk=length)
    result["breakdown_prefill_ms_graphed"] = _per_call_ms(lambda: graphed.launch(0, 0, [Piece(prompt[0], 0, table)]),
                                                          10)
    return result


def _paged_step(decoder: Decoder, positions: int, max_chunk: int = 32) -> tuple[ForwardStep, list[int]]:
    """A one-row ``ForwardStep`` over a paged cache holding ``positions`` positions, and the row's block table."""
    width = -(-positions // BLOCK_SIZE) + 1
    cache = decoder.new_paged_kv_cache(width + 1, BLOCK_SIZE)
    tables = torch.arange(1, width + 1, dtype=torch.int32, device=decoder.device)[None]
    chooser = TokenChooser(1, decoder.config.vocab_size, decoder.device)
    return ForwardStep(decoder, cache, tables, chooser, max_chunk=max_chunk), tables[0].tolist()


def _matmuls_ms(decoder: Decoder, product: Callable[..., torch.Tensor]) -> float:
    """A captured graph of only a decode step's matrix products at batch 1 (same weights, same shapes), each
    computed by ``product(x, weight)``."""
    hidden = torch.randn(1, decoder.config.hidden_size, device=decoder.device, dtype=decoder.dtype)
    ffn = torch.randn(1, decoder.config.ffn_hidden_size, device=decoder.device, dtype=decoder.dtype)
    head = decoder.embedding.word_embeddings.weight if decoder.config.share_embeddings_and_output_weights \
        else decoder.output_layer.weight

    def matmuls() -> None:
        for layer in decoder.decoder.layers:
            product(hidden, layer.self_attention.linear_qkv.weight)
            product(hidden, layer.self_attention.linear_proj.weight)
            product(hidden, layer.mlp.linear_fc1.weight)
            product(ffn, layer.mlp.linear_fc2.weight)
        product(hidden, head)

    matmuls()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        matmuls()
    return _per_call_ms(graph.replay)


def _attention_backends_us(decoder: Decoder, context: int) -> dict[str, float]:
    """One layer's batch-1 decode attention over ``context + 1`` positions: the paged decode kernel (split-K as the
    step runs it, merged in place, in ``BLOCK_SIZE`` blocks), and SDPA over a contiguous span of the next multiple of 64 masked past
    the context (the layout before the paged cache) with each backend that accepts it."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    c, span = decoder.config, -(-(context + 1) // 64) * 64
    device, dtype = decoder.device, decoder.dtype
    blocks = -(-(context + 1) // BLOCK_SIZE)
    pool = torch.randn(2, blocks + 1, BLOCK_SIZE, c.num_query_groups, c.head_dim, device=device, dtype=dtype)
    tables = torch.arange(1, blocks + 1, dtype=torch.int32, device=device)[None]
    position = torch.tensor([context], device=device)
    query = torch.randn(1, c.num_attention_heads, c.head_dim, device=device, dtype=dtype)
    splits = decode_splits(1, c.num_query_groups, device)
    counters = torch.zeros(c.num_query_groups, dtype=torch.int32, device=device)  # the splits merged in place
    result = {f"paged_triton_splits{splits}": round(1e3 * _per_call_ms(
        lambda: paged_triton.decode(query, pool[0], pool[1], tables, position, None, splits, None, counters),
        200), 1)}
    q = torch.randn(1, c.num_attention_heads, 1, c.head_dim, device=device, dtype=dtype)
    layer = torch.randn(2, 1, span, c.num_query_groups, c.head_dim, device=device, dtype=dtype)
    k, v = layer.transpose(2, 3)
    mask = torch.zeros(1, 1, 1, span, device=device, dtype=dtype)
    mask[..., context + 1:] = float("-inf")
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH):
        try:
            with sdpa_kernel([backend]):
                result[backend.name] = round(1e3 * _per_call_ms(
                    lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask), 200), 1)
        except RuntimeError as error:
            result[backend.name] = repr(error)[:80]
    return result


def decode_breakdown(decoder: Decoder, context: int) -> dict:
    """A batch-1 decode step at position ``context`` (replayed graph, host work of ``ForwardStep`` included)."""
    result = {}
    for fused, name in ((False, "unfused"), (True, "fused")):
        def measure() -> float:
            step, _ = _paged_step(decoder, context + 64)
            result["_step"] = step
            return _per_call_ms(lambda: step.launch(1, context + 1, tokens=[5], positions=[context]))

        result[f"breakdown_decode_bs1_ms_{name}"] = _with_fusion(fused, measure)
    step = result.pop("_step")
    result["breakdown_decode_bs1_ms_matmuls_only_cublas"] = _matmuls_ms(decoder, F.linear)
    result["breakdown_decode_bs1_ms_matmuls_only_chosen"] = _matmuls_ms(decoder, gemv.linear)
    result["breakdown_gemv_choices"] = gemv.choices()
    result["breakdown_decode_attention_us_by_backend"] = _attention_backends_us(decoder, context)
    result["breakdown_decode_bs1_ms_queued_ahead"] = _per_call_ms(lambda: step.launch(1, context + 2))
    result.update(_kernel_profile("decode_bs1", lambda: step.launch(1, context + 1, tokens=[5], positions=[context]),
                                  10))
    return result
