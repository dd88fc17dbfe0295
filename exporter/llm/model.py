"""The GPT-style decoder of every supported NeMo LLM, with NeMo's canonical parameter names.

The module tree mirrors Megatron-core's, so `Decoder.state_dict()` keys are exactly the canonical names that
`NemoCheckpoint.state_dict()` returns (fused per-group QKV, fused `[gate; up]` fc1) and loading is one
`load_state_dict(assign=True)` onto a meta-device model: no conversion and no second copy of the weights.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import DecoderConfig

_ACTIVATION_FUNCTIONS = {
    "swiglu": F.silu,
    "geglu": F.gelu,
    "reglu": F.relu,
    "gelu": F.gelu,
    "openai-gelu": lambda x: F.gelu(x, approximate="tanh"),
    "squared-relu": lambda x: F.relu(x).square(),
}

# Canonical keys that belong to the LLM; everything else in a multimodal checkpoint (projector, vision tower,
# perception) is someone else's.
_LLM_KEY_PREFIXES = ("decoder.", "output_layer.")
_LLM_EMBEDDING_KEYS = ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight")


def select_llm_weights(state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The entries of a canonical checkpoint state dict that belong to the decoder."""
    return {
        k: v for k, v in state_dict.items() if k.startswith(_LLM_KEY_PREFIXES) or k in _LLM_EMBEDDING_KEYS
    }


@dataclass
class KVCache:
    """A preallocated key/value cache: `keys`/`values` are `[layers, batch, kv_heads, max_seq, head_dim]`.

    Slot `s` of a row holds the token at position `s`; `Decoder.forward` writes new keys at their positions,
    so the tensors never move or grow (usable under CUDA graphs).
    """

    keys: Tensor
    values: Tensor

    @property
    def max_seq_len(self) -> int:
        return self.keys.shape[3]

    def reorder_(self, rows: Tensor) -> None:
        """Row i becomes a copy of old row `rows[i]` (beam search), in place."""
        self.keys.copy_(self.keys.index_select(1, rows))
        self.values.copy_(self.values.index_select(1, rows))


class Norm(nn.Module):
    """LayerNorm (weight + bias) or RMSNorm (weight); zero-centred γ stores γ-1 (NeMo `layernorm1p`)."""

    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.kind = config.normalization
        self.eps = config.norm_epsilon
        self.zero_centered = config.zero_centered_gamma
        self.weight = nn.Parameter(torch.empty(config.hidden_size))
        self.bias = nn.Parameter(torch.empty(config.hidden_size)) if self.kind == "layernorm" else None

    def forward(self, x: Tensor) -> Tensor:
        weight = self.weight.float() + 1.0 if self.zero_centered else self.weight.float()
        x32 = x.float()
        if self.kind == "layernorm":
            out = F.layer_norm(x32, x32.shape[-1:], weight, self.bias.float(), self.eps)
        else:
            out = x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + self.eps) * weight
        return out.to(x.dtype)


class Rope:
    """NeoX-style rotary embedding of each head's first `rotary_dim` dims (Megatron's non-interleaved)."""

    def __init__(self, config: DecoderConfig):
        self.dim = config.rotary_dim
        self.base = config.rotary_base
        self.interpolation = config.seq_len_interpolation_factor or 1.0

    def cos_sin(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """`positions [B,T]` -> cos, sin `[B,1,T,rotary_dim]` in float32."""
        exponents = torch.arange(0, self.dim, 2, device=positions.device, dtype=torch.float32) / self.dim
        inv_freq = self.base**-exponents
        angles = (positions.float() / self.interpolation)[..., None] * inv_freq  # [B,T,dim/2]
        angles = torch.cat([angles, angles], dim=-1)[:, None]  # [B,1,T,dim]
        return angles.cos(), angles.sin()

    def rotate(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Rotate `x [B,heads,T,head_dim]`."""
        rot, rest = x[..., : self.dim].float(), x[..., self.dim :]
        half = self.dim // 2
        rotated_half = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
        return torch.cat([(rot * cos + rotated_half * sin).to(x.dtype), rest], dim=-1)


class SelfAttention(nn.Module):
    def __init__(self, config: DecoderConfig, layer_number: int):
        super().__init__()
        self.layer_number = layer_number
        self.heads = config.num_attention_heads
        self.groups = config.num_query_groups
        self.head_dim = config.head_dim
        qkv_rows = (self.heads + 2 * self.groups) * self.head_dim
        self.linear_qkv = nn.Linear(config.hidden_size, qkv_rows, bias=config.bias)
        self.linear_proj = nn.Linear(self.heads * self.head_dim, config.hidden_size, bias=config.bias)

    def forward(
        self,
        x: Tensor,
        positions: Tensor,
        mask: Tensor,
        rope: Rope | None,
        cos_sin: tuple[Tensor, Tensor] | None,
        kv_cache: KVCache | None,
        kv_len: int | None,
    ) -> Tensor:
        batch, length, _ = x.shape
        q_per_group = self.heads // self.groups
        # NeMo's fused QKV rows are grouped per KV head: q_per_group query heads, one key, one value.
        qkv = self.linear_qkv(x).view(batch, length, self.groups, q_per_group + 2, self.head_dim)
        q = qkv[:, :, :, :q_per_group].reshape(batch, length, self.heads, self.head_dim).transpose(1, 2)
        k = qkv[:, :, :, q_per_group].transpose(1, 2)  # [B,groups,T,d]
        v = qkv[:, :, :, q_per_group + 1].transpose(1, 2)
        if rope is not None:
            q, k = rope.rotate(q, *cos_sin), rope.rotate(k, *cos_sin)

        if kv_cache is not None:  # write this call's keys at their positions, then attend to the cache
            index = positions[:, None, :, None].expand(batch, self.groups, length, self.head_dim)
            layer_keys, layer_values = kv_cache.keys[self.layer_number], kv_cache.values[self.layer_number]
            layer_keys.scatter_(2, index, k)
            layer_values.scatter_(2, index, v)
            k, v = layer_keys[:, :, :kv_len], layer_values[:, :, :kv_len]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.groups != self.heads)
        return self.linear_proj(out.transpose(1, 2).reshape(batch, length, self.heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.gated = config.gated
        self.act = _ACTIVATION_FUNCTIONS[config.activation]
        fc1_rows = 2 * config.ffn_hidden_size if self.gated else config.ffn_hidden_size
        self.linear_fc1 = nn.Linear(config.hidden_size, fc1_rows, bias=config.bias)
        self.linear_fc2 = nn.Linear(config.ffn_hidden_size, config.hidden_size, bias=config.bias)

    def forward(self, x: Tensor) -> Tensor:
        h = self.linear_fc1(x)
        if self.gated:
            gate, up = h.chunk(2, dim=-1)
            h = self.act(gate) * up
        else:
            h = self.act(h)
        return self.linear_fc2(h)


class TransformerLayer(nn.Module):
    def __init__(self, config: DecoderConfig, layer_number: int):
        super().__init__()
        self.input_layernorm = Norm(config)
        self.self_attention = SelfAttention(config, layer_number)
        self.pre_mlp_layernorm = Norm(config)
        self.mlp = MLP(config)

    def forward(
        self,
        x: Tensor,
        positions: Tensor,
        mask: Tensor,
        rope: Rope | None,
        cos_sin: tuple[Tensor, Tensor] | None,
        kv_cache: KVCache | None,
        kv_len: int | None,
    ) -> Tensor:
        x = x + self.self_attention(self.input_layernorm(x), positions, mask, rope, cos_sin, kv_cache, kv_len)
        return x + self.mlp(self.pre_mlp_layernorm(x))


class Embedding(nn.Module):
    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        if config.position_embedding_type == "learned_absolute":
            self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)


class TransformerBlock(nn.Module):
    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.layers = nn.ModuleList(TransformerLayer(config, i) for i in range(config.num_layers))
        self.final_layernorm = Norm(config)


class Decoder(nn.Module):
    """Pre-norm GPT decoder driven by `DecoderConfig`; parameter names are NeMo's canonical names.

    `forward` takes input embeddings so callers can splice multimodal features in place of token embeddings.
    """

    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.config = config
        self.embedding = Embedding(config)
        self.decoder = TransformerBlock(config)
        self.rope = Rope(config) if config.position_embedding_type == "rope" else None
        if not config.share_embeddings_and_output_weights:
            self.output_layer = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @classmethod
    def from_state_dict(
        cls,
        config: DecoderConfig,
        state_dict: Mapping[str, Tensor],
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> Decoder:
        """Build on the meta device and take the given tensors as parameters (cast/moved only if asked)."""
        with torch.device("meta"):
            model = cls(config)
        expected, given = set(model.state_dict()), set(state_dict)
        if expected != given:
            raise ValueError(
                _describe_key_mismatch(config, missing=expected - given, unexpected=given - expected)
            )
        weights = {k: v.to(device=device, dtype=dtype) for k, v in state_dict.items()}
        model.load_state_dict(weights, strict=True, assign=True)
        return model.requires_grad_(False).eval()

    @property
    def device(self) -> torch.device:
        return self.embedding.word_embeddings.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embedding.word_embeddings.weight.dtype

    def embed(self, ids: Tensor) -> Tensor:
        """Token ids `[...]` -> word embeddings `[..., H]` (position embeddings are added in `forward`)."""
        return self.embedding.word_embeddings(ids)

    def new_kv_cache(self, batch_size: int, max_seq_len: int) -> KVCache:
        """A zeroed cache for `batch_size` rows of `max_seq_len` positions (model dtype and device)."""
        c = self.config
        shape = (c.num_layers, batch_size, c.num_query_groups, max_seq_len, c.head_dim)
        return KVCache(
            keys=torch.zeros(shape, dtype=self.dtype, device=self.device),
            values=torch.zeros(shape, dtype=self.dtype, device=self.device),
        )

    def forward(
        self,
        inputs_embeds: Tensor,
        positions: Tensor | None = None,
        kv_cache: KVCache | None = None,
        kv_len: int | None = None,
        output_index: Tensor | None = None,
    ) -> Tensor:
        """Logits for `inputs_embeds [B,T,H]`.

        positions: `[B,T]` position of each token (default `0..T-1`); it is both the RoPE position and the
            KV-cache slot written. A token attends to keys at positions <= its own: its row's earlier cache
            slots (with a cache) or the tokens of its row in this call (without). Rows of different lengths
            are right-padded with positions continuing past their end; padded slots are overwritten later or
            masked.
        kv_cache: from `new_kv_cache`; its batch must equal B.
        kv_len: attend to cache slots `[0, kv_len)` only (must exceed every position); default: all.
        output_index: `[B]` index along T per row; if given, only those positions' logits come back `[B,1,V]`.
        Returns logits `[B,T,V]` in the model dtype.
        """
        batch, length, _ = inputs_embeds.shape
        if positions is None:
            positions = torch.arange(length, device=inputs_embeds.device).expand(batch, length)
        x = inputs_embeds.to(self.dtype)
        if self.config.position_embedding_type == "learned_absolute":
            x = x + self.embedding.position_embeddings(positions)
        if kv_cache is None:
            key_positions = positions
        else:
            kv_len = kv_len or kv_cache.max_seq_len
            key_positions = torch.arange(kv_len, device=x.device)[None]
        mask = key_positions[:, None, None, :] <= positions[:, None, :, None]  # [B,1,T,S]: causal, per row
        cos_sin = self.rope.cos_sin(positions) if self.rope is not None else None
        for layer in self.decoder.layers:
            x = layer(x, positions, mask, self.rope, cos_sin, kv_cache, kv_len)
        if output_index is not None:
            x = x.gather(1, output_index.view(batch, 1, 1).expand(batch, 1, x.shape[-1]))
        x = self.decoder.final_layernorm(x)
        head = (
            self.embedding.word_embeddings.weight
            if self.config.share_embeddings_and_output_weights
            else self.output_layer.weight
        )
        return F.linear(x, head)


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
    if any(k.endswith(".bias") for k in missing | unexpected):
        lines.append(
            f"hint: check `bias` (now {config.bias}) and `normalization` (now {config.normalization})"
        )
    return "\n".join(lines)
