"""Gemma 3 text as EmbeddingGemma runs it (Gemma Team, "Gemma 3", 2025, https://arxiv.org/abs/2503.19786;
"EmbeddingGemma", 2025, https://arxiv.org/abs/2509.20354): a decoder block with four RMSNorms scaled by (1 + w)
(before and after attention, before and after the MLP), q/k norms, a GeGLU MLP (tanh GELU), embeddings scaled by
√hidden, queries scaled by query_pre_attn_scalar^-½, and `use_bidirectional_attention`: local layers attend both
ways within the sliding window, global layers to the whole prompt. Local and global layers turn their rotary
positions at their own base (rope_local_base_freq / rope_theta; transformers 5 nests both in rope_parameters).
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from ..layers.attention import AttentionMetadata, varlen_attention
from .args import DecoderArgs
from .decoder import (
    ROPE_TYPES,
    DecoderLayer,
    DecoderModel,
    RMSNorm,
    apply_rope,
    cos_sin,
    rope_attention_factor,
    rope_inv_freq,
    rope_parameters,
)


class GemmaRMSNorm(RMSNorm):
    """x / rms(x) * (1 + weight), in float32 and cast back (transformers' Gemma3RMSNorm; its weight starts at 0)."""

    def __init__(self, size: int, eps: float):
        super().__init__(size, eps)
        nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


class Gemma3Layer(DecoderLayer):
    windowed_both_ways = True

    def __init__(self, args: DecoderArgs, index: int, qkv_bias: bool, qk_norm: bool):
        super().__init__(args, index, qkv_bias, qk_norm)
        hidden, eps = args.hidden_size, args.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.q_norm, self.k_norm = GemmaRMSNorm(self.head_dim, eps), GemmaRMSNorm(self.head_dim, eps)
        # the attention scales by head_dim^-½; Gemma by query_pre_attn_scalar^-½
        self.q_scale = math.sqrt(self.head_dim / (args.query_pre_attn_scalar or self.head_dim))
        # transformers reads config.json's window W both ways as |query - key| < W // 2 + 1 (its config halves it)
        self.window = None if self.sliding_window is None else self.sliding_window // 2

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        h = self.input_layernorm(x)  # [T, H]
        total, group = h.shape[0], self.num_heads // self.num_kv_heads
        assert self.q_norm is not None and self.k_norm is not None  # set in __init__
        q = self.q_norm(self.q_proj(h).view(total, self.num_heads, self.head_dim))  # [T, heads, d]
        k = self.k_norm(self.k_proj(h).view(total, self.num_kv_heads, self.head_dim))  # [T, kv heads, d]
        v = self.v_proj(h).view(total, self.num_kv_heads, self.head_dim)  # [T, kv heads, d]
        q, k = apply_rope(q, cos, sin) * self.q_scale, apply_rope(k, cos, sin)
        if group > 1:  # grouped keys/values shared out to their query heads for the fused attention
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        qkv = torch.cat((q.reshape(total, -1), k.reshape(total, -1), v.reshape(total, -1)), dim=1)  # [T, 3·heads·d]
        attn = varlen_attention(qkv, meta, self.num_heads, meta.attn_mask(), self.window)  # [T, heads·d]
        x = x + self.post_attention_layernorm(self.o_proj(attn))  # [T, H]
        h = self.pre_feedforward_layernorm(x)
        return x + self.post_feedforward_layernorm(self.down_proj(self.act(self.gate_proj(h)) * self.up_proj(h)))


class Gemma3TextModel(DecoderModel):
    """Packed `input_ids` [T] → hidden states [T, H], every prompt attended both ways (EmbeddingGemma)."""

    causal = False
    qk_norm = True
    layer_class = Gemma3Layer

    def __init__(self, args: DecoderArgs):
        if args.is_causal:
            raise ValueError(
                "Gemma 3 is served as EmbeddingGemma runs it: config.json needs use_bidirectional_attention: true"
            )
        if args.attn_logit_softcapping:
            raise ValueError("Gemma 3 attn_logit_softcapping is not supported")
        super().__init__(args)
        self.norm = GemmaRMSNorm(args.hidden_size, args.rms_norm_eps)
        local, full = _rope_args(args)
        self._rope = {"sliding_attention": local, "full_attention": full}
        for kind, rope in self._rope.items():  # at load, not in every request's forward pass (all 500s)
            if (rope_type := rope_parameters(rope)["rope_type"]) not in ROPE_TYPES:
                raise ValueError(f"{kind} rope type {rope_type!r} (config.json) is not supported; supported: "
                                 f"{', '.join(ROPE_TYPES)}")  # fmt: skip
        self._tables: dict[str, tuple[torch.Tensor, float]] = {}

    def _cos_sin(self, kind: str, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if kind not in self._tables or self._tables[kind][0].device != positions.device:
            args = self._rope[kind]
            self._tables[kind] = (rope_inv_freq(args, self.head_dim).to(positions.device), rope_attention_factor(args))
        inv_freq, factor = self._tables[kind]
        return cos_sin(positions.float().unsqueeze(1) * inv_freq.unsqueeze(0), factor, dtype)  # [T, d/2] angles

    def forward(
        self,
        input_ids: torch.Tensor | None,
        token_type_ids: torch.Tensor | None,
        meta: AttentionMetadata,
        embeds: torch.Tensor | None = None,
        rope_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if embeds is None:  # scaled by √hidden in the weights' dtype, as transformers does
            weight = self.embed_tokens.weight
            embeds = self.embed_tokens(input_ids) * torch.tensor(self.args.hidden_size**0.5, dtype=weight.dtype)
        x = embeds  # [T, H]
        tables = {kind: self._cos_sin(kind, meta.positions, x.dtype) for kind in self._rope}
        for layer in self.layers:
            x = layer(x, *tables["sliding_attention" if layer.sliding_window else "full_attention"], meta)
        return self.norm(x)


def _rope_args(args: DecoderArgs) -> tuple[DecoderArgs, DecoderArgs]:
    """(local, global) layers' rope settings: transformers 5's rope_parameters per layer type, or the older
    rope_local_base_freq (default rope) beside rope_theta + rope_scaling (the global layers')."""
    nested = args.rope_parameters or {}
    if "full_attention" in nested or "sliding_attention" in nested:
        local = nested.get("sliding_attention") or {"rope_type": "default", "rope_theta": 10000.0}
        full = nested.get("full_attention") or {"rope_type": "default", "rope_theta": args.rope_theta}
        return (
            dataclasses.replace(args, rope_parameters=local, rope_scaling=None),
            dataclasses.replace(args, rope_parameters=full, rope_scaling=None),
        )
    local_theta = args.rope_local_base_freq or 10000.0
    return (
        dataclasses.replace(
            args, rope_parameters={"rope_type": "default", "rope_theta": local_theta}, rope_scaling=None
        ),
        args,
    )
