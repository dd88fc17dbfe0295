"""NeMo's `ConformerEncoder` (FastConformer) at inference: conv subsampling, relative-position multi-head
self-attention, macaron feed-forward and the convolution module, with NeMo's parameter names.

Supported: `self_attention_model: rel_pos`, `att_context_style: regular` (any left/right context), subsampling
`dw_striding` / `striding` (factor a power of two) or a linear `pre_encode` at factor 1, `xscaling`, every
`conv_norm_type`, `feat_out`, with or without biases. Anything else is refused by name.

`pos_bias_u/v` are per layer. NeMo's `untie_biases: false` shares one pair across layers (a training choice); its
state dict repeats the pair under every layer's name, so here each layer loads its own copy of the same values
(and the weights can be saved to safetensors, which refuses shared tensors).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from .errors import AudioPerceptionError
from .features import NEMO_25, check_frontend

_MASK_FILL = -10000.0  # NeMo's INF_VAL: masked attention scores


def _time_mask(lengths: Tensor, max_len: int) -> Tensor:
    """[B, T] True where the time step is inside the clip."""
    return torch.arange(max_len, device=lengths.device)[None, :] < lengths[:, None]


class ConvSubsampling(nn.Module):
    """2-D conv subsampling over (time, features): `dw_striding` or `striding`, stride 2 per stage.

    `masked=True` is NeMo >= 2.5 (`MaskedConvSequential`: steps past each clip's length zeroed before every layer and
    at the end); `masked=False` is NeMo <= 2.4 (plain `Sequential`, padding leaks into the last valid steps).
    """

    def __init__(self, kind: str, factor: int, feat_in: int, d_model: int, channels: int, *, masked: bool):
        super().__init__()
        stages = int(math.log2(factor))
        if factor < 2 or 2**stages != factor:
            raise AudioPerceptionError(f"subsampling_factor={factor} is not supported; use a power of two (or 1)")
        layers: list[nn.Module] = []
        if kind == "dw_striding":
            layers += [nn.Conv2d(1, channels, 3, 2, 1), nn.ReLU()]
            for _ in range(stages - 1):
                layers += [nn.Conv2d(channels, channels, 3, 2, 1, groups=channels), nn.Conv2d(channels, channels, 1),
                           nn.ReLU()]
        elif kind == "striding":
            for stage in range(stages):
                layers += [nn.Conv2d(1 if stage == 0 else channels, channels, 3, 2, 1), nn.ReLU()]
        else:
            raise AudioPerceptionError(f"subsampling={kind!r} is not supported; use dw_striding or striding")
        self.conv = nn.Sequential(*layers)
        self.masked = masked
        freq = feat_in
        for _ in range(stages):
            freq = _strided_length(freq)
        self.out = nn.Linear(channels * freq, d_model)

    def forward(self, x: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
        """x [B, T, F], lengths [B] -> [B, T', d_model], lengths [B] int64."""
        x = x.unsqueeze(1)
        lengths = lengths.to(torch.int64)
        for layer in self.conv:
            if self.masked:
                x = x * _time_mask(lengths, x.shape[2])[:, None, :, None].to(x.dtype)
            x = layer(x)
            if isinstance(layer, nn.Conv2d) and layer.stride[0] > 1:
                lengths = _strided_length(lengths)
        if self.masked:
            x = x * _time_mask(lengths, x.shape[2])[:, None, :, None].to(x.dtype)
        batch, channels, time, freq = x.shape
        return self.out(x.transpose(1, 2).reshape(batch, time, channels * freq)), lengths


def _strided_length(length):
    """Output length of a kernel-3, stride-2, padding-1 conv: floor((L - 1) / 2) + 1."""
    if isinstance(length, Tensor):
        return torch.div(length - 1, 2, rounding_mode="floor") + 1
    return (length - 1) // 2 + 1


def relative_positions(length: int, d_model: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    """NeMo's RelPositionalEncoding rows for relative positions T-1 ... -(T-1): [1, 2T-1, d_model], sin on even
    features and cos on odd ones, frequencies 10000^(-2k/d)."""
    positions = torch.arange(length - 1, -length, -1, dtype=torch.float32, device=device).unsqueeze(1)
    inv_freq = torch.exp(
        torch.arange(0, d_model, 2, dtype=torch.float32, device=device) * -(math.log(10000.0) / d_model)
    )
    angles = positions * inv_freq
    return torch.stack((angles.sin(), angles.cos()), dim=-1).reshape(1, -1, d_model).to(dtype)


class RelPositionMultiHeadAttention(nn.Module):
    """Transformer-XL attention: scores = ((q+u)·k + rel_shift((q+v)·p)) / sqrt(d_k), masked with -10000."""

    def __init__(self, n_heads: int, d_model: int, *, use_bias: bool):
        super().__init__()
        if d_model % n_heads:
            raise AudioPerceptionError(f"d_model={d_model} is not a multiple of n_heads={n_heads}")
        self.h, self.d_k = n_heads, d_model // n_heads
        self.linear_q = nn.Linear(d_model, d_model, bias=use_bias)
        self.linear_k = nn.Linear(d_model, d_model, bias=use_bias)
        self.linear_v = nn.Linear(d_model, d_model, bias=use_bias)
        self.linear_out = nn.Linear(d_model, d_model, bias=use_bias)
        self.linear_pos = nn.Linear(d_model, d_model, bias=False)
        self.pos_bias_u = nn.Parameter(torch.zeros(n_heads, self.d_k))
        self.pos_bias_v = nn.Parameter(torch.zeros(n_heads, self.d_k))

    def _heads(self, x: Tensor) -> Tensor:
        return x.view(x.shape[0], -1, self.h, self.d_k)

    def forward(self, x: Tensor, att_mask: Tensor, pos_emb: Tensor) -> Tensor:
        batch = x.shape[0]
        q = self._heads(self.linear_q(x))
        k = self._heads(self.linear_k(x)).transpose(1, 2)
        v = self._heads(self.linear_v(x)).transpose(1, 2)
        p = self._heads(self.linear_pos(pos_emb)).transpose(1, 2)
        content = torch.matmul((q + self.pos_bias_u).transpose(1, 2), k.transpose(-2, -1))
        position = _rel_shift(torch.matmul((q + self.pos_bias_v).transpose(1, 2), p.transpose(-2, -1)))
        scores = (content + position[..., : content.shape[-1]]) / math.sqrt(self.d_k)
        mask = att_mask.unsqueeze(1)
        attn = torch.softmax(scores.masked_fill(mask, _MASK_FILL), dim=-1).masked_fill(mask, 0.0)
        out = torch.matmul(attn, v).transpose(1, 2).reshape(batch, -1, self.h * self.d_k)
        return self.linear_out(out)


def _rel_shift(x: Tensor) -> Tensor:
    """[B, h, T, 2T-1] scores against positions T-1..-(T-1) -> entry [i, j] is for relative position i - j."""
    batch, heads, qlen, pos_len = x.shape
    x = nn.functional.pad(x, (1, 0)).view(batch, heads, -1, qlen)
    return x[:, :, 1:].reshape(batch, heads, qlen, pos_len)


class FeedForward(nn.Module):
    def __init__(self, d_model: int, d_ff: int, *, use_bias: bool):
        super().__init__()
        self.linear1 = nn.Linear(d_model, d_ff, bias=use_bias)
        self.linear2 = nn.Linear(d_ff, d_model, bias=use_bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear2(nn.functional.silu(self.linear1(x)))


class FusedBatchNorm1d(nn.Module):
    """NeMo's `fused_batch_norm`: batch norm folded into a per-channel scale and shift."""

    def __init__(self, channels: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.weight[:, None] + self.bias[:, None]


def _conv_norm(norm_type: str, channels: int) -> nn.Module:
    if norm_type == "batch_norm":
        return nn.BatchNorm1d(channels)
    if norm_type == "layer_norm":
        return nn.LayerNorm(channels)
    if norm_type == "instance_norm":
        return nn.InstanceNorm1d(channels)
    if norm_type == "fused_batch_norm":
        return FusedBatchNorm1d(channels)
    if norm_type.startswith("group_norm") and norm_type[len("group_norm"):].isdigit():
        return nn.GroupNorm(int(norm_type[len("group_norm"):]), channels)
    raise AudioPerceptionError(f"conv_norm_type={norm_type!r} is not supported")


class ConvolutionModule(nn.Module):
    """Pointwise conv -> GLU -> zero padded steps -> depthwise conv -> norm -> Swish -> pointwise conv."""

    def __init__(self, d_model: int, kernel_size: int, context: tuple[int, int], norm_type: str, *, use_bias: bool):
        super().__init__()
        self.pointwise_conv1 = nn.Conv1d(d_model, 2 * d_model, 1, bias=use_bias)
        self.depthwise_conv = nn.Conv1d(d_model, d_model, kernel_size, groups=d_model, bias=use_bias)
        self.batch_norm = _conv_norm(norm_type, d_model)  # NeMo keeps this name for every norm type
        self.pointwise_conv2 = nn.Conv1d(d_model, d_model, 1, bias=use_bias)
        self.context = context
        self.norm_over_last_axis = norm_type == "layer_norm"

    def forward(self, x: Tensor, pad_mask: Tensor) -> Tensor:
        x = nn.functional.glu(self.pointwise_conv1(x.transpose(1, 2)), dim=1)
        x = x.masked_fill(pad_mask.unsqueeze(1), 0.0)
        x = self.depthwise_conv(nn.functional.pad(x, self.context))
        x = self.batch_norm(x.transpose(1, 2)).transpose(1, 2) if self.norm_over_last_axis else self.batch_norm(x)
        return self.pointwise_conv2(nn.functional.silu(x)).transpose(1, 2)


class ConformerLayer(nn.Module):
    """x + ½FF1 -> + MHSA -> + Conv -> + ½FF2 -> LayerNorm (pre-norm residual blocks)."""

    def __init__(self, d_model: int, d_ff: int, n_heads: int, kernel_size: int, conv_context: tuple[int, int],
                 norm_type: str, *, use_bias: bool):
        super().__init__()
        self.norm_feed_forward1 = nn.LayerNorm(d_model)
        self.feed_forward1 = FeedForward(d_model, d_ff, use_bias=use_bias)
        self.norm_conv = nn.LayerNorm(d_model)
        self.conv = ConvolutionModule(d_model, kernel_size, conv_context, norm_type, use_bias=use_bias)
        self.norm_self_att = nn.LayerNorm(d_model)
        self.self_attn = RelPositionMultiHeadAttention(n_heads, d_model, use_bias=use_bias)
        self.norm_feed_forward2 = nn.LayerNorm(d_model)
        self.feed_forward2 = FeedForward(d_model, d_ff, use_bias=use_bias)
        self.norm_out = nn.LayerNorm(d_model)

    def forward(self, x: Tensor, att_mask: Tensor, pos_emb: Tensor, pad_mask: Tensor) -> Tensor:
        x = x + 0.5 * self.feed_forward1(self.norm_feed_forward1(x))
        x = x + self.self_attn(self.norm_self_att(x), att_mask, pos_emb)
        x = x + self.conv(self.norm_conv(x), pad_mask)
        x = x + 0.5 * self.feed_forward2(self.norm_feed_forward2(x))
        return self.norm_out(x)


class ConformerEncoder(nn.Module):
    """features [B, feat_in, T] + lengths -> [B, d_out, T'] + lengths (int64); NeMo's state-dict names."""

    def __init__(
        self,
        *,
        feat_in: int,
        n_layers: int,
        d_model: int,
        frontend: str,
        feat_out: int = -1,
        subsampling: str | None = "striding",
        subsampling_factor: int = 4,
        subsampling_conv_channels: int = -1,
        ff_expansion_factor: int = 4,
        n_heads: int = 4,
        att_context_size: tuple[int, int] = (-1, -1),
        xscaling: bool = True,
        conv_kernel_size: int = 31,
        conv_context_size: tuple[int, int] | None = None,
        conv_norm_type: str = "batch_norm",
        use_bias: bool = True,
    ):
        super().__init__()
        check_frontend(frontend)
        self.feat_in, self.d_model = int(feat_in), int(d_model)
        if subsampling and subsampling_factor > 1:
            channels = d_model if subsampling_conv_channels == -1 else subsampling_conv_channels
            self.pre_encode: nn.Module = ConvSubsampling(subsampling, subsampling_factor, feat_in, d_model, channels,
                                                         masked=frontend == NEMO_25)
        else:
            self.pre_encode = nn.Linear(feat_in, d_model)
        self.xscale = math.sqrt(d_model) if xscaling else None
        self.att_context_size = tuple(att_context_size)
        if conv_context_size is None:
            conv_context_size = ((conv_kernel_size - 1) // 2, (conv_kernel_size - 1) // 2)
        if sum(conv_context_size) + 1 != conv_kernel_size:
            raise AudioPerceptionError(f"conv_context_size={list(conv_context_size)} does not fit "
                                       f"conv_kernel_size={conv_kernel_size}")
        self.layers = nn.ModuleList(
            ConformerLayer(d_model, d_model * ff_expansion_factor, n_heads, conv_kernel_size, tuple(conv_context_size),
                           conv_norm_type, use_bias=use_bias)
            for _ in range(n_layers)
        )
        self.out_proj = nn.Linear(d_model, feat_out) if feat_out > 0 and feat_out != d_model else None
        self.output_dim = self.out_proj.out_features if self.out_proj is not None else d_model

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any], frontend: str, *, feat_in: int | None = None) -> ConformerEncoder:
        """Builds from NeMo's ConformerEncoder config; `feat_in` fills a config without one (SALM adapters)."""
        target = str(cfg.get("_target_", "ConformerEncoder")).rsplit(".", 1)[-1]
        if target != "ConformerEncoder":
            raise AudioPerceptionError(f"audio encoder {target} is not supported; only ConformerEncoder")
        _refuse(cfg, "self_attention_model", "rel_pos", lambda v: v == "rel_pos")
        _refuse(cfg, "att_context_style", "regular", lambda v: v == "regular")
        _refuse(cfg, "causal_downsampling", False, lambda v: not v)
        _refuse(cfg, "reduction", None, lambda v: not v or cfg.get("reduction_factor", 1) <= 1)
        _refuse(cfg, "conv_context_style", "regular", lambda v: v == "regular")
        if cfg.get("feat_in") is None and feat_in is None:
            raise AudioPerceptionError("the encoder config has no feat_in")
        kernel = int(cfg.get("conv_kernel_size", 31))
        return cls(
            feat_in=int(cfg.get("feat_in") or feat_in),
            n_layers=int(cfg["n_layers"]),
            d_model=int(cfg["d_model"]),
            frontend=frontend,
            feat_out=int(cfg.get("feat_out", -1)),
            subsampling=cfg.get("subsampling", "striding"),
            subsampling_factor=int(cfg.get("subsampling_factor", 4)),
            subsampling_conv_channels=int(cfg.get("subsampling_conv_channels", -1)),
            ff_expansion_factor=int(cfg.get("ff_expansion_factor", 4)),
            n_heads=int(cfg.get("n_heads", 4)),
            att_context_size=_first_context(cfg.get("att_context_size")),
            xscaling=bool(cfg.get("xscaling", True)),
            conv_kernel_size=kernel,
            conv_context_size=_conv_context(cfg.get("conv_context_size"), kernel),
            conv_norm_type=str(cfg.get("conv_norm_type", "batch_norm")),
            use_bias=bool(cfg.get("use_bias", True)),
        )

    def drop_biases_absent_from(self, keys: Iterable[str], prefix: str = "") -> None:
        """Removes layer biases the weights do not have (checkpoints trained with `use_bias: false` whose config
        does not say so)."""
        keys = set(keys)
        for name, module in self.layers.named_modules():
            if isinstance(module, (nn.Linear, nn.Conv1d)) and module.bias is not None:
                stem = f"{prefix}layers.{name}."
                if stem + "weight" in keys and stem + "bias" not in keys:
                    module.register_parameter("bias", None)

    def forward(self, features: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
        if features.shape[1] != self.feat_in:
            raise AudioPerceptionError(f"encoder expects {self.feat_in} features per frame, got {features.shape[1]}")
        x = features.transpose(1, 2)
        lengths = lengths.to(features.device)
        if isinstance(self.pre_encode, ConvSubsampling):
            x, lengths = self.pre_encode(x, lengths)
        else:
            x = self.pre_encode(x)
        lengths = lengths.to(torch.int64)
        if self.xscale is not None:
            x = x * self.xscale
        time = x.shape[1]
        pos_emb = relative_positions(time, self.d_model, x.device, x.dtype)
        valid = _time_mask(lengths, time)
        att_ok = valid[:, None, :] & valid[:, :, None]
        left, right = self.att_context_size
        if left >= 0 or right >= 0:
            offset = torch.arange(time, device=x.device)[None, :] - torch.arange(time, device=x.device)[:, None]
            if left >= 0:
                att_ok = att_ok & (offset >= -left)
            if right >= 0:
                att_ok = att_ok & (offset <= right)
        att_mask, pad_mask = ~att_ok, ~valid
        for layer in self.layers:
            x = layer(x, att_mask, pos_emb, pad_mask)
        if self.out_proj is not None:
            x = self.out_proj(x)
        return x.transpose(1, 2), lengths


def _refuse(cfg: Mapping[str, Any], key: str, default: Any, ok) -> None:
    value = cfg.get(key, default)
    if not ok(value):
        raise AudioPerceptionError(f"encoder {key}={value!r} is not supported (SALM encoders use {default!r})")


def _first_context(value: Any) -> tuple[int, int]:
    """att_context_size: None -> full context; a list of [left, right] pairs -> the first (NeMo's inference
    default)."""
    if not value:
        return (-1, -1)
    value = list(value)
    if isinstance(value[0], int):
        value = [value]
    left, right = (int(v) for v in value[0])
    return (left, right)


def _conv_context(value: Any, kernel: int) -> tuple[int, int] | None:
    if value is None:
        return None
    if value == "causal":
        return (kernel - 1, 0)
    left, right = (int(v) for v in value)
    return (left, right)
