"""ModernBERT over packed sequences.

Warner et al., "Smarter, Better, Faster, Longer: A Modern Bidirectional Encoder" (2024),
https://arxiv.org/abs/2412.13663. Pre-norm encoder layers (the first has no attention norm) with bias-free
LayerNorms, rotary positions (one theta for the global layers, another for the local ones), attention that
alternates global layers with local ones (a query sees keys at most `local_attention // 2` positions away), a
GeGLU feed-forward, and a final norm; no position or segment embeddings. Attention runs on the packed batch
(the native kernel takes the local window, layers/kernels.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from ..layers import kernels
from ..layers.activation import get_act_fn
from ..layers.attention import AttentionMetadata, varlen_attention
from ..layers.embedding import Embedding
from ..layers.layernorm import LayerNorm
from ..layers.linear import linear_add, linear_mul
from .args import ModernBertArgs
from .decoder import apply_rope
from .interface import ProjectionPacker
from .weights import Rule

# Local layers: a sequence longer than this many windows' worth of tokens is attended in overlapping segments.
SEGMENT_QUERIES = 256


@dataclass
class LocalSegments:
    """A local layer's batch cut into overlapping segments, so attention costs O(n · window), not O(n²): each
    segment holds SEGMENT_QUERIES queries of one sequence plus the `window` tokens on either side of them (all
    the keys those queries can see), as a sequence of its own for the kernel."""

    rows: torch.Tensor  # [T'] the packed row each segment row copies
    cu_seqlens: torch.Tensor  # [S + 1] segment boundaries
    take: torch.Tensor  # [T] for each token, the segment row whose output is its output

    @classmethod
    def plan(cls, seq_lens: list[int], window: int, device: torch.device) -> LocalSegments | None:
        """None when no sequence is long enough to gain from segments."""
        block = max(SEGMENT_QUERIES, 2 * window)
        if max(seq_lens) <= 2 * (block + 2 * window):
            return None
        rows, take, lens = [], [], []
        start = used = 0
        for n in seq_lens:
            q0s = range(0, n, block) if n > 2 * (block + 2 * window) else [0]
            for q0 in q0s:
                q1 = n if len(q0s) == 1 else min(n, q0 + block)
                k0, k1 = (0, n) if len(q0s) == 1 else (max(0, q0 - window), min(n, q1 + window))
                rows.append(torch.arange(start + k0, start + k1))
                take.append(torch.arange(used + q0 - k0, used + q1 - k0))
                lens.append(k1 - k0)
                used += k1 - k0
            start += n
        cu = torch.zeros(len(lens) + 1, dtype=torch.long)
        torch.cumsum(torch.tensor(lens), 0, out=cu[1:])
        return cls(torch.cat(rows).to(device), cu.to(device), torch.cat(take).to(device))


class ModernBertLayer(nn.Module):
    """[norm →] attention (rotary, global or windowed) → add; norm → GeGLU → add, on a flat [T, H] tensor.

    Where the platform packs the projections, GeGLU's up projection is split in two: the input half with GELU
    fused, the gate half with the product fused (no separate activation or product pass)."""

    native = False  # set by the CPU platform where polyvec's kernels are built: rotary positions in place

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
        self.act_name = args.hidden_activation
        self.act = get_act_fn(args.hidden_activation)
        self.ffn_in: nn.Module | None = None  # the split up projection, once packed
        self.ffn_gate: nn.Module | None = None

    def replace_projections(self, pack: ProjectionPacker) -> None:
        qkv, attn_out, ffn_up, ffn_down = (
            cast(nn.Linear, m) for m in (self.qkv, self.attn_out, self.ffn_up, self.ffn_down)
        )
        self.qkv, self.attn_out, self.ffn_down = pack(qkv), pack(attn_out), pack(ffn_down)
        halves = []
        for rows in ffn_up.weight.chunk(2, dim=0):  # input, gate
            half = nn.Linear(ffn_up.in_features, rows.shape[0], bias=ffn_up.bias is not None)
            half.weight.data = rows.contiguous()
            halves.append(half)
        if ffn_up.bias is not None:
            for half, b in zip(halves, ffn_up.bias.chunk(2)):
                cast(torch.Tensor, half.bias).data = b.contiguous()
        fused = pack.fuses(self.act_name)
        self.ffn_in = pack(halves[0], self.act_name) if fused else pack(halves[0])
        self.ffn_gate = pack(halves[1])
        if fused:
            self.act = get_act_fn("identity")
        self.ffn_up = nn.Identity()  # replaced by the two halves

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        segments: LocalSegments | None = None,
    ) -> torch.Tensor:
        h = x if self.attn_norm is None else self.attn_norm(x)
        qkv = self.qkv(h)  # [T, 3H]
        total = qkv.shape[0]
        parts = qkv.view(total, 3, self.num_heads, self.head_dim)
        cos, sin = rope  # [T, d/2] float32
        # rotate q and k in place: the attention kernel reads the fused [T, 3H] layout
        if self.native and qkv.device.type == "cpu" and qkv.is_contiguous():
            torch.ops.polyvec.rope_(qkv, cos, sin, self.num_heads)
        else:
            full_cos = torch.cat((cos, cos), dim=-1).unsqueeze(1).to(qkv.dtype)  # [T, 1, d]
            full_sin = torch.cat((sin, sin), dim=-1).unsqueeze(1).to(qkv.dtype)
            parts[:, 0] = apply_rope(parts[:, 0], full_cos, full_sin)
            parts[:, 1] = apply_rope(parts[:, 1], full_cos, full_sin)
        if self.local and segments is not None:  # long sequences: overlapping segments (packed kernel only)
            seg_qkv = qkv.index_select(0, segments.rows)  # [T', 3H]
            attn = kernels.varlen_attention(seg_qkv, segments.cu_seqlens, self.num_heads, None, None, self.window)
            attn = attn.index_select(0, segments.take)  # [T, H]
        else:
            attn = varlen_attention(qkv, meta, self.num_heads, meta.attn_mask(), self.window)  # [T, H]
        x = linear_add(self.attn_out, attn, x)
        h = self.mlp_norm(x)
        if self.ffn_in is not None and self.ffn_gate is not None:
            g = linear_mul(self.ffn_gate, h, self.act(self.ffn_in(h)))  # [T, I]
        else:
            gate_in, gate = self.ffn_up(h).chunk(2, dim=-1)  # [T, I] each
            g = self.act(gate_in) * gate
        return linear_add(self.ffn_down, g, x)  # [T, H]


class ModernBertEncoder(nn.Module):
    """Token embeddings + norm → N layers → final norm: packed `input_ids` [T] → hidden states [T, H]."""

    causal = False

    def __init__(self, args: ModernBertArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = Embedding(args.vocab_size, args.hidden_size)
        self.embed_norm = LayerNorm(args.hidden_size, eps=args.norm_eps, bias=args.norm_bias)
        self.layers = nn.ModuleList(ModernBertLayer(args, i) for i in range(args.num_hidden_layers))
        self.final_norm = LayerNorm(args.hidden_size, eps=args.norm_eps, bias=args.norm_bias)
        self.head_dim = args.hidden_size // args.num_attention_heads

    def rotary(self, positions: torch.Tensor, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, d/2] in float32 (each frequency serves both halves of a head)."""
        d = self.head_dim
        inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float, device=positions.device) / d))
        freqs = positions.float().unsqueeze(1) * inv_freq.unsqueeze(0)  # [T, d/2]
        return freqs.cos(), freqs.sin()

    def forward(
        self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None, meta: AttentionMetadata
    ) -> torch.Tensor:
        x = self.embed_norm(self.tok_embeddings(input_ids))  # [T, H]
        ropes = {
            False: self.rotary(meta.positions, self.args.global_rope_theta),
            True: self.rotary(meta.positions, self.args.local_rope_theta),
        }
        segments = None
        if meta.packed and meta.key_lens is None:
            segments = LocalSegments.plan(meta.seq_lens, self.args.local_attention // 2, x.device)
        for layer in self.layers:
            x = layer(x, ropes[cast(ModernBertLayer, layer).local], meta, segments)
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
        return self.decoder(h.to(self.decoder.weight.dtype)).float()  # [T, H] → [T, vocab]


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
