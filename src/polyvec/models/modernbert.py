"""ModernBERT over packed sequences.

Warner et al., "Smarter, Better, Faster, Longer: A Modern Bidirectional Encoder" (2024),
https://arxiv.org/abs/2412.13663. Pre-norm encoder layers (the first has no attention norm) with bias-free
LayerNorms, rotary positions (one theta for the global layers, another for the local ones), attention that
alternates global layers with local ones (a query sees keys at most `local_attention // 2` positions away), a
GeGLU feed-forward, and a final norm; no position or segment embeddings. Attention runs on the packed batch
(the native kernel takes the local window, layers/kernels.py).
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from ..layers.activation import get_act_fn
from ..layers.attention import AttentionMetadata, varlen_attention
from ..layers.layernorm import LayerNorm
from ..layers.linear import linear_add
from .args import ModernBertArgs
from .decoder import apply_rope
from .interface import ProjectionPacker
from .weights import Rule


class ModernBertLayer(nn.Module):
    """[norm →] attention (rotary, global or windowed) → add; norm → GeGLU → add, on a flat [T, H] tensor."""

    def __init__(self, args: ModernBertArgs, index: int):
        super().__init__()
        hidden, eps, bias = args.hidden_size, args.norm_eps, args.norm_bias
        if hidden % args.num_attention_heads:
            raise ValueError(
                f"hidden_size {hidden} is not a multiple of num_attention_heads {args.num_attention_heads}"
            )
        self.num_heads = args.num_attention_heads
        self.head_dim = hidden // self.num_heads
        self.local = args.layer_types[index] == "sliding_attention"
        self.window = args.local_attention // 2 if self.local else None
        self.attn_norm = LayerNorm(hidden, eps=eps, bias=bias) if index else None
        # nn.Linear until `replace_projections` swaps in the platform's forms.
        self.qkv: nn.Module = nn.Linear(hidden, 3 * hidden, bias=args.attention_bias)
        self.attn_out: nn.Module = nn.Linear(hidden, hidden, bias=args.attention_bias)
        self.mlp_norm = LayerNorm(hidden, eps=eps, bias=bias)
        self.ffn_up: nn.Module = nn.Linear(hidden, 2 * args.intermediate_size, bias=args.mlp_bias)  # input, gate
        self.ffn_down: nn.Module = nn.Linear(args.intermediate_size, hidden, bias=args.mlp_bias)
        self.act = get_act_fn(args.hidden_activation)

    def replace_projections(self, pack: ProjectionPacker) -> None:
        qkv, attn_out, ffn_up, ffn_down = (
            cast(nn.Linear, m) for m in (self.qkv, self.attn_out, self.ffn_up, self.ffn_down)
        )
        self.qkv, self.attn_out, self.ffn_up, self.ffn_down = pack(qkv), pack(attn_out), pack(ffn_up), pack(ffn_down)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor:
        h = x if self.attn_norm is None else self.attn_norm(x)
        qkv = self.qkv(h)  # [T, 3H]
        total = qkv.shape[0]
        parts = qkv.view(total, 3, self.num_heads, self.head_dim)
        cos, sin = rope  # [T, 1, d]
        # rotate q and k in place: the kernel reads the fused [T, 3H] layout
        parts[:, 0] = apply_rope(parts[:, 0], cos, sin)
        parts[:, 1] = apply_rope(parts[:, 1], cos, sin)
        attn = varlen_attention(qkv, meta, self.num_heads, meta.attn_mask(), self.window)  # [T, H]
        x = linear_add(self.attn_out, attn, x)
        gate_in, gate = self.ffn_up(self.mlp_norm(x)).chunk(2, dim=-1)  # [T, I] each
        return linear_add(self.ffn_down, self.act(gate_in) * gate, x)  # [T, H]


class ModernBertEncoder(nn.Module):
    """Token embeddings + norm → N layers → final norm: packed `input_ids` [T] → hidden states [T, H]."""

    causal = False

    def __init__(self, args: ModernBertArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.hidden_size)
        self.embed_norm = LayerNorm(args.hidden_size, eps=args.norm_eps, bias=args.norm_bias)
        self.layers = nn.ModuleList(ModernBertLayer(args, i) for i in range(args.num_hidden_layers))
        self.final_norm = LayerNorm(args.hidden_size, eps=args.norm_eps, bias=args.norm_bias)
        self.head_dim = args.hidden_size // args.num_attention_heads

    def rotary(self, positions: torch.Tensor, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        d = self.head_dim
        inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float, device=positions.device) / d))
        freqs = positions.float().unsqueeze(1) * inv_freq.unsqueeze(0)  # [T, d/2]
        emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)  # [T, 1, d]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(
        self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None, meta: AttentionMetadata
    ) -> torch.Tensor:
        x = self.embed_norm(self.tok_embeddings(input_ids))  # [T, H]
        ropes = {
            False: self.rotary(meta.positions, self.args.global_rope_theta, x.dtype),
            True: self.rotary(meta.positions, self.args.local_rope_theta, x.dtype),
        }
        for layer in self.layers:
            x = layer(x, ropes[cast(ModernBertLayer, layer).local], meta)
        return self.final_norm(x)


class ModernBertHead(nn.Module):
    """ModernBertPredictionHead: dense → activation → norm (before the classifier or the vocabulary decoder)."""

    def __init__(self, args: ModernBertArgs):
        super().__init__()
        self.dense = nn.Linear(args.hidden_size, args.hidden_size, bias=args.classifier_bias)
        self.act = get_act_fn(args.classifier_activation)
        self.norm = LayerNorm(args.hidden_size, eps=args.norm_eps, bias=args.norm_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.act(self.dense(x)))


class ModernBertClassifier(nn.Module):
    """Sequence and token classification: head → classifier (`out`); a sequence classifier's pooling step (CLS or
    mean, `classifier_pooling`) comes before, and token_classify applies the whole of it to each token."""

    def __init__(self, args: ModernBertArgs, num_labels: int):
        super().__init__()
        self.head = ModernBertHead(args)
        self.out = nn.Linear(args.hidden_size, num_labels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.head(x))  # [N, H] → [N, labels]


class ModernBertMaskedLMHead(nn.Module):
    """head → vocabulary decoder, whose weight is tied to the token embeddings."""

    def __init__(self, args: ModernBertArgs):
        super().__init__()
        self.head = ModernBertHead(args)
        self.decoder = nn.Linear(args.hidden_size, args.vocab_size, bias=args.decoder_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.head(x)
        w = self.decoder.weight
        bias = None if self.decoder.bias is None else self.decoder.bias.to(w.dtype)
        return F.linear(h.to(w.dtype), w, bias).float()  # [T, H] → [T, vocab]


_L = r"^layers\.(\d+)\."
MODERNBERT_RULES: list[Rule] = [
    (r"^embeddings\.tok_embeddings\.", "encoder.tok_embeddings.", None),
    (r"^embeddings\.norm\.", "encoder.embed_norm.", None),
    (r"^final_norm\.", "encoder.final_norm.", None),
    (_L + r"attn_norm\.", r"encoder.layers.\1.attn_norm.", None),
    (_L + r"attn\.Wqkv\.", r"encoder.layers.\1.qkv.", None),
    (_L + r"attn\.Wo\.", r"encoder.layers.\1.attn_out.", None),
    (_L + r"mlp_norm\.", r"encoder.layers.\1.mlp_norm.", None),
    (_L + r"mlp\.Wi\.", r"encoder.layers.\1.ffn_up.", None),
    (_L + r"mlp\.Wo\.", r"encoder.layers.\1.ffn_down.", None),
]
MODERNBERT_HEAD_RULES: dict[str, list[Rule]] = {
    "ForSequenceClassification": [
        (r"^head\.", "sequence_head.head.", None),
        (r"^classifier\.", "sequence_head.out.", None),
    ],
    "ForTokenClassification": [(r"^head\.", "token_head.head.", None), (r"^classifier\.", "token_head.out.", None)],
    "ForMaskedLM": [(r"^head\.", "token_head.head.", None), (r"^decoder\.", "token_head.decoder.", None)],
}
