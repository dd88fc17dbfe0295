"""The GPT-style decoder of every supported NeMo LLM, with NeMo's canonical parameter names.

The module tree mirrors Megatron-core's, so `Decoder.state_dict()` keys are exactly the canonical names that
`NemoCheckpoint.state_dict()` returns (fused per-group QKV, fused `[gate; up]` fc1) and loading is one
`load_state_dict(assign=True)` onto a meta-device model: no conversion and no second copy of the weights.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..meta_device import on_meta
from . import fused_triton
from .config import DecoderConfig
from .gemv import linear
from .moe import expert_mlp, route
from .paged_attention import FP8_DTYPE, FP8_MAX, PagedBatch, PagedKVCache, paged_attention
from .quant.linear import QuantLinear
from .tensor_parallel import Shard, TensorParallel

if TYPE_CHECKING:
    from .lora_layers import LoraBank, LoraSlots

# GELU ("gelu", "geglu") is applied with the config's approximation; "openai-gelu" is always the tanh form.
_ACTIVATION_FUNCTIONS = {
    "swiglu": F.silu,
    "reglu": F.relu,
    "openai-gelu": lambda x: F.gelu(x, approximate="tanh"),
    "squared-relu": lambda x: F.relu(x).square(),
}

# Canonical keys that belong to the LLM; everything else in a multimodal checkpoint (projector, vision tower,
# perception) is someone else's.
_LLM_KEY_PREFIXES = ("decoder.", "output_layer.")
_LLM_EMBEDDING_KEYS = ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight")
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # what `dtype` casts (not int8/uint8/float8 weights)


def select_llm_weights(state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The entries of a canonical checkpoint state dict that belong to the decoder."""
    return {
        k: v for k, v in state_dict.items() if k.startswith(_LLM_KEY_PREFIXES) or k in _LLM_EMBEDDING_KEYS
    }


@dataclass
class KVCache:
    """A preallocated static key/value cache, or a window of rows `[start, stop)` of one (the scheduler's cache is
    the paged one, `exporter.llm.paged_attention.PagedKVCache`; this is the plain path and the tests' reference).

    `data` is the whole allocation, `[layers, 2 (keys, values), rows, max_seq, kv_heads, head_dim]`. Slot `s` of a
    row holds the token at position `s`; `Decoder.forward` writes new keys at their positions, so the tensor never
    moves or grows (a captured step replays over the same tensor).
    """

    data: Tensor
    start: int = 0
    stop: int | None = None

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = self.data.shape[2]

    @property
    def window(self) -> Tensor:
        """This cache's rows of `data`: `[layers, 2, stop - start, max_seq, kv_heads, head_dim]`."""
        return self.data[:, :, self.start : self.stop]

    @property
    def keys(self) -> Tensor:
        return self.window[:, 0]

    @property
    def values(self) -> Tensor:
        return self.window[:, 1]

    @property
    def max_seq_len(self) -> int:
        return self.data.shape[3]


# Elementwise work between two matmuls runs, on CUDA, as one Triton kernel each (`exporter.llm.fused_triton`:
# norm + residual add, QKV split + RoPE + KV-cache write, activation) instead of one kernel per operation (a decode
# step is otherwise dominated by launches); elsewhere, and for what the kernels do not take (`fused_triton.fits*`:
# rows wider than a norm program holds, dtypes other than float32/float16/bfloat16), the functions below run op by
# op. Every family of `DecoderConfig` runs in the kernels (tests/test_fused_kernels.py). Set to False to run CUDA op
# by op as well (the benchmark measures both).
FUSE_ON_CUDA = True


def _on_triton(x: Tensor) -> bool:
    """Whether the elementwise work on `x` runs as a Triton kernel."""
    return FUSE_ON_CUDA and x.is_cuda and fused_triton.available()


def _norm(x: Tensor, weight: Tensor, bias: Tensor | None, eps: float, zero_centered: bool) -> Tensor:
    """LayerNorm (`bias` given) or RMSNorm of `x [N,H]`, computed in float32."""
    gamma = weight.float() + 1.0 if zero_centered else weight.float()
    x32 = x.float()
    if bias is not None:
        out = F.layer_norm(x32, x32.shape[-1:], gamma, bias.float(), eps)
    else:
        out = x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + eps) * gamma
    return out.to(x.dtype)


def _first_norm(x: Tensor, weight: Tensor, bias: Tensor | None, eps: float, zero_centered: bool) -> Tensor:
    """The norm of `x [N,H]` (`_norm`), one kernel on CUDA."""
    if _on_triton(x) and fused_triton.fits_norm(x):
        return fused_triton.norm(x, None, weight, bias, eps, zero_centered)[1]
    return _norm(x, weight, bias, eps, zero_centered)


def _residual_norm(
    x: Tensor, delta: Tensor, weight: Tensor, bias: Tensor | None, eps: float, zero_centered: bool
) -> tuple[Tensor, Tensor]:
    """`x + delta` (the residual stream, `[N,H]`) and its norm, one kernel on CUDA."""
    if _on_triton(x) and fused_triton.fits_norm(x) and fused_triton.fits_norm(delta) and delta.dtype == x.dtype:
        return fused_triton.norm(x, delta, weight, bias, eps, zero_centered)
    x = x + delta
    return x, _norm(x, weight, bias, eps, zero_centered)


def _split_heads(
    qkv: Tensor,
    cos: Tensor | None,
    sin: Tensor | None,
    cache_layer: Tensor | None,
    cache_rows: Tensor | None,
    cache_positions: Tensor | None,
    kv_scale: Tensor | None,
    groups: int,
    q_per_group: int,
    rotary_dim: int,
) -> tuple[Tensor, Tensor]:
    """NeMo's fused QKV output `[N, groups*(q_per_group+2)*d]` -> queries `[N,heads,d]` and keys and values
    stacked `[2,N,groups,d]`, RoPE applied to queries and keys (NeoX style, first `rotary_dim` dims) if `cos`
    (`[N,1,rotary_dim]`, as `sin`). With a cache, keys and values are also written to `cache_layer
    [2, rows, max_seq, groups, d]` (the whole allocation; for a paged cache `[2, blocks, block_size, groups, d]`)
    at `cache_rows [N]`, `cache_positions [N]` (rows and positions, or blocks and offsets), in the same kernel on
    CUDA; a float8 cache stores them divided by `kv_scale [2, 1, groups, 1]`."""
    if _on_triton(qkv) and fused_triton.fits(qkv):
        return fused_triton.split_heads(qkv, cos, sin, cache_layer, cache_rows, cache_positions, kv_scale, groups,
                                        q_per_group, rotary_dim)
    tokens = qkv.shape[0]
    # rows are grouped per KV head: q_per_group query heads, one key, one value
    qkv = qkv.view(tokens, groups, q_per_group + 2, -1)
    q = qkv[:, :, :q_per_group].reshape(tokens, groups * q_per_group, -1)
    k, v = qkv[:, :, q_per_group], qkv[:, :, q_per_group + 1]  # [N,groups,d]
    if cos is not None:
        q, k = _rotate(q, cos, sin, rotary_dim), _rotate(k, cos, sin, rotary_dim)
    kv = torch.stack([k, v])
    if cache_layer is not None:
        stored = kv if kv_scale is None else (kv.float() / kv_scale).clamp(-FP8_MAX, FP8_MAX)
        cache_layer[:, cache_rows, cache_positions] = stored.to(cache_layer.dtype)
    return q, kv


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, rotary_dim: int) -> Tensor:
    rot, rest = x[..., :rotary_dim].float(), x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated_half = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    return torch.cat([(rot * cos + rotated_half * sin).to(x.dtype), rest], dim=-1)


def _activate(h: Tensor, activation: str, gated: bool, gelu_approximation: str) -> Tensor:
    """`act(gate) * up` of the fused `[gate; up]` fc1 output `[N, 2F]`, or `act(h)`; one kernel on CUDA."""
    if _on_triton(h) and fused_triton.fits(h):
        return fused_triton.activate(h, activation, gated, gelu_approximation)
    if gated:
        gate, up = h.chunk(2, dim=-1)
        return _act(gate, activation, gelu_approximation) * up
    return _act(h, activation, gelu_approximation)


def _act(x: Tensor, activation: str, gelu_approximation: str) -> Tensor:
    if activation in ("gelu", "geglu"):
        return F.gelu(x, approximate=gelu_approximation)
    return _ACTIVATION_FUNCTIONS[activation](x)


class Linear(nn.Module):
    """`y = x W^T (+ b)` with Megatron's parameter names (`weight [out, in]`, optional `bias`), run by
    `gemv.linear` (a one-row product on CUDA may use the Triton matrix-vector kernel). The one place a decoder
    layer's matrix products go through (through `_project`, which adds their LoRA updates)."""

    lora: LoraSlots | None = None  # this projection's LoRA adapters (`LoraBank` sets it)

    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: Tensor, gated_silu: Callable[[Tensor], Tensor] | None = None) -> Tensor:
        """The product of `x`; `gated_silu`: of `silu(gate) * up` for `x` a gated MLP's `[gate; up]`
        (`gemv.linear`)."""
        return linear(x, self.weight, self.bias, gated_silu)


def _project(module: Linear | QuantLinear, x: Tensor, adapters: Tensor | None) -> Tensor:
    """A layer's linear module on `x [B, T, in]`, plus each row's LoRA update when the module has adapters and
    the call names each row's slot (`adapters [B]`, 0: none). A quantized module's adapters run in the model
    dtype."""
    y = module(x)
    lora = getattr(module, "lora", None)
    return y if lora is None or adapters is None else lora(y, x, adapters)


def _layer_linear(config: DecoderConfig, in_features: int, out_features: int) -> Linear | QuantLinear:
    """A decoder layer's linear module: its weight in the model dtype, or stored as `config.quantization` says."""
    if config.quantization is None:
        return Linear(in_features, out_features, bias=config.bias)
    return QuantLinear(in_features, out_features, config.bias, config.quantization)


class Norm(nn.Module):
    """LayerNorm (weight + bias) or RMSNorm (weight); zero-centred γ stores γ-1 (NeMo `layernorm1p`)."""

    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.kind = config.normalization
        self.eps = config.norm_epsilon
        self.zero_centered = config.zero_centered_gamma
        self.weight = nn.Parameter(torch.empty(config.hidden_size))
        self.bias = nn.Parameter(torch.empty(config.hidden_size)) if self.kind == "layernorm" else None

    def forward(self, x: Tensor, delta: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """`(x + delta, norm(x + delta))` for `[..., H]`: the updated residual stream and its normalised copy."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        if delta is None:
            out = _first_norm(flat, self.weight, self.bias, self.eps, self.zero_centered)
        else:
            flat, out = _residual_norm(flat, delta.reshape(-1, shape[-1]), self.weight, self.bias, self.eps,
                                       self.zero_centered)
        return flat.view(shape), out.view(shape)


class Rope:
    """NeoX-style rotary embedding of each head's first `rotary_dim` dims (Megatron's non-interleaved)."""

    def __init__(self, config: DecoderConfig):
        self.dim = config.rotary_dim
        self.base = config.rotary_base
        self.interpolation = config.seq_len_interpolation_factor or 1.0

    def cos_sin(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """`positions [B,T]` -> cos, sin `[B*T,1,rotary_dim]` in float32."""
        exponents = torch.arange(0, self.dim, 2, device=positions.device, dtype=torch.float32) / self.dim
        inv_freq = self.base**-exponents
        angles = (positions.reshape(-1, 1).float() / self.interpolation) * inv_freq  # [B*T,dim/2]
        angles = torch.cat([angles, angles], dim=-1)[:, None]  # [B*T,1,dim]
        return angles.cos(), angles.sin()


@dataclass
class _Attention:
    """What every layer's attention shares within one forward call.

    fresh: the tokens sit at positions 0..T-1 of an empty sequence, so attention is plain causal over this call's
        keys (flash attention).
    Otherwise each token attends to keys at positions <= its own, `mask [B,1,T,S]` (additive) says which.
    With a cache, each token's keys and values go to its row `cache_rows` at `cache_positions` (both `[B*T]`).
    paged: a paged cache's call (`cache` None, `cache_rows`/`cache_positions` its blocks and offsets, no mask).
    """

    fresh: bool
    cos: Tensor | None
    sin: Tensor | None
    cache: KVCache | None
    cache_rows: Tensor | None
    cache_positions: Tensor | None
    kv_len: int | None
    mask: Tensor | None
    paged: PagedBatch | None = None
    reduce: Callable[[Tensor], Tensor] | None = None  # the sum of the ranks' partial outputs (tensor parallel)

    def summed(self, partial: Tensor) -> Tensor:
        """A row-parallel layer's output: this rank's partial sum, summed over the ranks."""
        return partial if self.reduce is None else self.reduce(partial)


class SelfAttention(nn.Module):
    """Attention over this rank's heads and query groups (all of them without tensor parallelism); the output is
    this rank's partial sum of `linear_proj`."""

    def __init__(self, config: DecoderConfig, layer_number: int, shard: Shard):
        super().__init__()
        self.layer_number = layer_number
        self.heads = shard.part(config.num_attention_heads)
        self.groups = shard.part(config.num_query_groups)
        self.head_dim = config.head_dim
        self.rotary_dim = config.rotary_dim
        self.window = config.attention_window
        qkv_rows = (self.heads + 2 * self.groups) * self.head_dim
        self.linear_qkv = _layer_linear(config, config.hidden_size, qkv_rows)
        self.linear_proj = _layer_linear(config, self.heads * self.head_dim, config.hidden_size)

    def forward(self, x: Tensor, attention: _Attention, adapters: Tensor | None = None) -> Tensor:
        batch, length, _ = x.shape
        qkv = _project(self.linear_qkv, x, adapters)
        if attention.paged is not None:
            out = self._paged(qkv.view(batch * length, -1), attention).view(batch, length, -1)
            return _project(self.linear_proj, out, adapters)
        cache = attention.cache
        layer = None if cache is None else cache.data[self.layer_number]  # [2,all rows,S,groups,d]
        q, kv = _split_heads(qkv.view(batch * length, -1), attention.cos, attention.sin, layer,
                             attention.cache_rows, attention.cache_positions, None, self.groups,
                             self.heads // self.groups, self.rotary_dim)
        q = q.view(batch, length, self.heads, -1).transpose(1, 2)  # [B,heads,T,d]
        kv = kv.view(2, batch, length, self.groups, -1)
        if layer is not None and not attention.fresh:  # attend to the cache, this call's keys included
            kv = layer[:, cache.start : cache.stop, : attention.kv_len]
        kv = kv.transpose(2, 3)  # [2,B,groups,S,d]
        out = F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=attention.mask, is_causal=attention.fresh,
                                             enable_gqa=self.groups != self.heads)
        out = out.transpose(1, 2).reshape(batch, length, self.heads * self.head_dim)
        return _project(self.linear_proj, out, adapters)

    def _paged(self, qkv: Tensor, attention: _Attention) -> Tensor:
        """Write the tokens' keys and values into their blocks, then attend over the paged cache: `[N, heads*d]`."""
        cache = attention.paged.cache
        scales = cache.scales
        q, _ = _split_heads(qkv, attention.cos, attention.sin, cache.data[self.layer_number], attention.cache_rows,
                            attention.cache_positions,
                            None if scales is None else scales[self.layer_number][:, None, :, None], self.groups,
                            self.heads // self.groups, self.rotary_dim)
        return paged_attention(q, self.layer_number, attention.paged, self.window).flatten(1)


class MLP(nn.Module):
    """The dense MLP over this rank's channels; the output is this rank's partial sum of `linear_fc2`."""

    def __init__(self, config: DecoderConfig, shard: Shard):
        super().__init__()
        self.activation = (config.activation, config.gated, config.gelu_approximation)
        self.silu_gated = config.gated and config.activation == "swiglu"
        ffn = shard.part(config.ffn_hidden_size)
        self.linear_fc1 = _layer_linear(config, config.hidden_size, 2 * ffn if config.gated else ffn)
        self.linear_fc2 = _layer_linear(config, ffn, config.hidden_size)

    def forward(self, x: Tensor, adapters: Tensor | None = None) -> Tensor:
        h = _project(self.linear_fc1, x, adapters)
        if self.fuses_activation(h, adapters):
            return self.linear_fc2(h, gated_silu=self._activated)
        return _project(self.linear_fc2, self._activated(h), adapters)

    def fuses_activation(self, h: Tensor, adapters: Tensor | None) -> bool:
        """Whether fc2 is given fc1's output `h` (`[gate; up]`) with `gated_silu`: SwiGLU on CUDA without LoRA on
        fc2, where fc2's kernels that can compute silu(gate) * up as they read h do (one kernel less)."""
        return (self.silu_gated and h.is_cuda
                and (adapters is None or getattr(self.linear_fc2, "lora", None) is None))

    def _activated(self, h: Tensor) -> Tensor:
        """fc2's input from fc1's output `h [..., F or 2F]`: `act(h)`, or `act(gate) * up`."""
        return _activate(h.view(-1, h.shape[-1]), *self.activation).view(*h.shape[:-1], -1)


class Router(nn.Module):
    """Megatron's top-k router: `weight [experts, H]` scores each token's experts (in float32)."""

    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.num_moe_experts, config.hidden_size))
        self.route = functools.partial(route, topk=config.moe_router_topk, pre_softmax=config.moe_router_pre_softmax,
                                       score_function=config.moe_router_score_function,
                                       scaling_factor=config.moe_router_topk_scaling_factor)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Tokens `[N, H]` -> (weights `[N, k]` float32, experts `[N, k]`)."""
        return self.route(F.linear(x.float(), self.weight.float()))


class ExpertLinear(nn.Module):
    """The same linear layer of every expert, stacked: `weight [experts, out, in]`."""

    def __init__(self, experts: int, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, out_features, in_features))


class Experts(nn.Module):
    def __init__(self, config: DecoderConfig):
        super().__init__()
        ffn = config.expert_ffn_hidden_size
        self.linear_fc1 = ExpertLinear(config.num_moe_experts, config.hidden_size, 2 * ffn if config.gated else ffn)
        self.linear_fc2 = ExpertLinear(config.num_moe_experts, ffn, config.hidden_size)


class MoELayer(nn.Module):
    """A mixture-of-experts MLP (Megatron's `MoELayer`): each token through its router's top-k experts, their
    outputs summed with the router's weights (`exporter.llm.moe`)."""

    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.router = Router(config)
        self.experts = Experts(config)
        self.activation = (config.activation, config.gated, config.gelu_approximation)

    def forward(self, x: Tensor, adapters: Tensor | None = None) -> Tensor:
        """`adapters` is accepted for the layer's sake: LoRA does not adapt experts (`LoraBank` refuses)."""
        flat = x.reshape(-1, x.shape[-1])
        weights, chosen = self.router(flat)
        out = expert_mlp(flat, self.experts.linear_fc1.weight, self.experts.linear_fc2.weight, weights, chosen,
                         lambda h: _activate(h, *self.activation))
        return out.view(x.shape)


class TransformerLayer(nn.Module):
    """Pre-norm layer: attention, then the MLP (or a mixture of experts); with `parallel_attention_mlp` both read
    the layer input (Falcon), through one shared norm when `shared_input_norm`."""

    def __init__(self, config: DecoderConfig, layer_number: int, shard: Shard):
        super().__init__()
        self.parallel = config.parallel_attention_mlp
        self.input_layernorm = Norm(config)
        self.self_attention = SelfAttention(config, layer_number, shard)
        self.pre_mlp_layernorm = None if config.shared_input_norm else Norm(config)
        self.mlp = MoELayer(config) if config.num_moe_experts else MLP(config, shard)

    def forward(self, x: Tensor, delta: Tensor | None, attention: _Attention,
                adapters: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Add the previous layer's output `delta` to the residual stream `x`; return the stream and this layer's
        output (each residual add is fused into the norm that follows it). `adapters`: each row's LoRA slot.
        Under tensor parallelism each output is summed over the ranks (one all-reduce after attention, one after the
        MLP; one for both in a parallel block)."""
        x, h = self.input_layernorm(x, delta)
        if not self.parallel:
            x, h = self.pre_mlp_layernorm(x, attention.summed(self.self_attention(h, attention, adapters)))
            return x, attention.summed(self.mlp(h, adapters))
        mlp_input = h if self.pre_mlp_layernorm is None else self.pre_mlp_layernorm(x)[1]
        return x, attention.summed(self.self_attention(h, attention, adapters) + self.mlp(mlp_input, adapters))


class Embedding(nn.Module):
    """Word embeddings (on rank 0 only under tensor parallelism) and learned position embeddings."""

    def __init__(self, config: DecoderConfig, shard: Shard):
        super().__init__()
        if shard.leader:
            self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        if config.position_embedding_type == "learned_absolute":
            self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)


class TransformerBlock(nn.Module):
    def __init__(self, config: DecoderConfig, shard: Shard):
        super().__init__()
        self.layers = nn.ModuleList(TransformerLayer(config, i, shard) for i in range(config.num_layers))
        self.final_layernorm = Norm(config)


class Decoder(nn.Module):
    """Pre-norm GPT decoder driven by `DecoderConfig`; parameter names are NeMo's canonical names.

    `forward` takes input embeddings so callers can splice multimodal features in place of token embeddings.
    `lora` is the bank of LoRA adapters it serves, if any (`exporter.llm.lora_layers.LoraBank` sets it).
    `shard` is the slice of the model it holds (`exporter.llm.tensor_parallel`); a part of a larger group runs
    only once `tp`, its rank's collectives, is set.
    """

    lora: LoraBank | None = None
    tp: TensorParallel | None = None

    def __init__(self, config: DecoderConfig, shard: Shard | None = None):
        super().__init__()
        self.config = config
        self.shard = shard = shard or Shard()
        self.embedding = Embedding(config, shard)
        self.decoder = TransformerBlock(config, shard)
        self.rope = Rope(config) if config.position_embedding_type == "rope" else None
        if not config.share_embeddings_and_output_weights or shard.size > 1:
            self.output_layer = Linear(config.hidden_size, shard.vocab_part(config.vocab_size), bias=False)

    @classmethod
    def from_state_dict(
        cls,
        config: DecoderConfig,
        state_dict: Mapping[str, Tensor],
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        shard: Shard | None = None,
    ) -> Decoder:
        """Build on the meta device and take the given tensors as parameters (cast/moved only if asked; quantized
        weights keep their stored dtype, their scales take `dtype`); `shard`: the tensors are that rank's part."""
        with on_meta():
            model = cls(config, shard)
        shapes = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
        expected, given = set(shapes), set(state_dict)
        if expected != given:
            raise ValueError(
                _describe_key_mismatch(config, missing=expected - given, unexpected=given - expected)
            )
        wrong = [f"{name}: {list(state_dict[name].shape)}, the config gives {list(shape)}"
                 for name, shape in shapes.items() if tuple(state_dict[name].shape) != shape]
        if wrong:
            raise ValueError("tensor shapes do not match the model config (check num_query_groups, kv_channels, "
                             "ffn_hidden_size, num_moe_experts):\n" + "\n".join(sorted(wrong)[:8]))
        weights = {k: v.to(device=device, dtype=dtype if v.dtype in _FLOAT_DTYPES else None)
                   for k, v in state_dict.items()}
        model.load_state_dict(weights, strict=True, assign=True)
        return model.requires_grad_(False).eval()

    @property
    def device(self) -> torch.device:
        return self.decoder.final_layernorm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.decoder.final_layernorm.weight.dtype

    @property
    def kv_heads(self) -> int:
        """The key/value heads (query groups) this rank holds and caches."""
        return self.shard.part(self.config.num_query_groups)

    def embed(self, ids: Tensor) -> Tensor:
        """Token ids `[...]` -> word embeddings `[..., H]` (position embeddings are added in `forward`); rank 0
        only under tensor parallelism."""
        return self.embedding.word_embeddings(ids)

    def new_kv_cache(self, batch_size: int, max_seq_len: int) -> KVCache:
        """A zeroed cache for `batch_size` rows of `max_seq_len` positions (model dtype and device)."""
        c = self.config
        shape = (c.num_layers, 2, batch_size, max_seq_len, self.kv_heads, c.head_dim)
        return KVCache(torch.zeros(shape, dtype=self.dtype, device=self.device))

    def new_paged_kv_cache(self, num_blocks: int, block_size: int, scales: Tensor | None = None) -> PagedKVCache:
        """A zeroed block pool (block 0 the null block) in the model dtype, or in float8 e4m3 with `scales
        [layers, 2, kv_heads]` (`exporter.llm.paged_attention`), its blocks stored head-major (see there)."""
        c = self.config
        shape = (c.num_layers, 2, num_blocks, self.kv_heads, block_size, c.head_dim)
        dtype = self.dtype if scales is None else FP8_DTYPE
        data = torch.zeros(shape, dtype=dtype, device=self.device).transpose(3, 4)
        return PagedKVCache(data, None if scales is None else scales.to(device=self.device, dtype=torch.float32))

    def forward(
        self,
        inputs_embeds: Tensor,
        positions: Tensor | None = None,
        kv_cache: KVCache | PagedBatch | None = None,
        kv_len: int | None = None,
        output_index: Tensor | None = None,
        adapters: Tensor | None = None,
    ) -> Tensor:
        """Logits for `inputs_embeds [B,T,H]`.

        positions: `[B,T]` position of each token; it is both the RoPE position and the KV-cache slot written.
            A token attends to keys at positions <= its own: its row's earlier cache slots (with a cache) or the
            tokens of its row in this call (without). Rows of different lengths are right-padded with positions
            continuing past their end; padded slots are overwritten later or masked.
            None: a fresh prompt at positions `0..T-1` (causal attention over this call; with a cache, slots
            `[0, T)` are written and `kv_len` is not used).
        kv_cache: from `new_kv_cache`; its batch must equal B. Or a `PagedBatch` over a paged cache: then
            `inputs_embeds` is `[N, 1, H]`, the batch's tokens in its order one per row, and `positions` `[N, 1]`
            is given.
        kv_len: attend to cache slots `[0, kv_len)` only (must exceed every position); default: all.
        output_index: `[B]` index along T per row; if given, only those positions' logits come back `[B,1,V]`;
            with a `PagedBatch`, `[K]` indices of the tokens (rows) whose logits come back `[K,1,V]`.
        adapters: `[B]` each row's LoRA slot in `self.lora` (0: no adapter); None: no LoRA.
        Returns logits `[B,T,V]` in the model dtype. Under tensor parallelism every rank of the group makes the
        same call (`exporter.runtime.cuda_graphs.ForwardStep` sees to it) and every rank gets the whole logits.
        """
        if self.shard.size > 1 and self.tp is None:
            raise RuntimeError("this decoder is one rank's part of a tensor-parallel model; it runs only in its "
                               "group (set `tp`)")
        batch, length, _ = inputs_embeds.shape
        attention = self._attention(positions, kv_cache, kv_len, batch, length, inputs_embeds.device)
        attention.reduce = None if self.tp is None else self.tp.reduce
        x = inputs_embeds.to(self.dtype)
        if self.config.position_embedding_type == "learned_absolute":
            x = x + self.embedding.position_embeddings(
                torch.arange(length, device=x.device)[None] if positions is None else positions
            )
        if self.config.apply_embedding_scaling:  # Gemma: sqrt(hidden), rounded to the model dtype, as NeMo and HF
            x = x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype).item()
        delta = None
        for layer in self.decoder.layers:
            x, delta = layer(x, delta, attention, adapters)
        _, x = self.decoder.final_layernorm(x, delta)
        if output_index is not None and isinstance(kv_cache, PagedBatch):
            x = x.index_select(0, output_index)
        elif output_index is not None:
            x = x.gather(1, output_index.view(batch, 1, 1).expand(batch, 1, x.shape[-1]))
        if self.shard.size > 1:
            return self.tp.gather_vocab(linear(x, self.output_layer.weight), self.config.vocab_size)
        head = (
            self.embedding.word_embeddings.weight
            if self.config.share_embeddings_and_output_weights
            else self.output_layer.weight
        )
        return linear(x, head)

    def _attention(self, positions: Tensor | None, kv_cache: KVCache | PagedBatch | None, kv_len: int | None,
                   batch: int, length: int, device: torch.device) -> _Attention:
        if isinstance(kv_cache, PagedBatch):
            cos, sin = self.rope.cos_sin(positions) if self.rope is not None else (None, None)
            blocks, offsets = kv_cache.write_slots()
            return _Attention(False, cos, sin, None, blocks, offsets, None, None, paged=kv_cache)
        window = self.config.attention_window
        fresh = positions is None and (window is None or length <= window + 1)  # no key outside the window
        if positions is None:
            positions = torch.arange(length, device=device).expand(batch, length)
        cos, sin = self.rope.cos_sin(positions) if self.rope is not None else (None, None)
        cache_rows = cache_positions = None
        if kv_cache is not None:
            cache_rows = torch.arange(kv_cache.start, kv_cache.stop, device=device).repeat_interleave(length)
            cache_positions = positions.flatten()
        if fresh:
            return _Attention(True, cos, sin, kv_cache, cache_rows, cache_positions, None, None)
        if kv_cache is None:
            key_positions = positions
        else:
            kv_len = kv_len or kv_cache.max_seq_len
            key_positions = torch.arange(kv_len, device=device)[None]
        allowed = key_positions[:, None, None, :] <= positions[:, None, :, None]  # [B,1,T,S]: causal, per row
        if window is not None:
            allowed &= key_positions[:, None, None, :] >= positions[:, None, :, None] - window
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=device).masked_fill_(~allowed, float("-inf"))
        return _Attention(False, cos, sin, kv_cache, cache_rows, cache_positions, kv_len, mask)


def _describe_key_mismatch(config: DecoderConfig, missing: set[str], unexpected: set[str]) -> str:
    lines = ["the state dict does not match the decoder built from the model config"]
    if missing:
        lines.append(f"missing keys ({len(missing)}): {sorted(missing)}")
    if unexpected:
        lines.append(f"unexpected keys ({len(unexpected)}): {sorted(unexpected)}")
    if "output_layer.weight" in missing:
        lines.append("hint: output_layer.weight is absent; set share_embeddings_and_output_weights: True")
    if "output_layer.weight" in unexpected:
        lines.append("hint: output_layer.weight is present; set share_embeddings_and_output_weights: False")
    if any(".mlp.experts.weight" in k for k in unexpected):
        lines.append("hint: expert weights in Megatron's GroupedMLP weight1/weight2 layout are not supported; "
                     "save the checkpoint as a dist checkpoint or with per-expert weights")
    if any(k.endswith(".bias") for k in missing | unexpected):
        lines.append(
            f"hint: check `bias` (now {config.bias}) and `normalization` (now {config.normalization})"
        )
    return "\n".join(lines)
