"""Decoder-only transformers (Llama, Mistral, Qwen2, Qwen3) over packed sequences, as pooling models.

Touvron et al., "LLaMA" (2023), https://arxiv.org/abs/2302.13971; Jiang et al., "Mistral 7B" (2023),
https://arxiv.org/abs/2310.06825; Qwen2 / Qwen3 technical reports (https://arxiv.org/abs/2407.10671,
https://arxiv.org/abs/2505.09388). One pre-norm block serves all four: RMSNorm → grouped-query attention
with rotary positions (Su et al., https://arxiv.org/abs/2104.09864) → RMSNorm → SwiGLU MLP. The families
differ only in switches read from `config.json`: q/k/v biases (Qwen2), per-head q/k RMSNorm (Qwen3), an
explicit `head_dim`, rope scaling (Llama 3) and a sliding window (Mistral).

Used as embedders (e5-mistral, Qwen3-Embedding: LAST pooling + normalize) or classifiers with a `score`
head; the LM head is dropped. Attention is causal and keeps keys/values in a per-request KV cache so a
long prompt can be prefilled in chunks (see `layers/attention.py`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ..layers.activation import get_act_fn
from ..layers.attention import AttentionMetadata, causal_attention, varlen_attention
from ..layers.embedding import Embedding
from ..layers.linear import linear_add
from .args import DecoderArgs
from .interface import ProjectionPacker
from .weights import Rule, load_mapped


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 (as transformers does) and cast back."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_parameters(args: DecoderArgs) -> dict[str, Any]:
    """transformers >= 5 writes `rope_parameters`; older configs `rope_theta` + `rope_scaling`."""
    params = dict(args.rope_scaling or {})
    params.update(args.rope_parameters or {})
    params.setdefault("rope_theta", args.rope_theta)
    params["rope_type"] = params.get("rope_type", params.get("type", "default")) or "default"
    if params["rope_type"] in ("llama3", "yarn", "longrope"):  # transformers' standardize_rope_params
        if args.original_max_position_embeddings is not None:  # outside the rope dict (Phi-3's): it wins
            params["original_max_position_embeddings"] = args.original_max_position_embeddings
        elif args.max_position_embeddings is not None:
            params.setdefault("original_max_position_embeddings", args.max_position_embeddings)
    return params


def rope_inv_freq(args: DecoderArgs, head_dim: int) -> torch.Tensor:
    """The rotary frequencies [head_dim / 2], with the config's scaling applied."""
    p = rope_parameters(args)
    inv_freq = 1.0 / (float(p["rope_theta"]) ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    kind = p["rope_type"]
    if kind in ("default", "mrope"):  # mrope: default frequencies, shared out among 3 positions (DecoderModel)
        return inv_freq.float()
    if kind == "linear":
        return (inv_freq / float(p["factor"])).float()
    if kind == "yarn":
        return _yarn(args, p, inv_freq, head_dim)
    if kind == "llama3":
        # Llama 3.1: long wavelengths slowed by `factor`, short ones kept, a smooth blend between.
        factor, low, high = float(p["factor"]), float(p["low_freq_factor"]), float(p["high_freq_factor"])
        old_len = float(p["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, blended, scaled).float()
    raise ValueError(f"rope type {kind!r} is not supported; supported: {', '.join(ROPE_TYPES)}")


ROPE_TYPES = ("default", "mrope", "linear", "llama3", "yarn")


def rope_attention_factor(args: DecoderArgs) -> float:
    """What cos and sin are multiplied by: YaRN's attention factor (its paper's mscale), 1 for the other types."""
    p = rope_parameters(args)
    if p["rope_type"] != "yarn":
        return 1.0
    if p.get("attention_factor") is not None:
        return float(p["attention_factor"])
    factor = _yarn_factor(args, p)

    def mscale(m: float = 1.0) -> float:
        return 0.1 * m * math.log(factor) + 1.0 if factor > 1 else 1.0

    m, m_all = p.get("mscale"), p.get("mscale_all_dim")
    return mscale(m) / mscale(m_all) if m and m_all else mscale()


def _yarn_old_len(p: dict[str, Any]) -> float:
    """The length trained on (rope_parameters fills it in as transformers does)."""
    if not p.get("original_max_position_embeddings"):
        raise ValueError("yarn rope (config.json) needs original_max_position_embeddings or max_position_embeddings")
    return float(p["original_max_position_embeddings"])


def _yarn_factor(args: DecoderArgs, p: dict[str, Any]) -> float:
    old_len = _yarn_old_len(p)
    return float(p.get("factor") or (args.max_position_embeddings or old_len) / old_len)


def _yarn(args: DecoderArgs, p: dict[str, Any], inv_freq: torch.Tensor, dim: int) -> torch.Tensor:
    """YaRN (transformers' `_compute_yarn_parameters`): frequencies that turn fewer than `beta_slow` times over
    the original length are divided by `factor`, those past `beta_fast` kept, a linear ramp between."""
    old_len, base = _yarn_old_len(p), float(p["rope_theta"])

    def correction_dim(rotations: float) -> float:  # the dimension whose frequency turns `rotations` times
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(float(p.get("beta_fast") or 32)), correction_dim(float(p.get("beta_slow") or 1))
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / ((high - low) or 0.001)).clamp(0, 1)
    return (inv_freq / _yarn_factor(args, p) * ramp + inv_freq * (1 - ramp)).float()


def cos_sin(freqs: torch.Tensor, factor: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, 1, d] of the angles `freqs` [T, d/2] (both halves), times the rope's attention factor."""
    emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)  # [T, 1, d]
    if factor != 1.0:
        return (emb.cos() * factor).to(dtype), (emb.sin() * factor).to(dtype)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate halves (the GPT-NeoX / transformers layout) of x [T, H, d] by cos/sin [T, 1, d]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class DecoderLayer(nn.Module):
    windowed_both_ways = False  # whether the layer attends both ways within a window (Gemma 3's)

    def __init__(self, args: DecoderArgs, index: int, qkv_bias: bool, qk_norm: bool):
        super().__init__()
        hidden, eps, head_dim = args.hidden_size, args.rms_norm_eps, args.head_dim
        self.index = index
        self.num_heads, self.num_kv_heads = args.num_attention_heads, args.num_key_value_heads
        self.head_dim = head_dim
        self.input_layernorm = RMSNorm(hidden, eps)
        # nn.Linear until `replace_projections` swaps in the platform's forms.
        self.q_proj: nn.Module = nn.Linear(hidden, self.num_heads * head_dim, bias=qkv_bias)
        self.k_proj: nn.Module = nn.Linear(hidden, self.num_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj: nn.Module = nn.Linear(hidden, self.num_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj: nn.Module = nn.Linear(self.num_heads * head_dim, hidden, bias=args.attention_bias)
        self.q_norm = RMSNorm(head_dim, eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps) if qk_norm else None
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.gate_proj: nn.Module = nn.Linear(hidden, args.intermediate_size, bias=args.mlp_bias)
        self.up_proj: nn.Module = nn.Linear(hidden, args.intermediate_size, bias=args.mlp_bias)
        self.down_proj: nn.Module = nn.Linear(args.intermediate_size, hidden, bias=args.mlp_bias)
        self.act = get_act_fn(args.hidden_act)
        self.sliding_window = _sliding_window(args, index)
        self.bidirectional = not args.is_causal
        if self.bidirectional and self.sliding_window is not None and not self.windowed_both_ways:
            raise ValueError("is_causal: false with a sliding window is not supported")

    def replace_projections(self, pack: ProjectionPacker) -> None:
        """Swap the seven projections for the platform's forms (the activation stays separate)."""
        for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
            setattr(self, name, pack(getattr(self, name)))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        h = self.input_layernorm(x)  # [T, H]
        total = h.shape[0]
        q = self.q_proj(h).view(total, self.num_heads, self.head_dim)  # [T, heads, d]
        k = self.k_proj(h).view(total, self.num_kv_heads, self.head_dim)  # [T, kv heads, d]
        v = self.v_proj(h).view(total, self.num_kv_heads, self.head_dim)  # [T, kv heads, d]
        if self.q_norm is not None and self.k_norm is not None:  # both or neither (Qwen3)
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.bidirectional:
            attn = self._attend_whole(q, k, v, meta)
        else:
            attn = causal_attention(q, k, v, meta, self.index, self.sliding_window)  # [T, heads, d]
        x = linear_add(self.o_proj, attn.reshape(total, self.num_heads * self.head_dim), x)  # [T, H]
        h = self.post_attention_layernorm(x)
        return linear_add(self.down_proj, self.act(self.gate_proj(h)) * self.up_proj(h), x)  # [T, H]

    def _attend_whole(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Every token of a prompt attends to all of its tokens (whole prompts, no KV cache): [T, heads·d]."""
        total, group = q.shape[0], self.num_heads // self.num_kv_heads
        if group > 1:  # grouped keys/values shared out to their query heads for the fused attention
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        qkv = torch.cat((q.reshape(total, -1), k.reshape(total, -1), v.reshape(total, -1)), dim=1)  # [T, 3·heads·d]
        return varlen_attention(qkv, meta, self.num_heads, meta.attn_mask())


def _sliding_window(args: DecoderArgs, index: int) -> int | None:
    """The layer's attention window, where its family applies one (transformers' configs): Qwen's only with
    use_sliding_window (then per layer_types, else from layer max_window_layers on), Mistral's on every layer
    unless layer_types say otherwise, any other family's per layer_types only (a Llama config's stray
    sliding_window is not used by transformers' or vLLM's Llama)."""
    window = args.sliding_window
    if not window:
        return None
    if (args.model_type or "").startswith("qwen"):
        if not args.use_sliding_window:
            return None
        if args.layer_types is None:
            return window if index >= args.max_window_layers else None
    if args.layer_types is not None:
        return window if args.layer_types[index] == "sliding_attention" else None
    return window if args.model_type == "mistral" else None


class DecoderModel(nn.Module):
    """Token embeddings + N decoder layers + final RMSNorm: packed `input_ids` [T] → hidden states [T, H]."""

    causal = True
    qkv_bias_default = False
    qk_norm = False
    layer_class: type[DecoderLayer] = DecoderLayer

    def __init__(self, args: DecoderArgs):
        super().__init__()
        kind = rope_parameters(args)["rope_type"]
        if kind not in ROPE_TYPES:  # at load, not in every request's forward pass (a server healthy, all 500s)
            raise ValueError(f"rope type {kind!r} (config.json) is not supported; supported: {', '.join(ROPE_TYPES)}")
        self.args = args
        self.head_dim = args.head_dim
        self.num_kv_heads = args.num_key_value_heads
        qkv_bias = self.qkv_bias_default or args.attention_bias
        self.embed_tokens = Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(
            self.layer_class(args, i, qkv_bias, self.qk_norm) for i in range(args.num_hidden_layers)
        )
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.causal = args.is_causal and self.causal
        # Not a buffer: the model is built on the meta device and only its parameters are loaded.
        self._inv_freq: torch.Tensor | None = None
        self._attention_factor = rope_attention_factor(args)

    def kv_shape(self) -> tuple[int, int, int]:
        """(layers, kv heads, head dim): what one token costs in a KV cache, times 2 (keys and values)."""
        return len(self.layers), self.num_kv_heads, self.head_dim

    def rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, d] for positions [T], or for Qwen2-VL's [3, T] (temporal, height, width): frequency
        section s of `mrope_section` turns with position row s."""
        if self._inv_freq is None or self._inv_freq.device != positions.device:
            self._inv_freq = rope_inv_freq(self.args, self.head_dim).to(positions.device)
        if positions.dim() == 2:
            section = self.args.mrope_section
            if section is None or sum(section) != self.head_dim // 2:
                raise ValueError(f"3-row positions need mrope_section summing to head_dim / 2, got {section}")
            rows = torch.repeat_interleave(torch.arange(len(section)), torch.tensor(section)).to(positions.device)
            freqs = positions.float()[rows].t() * self._inv_freq.unsqueeze(0)  # [T, d/2]: row rows[j] for freq j
        else:
            freqs = positions.float().unsqueeze(1) * self._inv_freq.unsqueeze(0)  # [T, d/2]
        return cos_sin(freqs, self._attention_factor, dtype)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        token_type_ids: torch.Tensor | None,
        meta: AttentionMetadata,
        embeds: torch.Tensor | None = None,
        rope_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`embeds` [T, H] instead of `input_ids` (image features in place of their tokens); `rope_positions`
        [3, T] instead of the metadata's positions (Qwen2-VL's multimodal rotary positions)."""
        x = self.embed_tokens(input_ids) if embeds is None else embeds  # [T, H]
        cos, sin = self.rotary(meta.positions if rope_positions is None else rope_positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, meta)
        return self.norm(x)


class Qwen2Model(DecoderModel):
    qkv_bias_default = True  # Qwen2 always has q/k/v biases


class Qwen3Model(DecoderModel):
    qk_norm = True


# transformers name → polyvec name (after "model." is stripped).
_L = r"^layers\.(\d+)\."
DECODER_RULES: list[Rule] = [
    (r"^embed_tokens\.", "encoder.embed_tokens.", None),
    (r"^norm\.", "encoder.norm.", None),
    (_L + r"self_attn\.", r"encoder.layers.\1.", None),
    (_L + r"mlp\.", r"encoder.layers.\1.", None),
    (_L, r"encoder.layers.\1.", None),
]
DECODER_HEAD_RULES: dict[str, list[Rule]] = {
    "ForSequenceClassification": [(r"^score\.", "sequence_head.", None)],
    "ForTokenClassification": [(r"^score\.", "token_head.", None)],
}


def load_decoder_weights(
    decoder: DecoderModel, state: dict[str, torch.Tensor], strip_prefixes: tuple[str, ...] = ()
) -> None:
    """A decoder inside a multimodal checkpoint: its tensors by transformers' names, after `strip_prefixes`."""

    class Holder(nn.Module):  # the names DECODER_RULES write to
        def __init__(self) -> None:
            super().__init__()
            self.encoder = decoder

    load_mapped(Holder(), state, DECODER_RULES, strip_prefixes=strip_prefixes)
