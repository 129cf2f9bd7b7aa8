"""BERT over packed sequences, and the pieces DistilBERT, RoBERTa and MPNet reuse.

Devlin et al., "BERT: Pre-training of Deep Bidirectional Transformers" (2019), https://arxiv.org/abs/1810.04805.
Post-LayerNorm encoder layers; q, k and v are fused into one projection so each layer does one matmul for
them. Parameter names follow the paper's roles; `RULES` maps the transformers checkpoint names onto them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
from torch import nn

from ..layers.activation import get_act_fn
from ..layers.attention import AttentionMetadata, varlen_attention
from ..layers.embedding import Embedding
from ..layers.layernorm import LayerNorm
from ..layers.linear import Int8Linear, linear_add
from .args import EncoderArgs
from .interface import ProjectionPacker
from .weights import Rule


class EncoderLayer(nn.Module):
    """Self-attention → add & norm → feed-forward → add & norm, on a flat [T, H] tensor."""

    def __init__(self, hidden: int, num_heads: int, intermediate: int, act: str, eps: float):
        super().__init__()
        if hidden % num_heads:
            raise ValueError(f"hidden_size {hidden} is not a multiple of num_attention_heads {num_heads}")
        self.num_heads = num_heads
        # nn.Linear until `replace_projections` swaps in the platform's forms.
        self.qkv: nn.Module = nn.Linear(hidden, 3 * hidden)
        self.attn_out: nn.Module = nn.Linear(hidden, hidden)
        self.attn_norm = LayerNorm(hidden, eps=eps)
        self.ffn_up: nn.Module = nn.Linear(hidden, intermediate)
        self.ffn_down: nn.Module = nn.Linear(intermediate, hidden)
        self.ffn_norm = LayerNorm(hidden, eps=eps)
        self.act_name = act
        self.act = get_act_fn(act)
        self.requantize_ffn = False

    def replace_projections(self, pack: ProjectionPacker) -> None:
        """Swap the projections for the platform's forms, fusing the FFN activation where `pack` can."""
        # Called once, on the nn.Linear projections the constructor made.
        qkv, attn_out, ffn_up, ffn_down = (
            cast(nn.Linear, m) for m in (self.qkv, self.attn_out, self.ffn_up, self.ffn_down)
        )
        self.qkv, self.attn_out, self.ffn_down = pack(qkv), pack(attn_out), pack(ffn_down)
        if pack.fuses(self.act_name):
            self.ffn_up, self.act = pack(ffn_up, self.act_name), get_act_fn("identity")
            # int8: the intermediate can go from the up projection's sums straight to the down projection's grid
            self.requantize_ffn = hasattr(self.ffn_up, "forward_requantized")
        else:
            self.ffn_up = pack(ffn_up)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, attn_mask: torch.Tensor | None) -> torch.Tensor:
        attn = varlen_attention(self.qkv(x), meta, self.num_heads, attn_mask)  # [T, H]
        x = self.attn_norm(linear_add(self.attn_out, attn, x))  # [T, H]
        # [T, I]; requantize_ffn is set only when ffn_up is an Int8Linear
        h = cast(Int8Linear, self.ffn_up).forward_requantized(x) if self.requantize_ffn else self.act(self.ffn_up(x))
        return self.ffn_norm(linear_add(self.ffn_down, h, x))  # [T, H]


class BertEmbeddings(nn.Module):
    def __init__(self, args: EncoderArgs):
        super().__init__()
        hidden = args.hidden_size
        self.word_embeddings = Embedding(args.vocab_size, hidden)
        self.position_embeddings = Embedding(args.max_position_embeddings, hidden)
        types = args.type_vocab_size
        self.token_type_embeddings = Embedding(types, hidden) if types > 0 else None
        self.norm = LayerNorm(hidden, eps=args.layer_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, token_type_ids: torch.Tensor | None
    ) -> torch.Tensor:
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)  # [T, H]
        if self.token_type_embeddings is not None:
            # Single-segment batches (the common case) add type 0 without a lookup per token.
            x = x + (
                self.token_type_embeddings.weight[0]
                if token_type_ids is None
                else self.token_type_embeddings(token_type_ids)
            )
        return self.norm(x)


class BertEncoder(nn.Module):
    """Embeddings + N encoder layers: packed `input_ids` [T] → hidden states [T, H]."""

    # fairseq-style models (RoBERTa, MPNet) number positions from padding_idx + 1.
    position_offset_from_padding = False
    fixed_padding_idx: int | None = None  # MPNet's: transformers fixes it at 1, whatever pad_token_id says
    causal = False

    def __init__(self, args: EncoderArgs):
        super().__init__()
        self.args = args
        self.position_offset = 0
        if self.fixed_padding_idx is not None:
            self.position_offset = self.fixed_padding_idx + 1
        elif self.position_offset_from_padding:
            if args.pad_token_id is None:
                raise ValueError(
                    f"{type(self).__name__} numbers positions from pad_token_id, which config.json sets to null"
                )
            self.position_offset = args.pad_token_id + 1
        self.embeddings = BertEmbeddings(args)
        self.layers = nn.ModuleList(
            EncoderLayer(
                args.hidden_size,
                args.num_attention_heads,
                args.intermediate_size,
                args.hidden_act,
                args.layer_norm_eps,
            )
            for _ in range(args.num_hidden_layers)
        )

    def attention_bias(self, meta: AttentionMetadata) -> torch.Tensor | None:
        return None

    def forward(
        self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None, meta: AttentionMetadata
    ) -> torch.Tensor:
        x = self.embeddings(input_ids, meta.positions + self.position_offset, token_type_ids)  # [T, H]
        attn_mask = meta.attn_mask(self.attention_bias(meta))
        for layer in self.layers:
            x = layer(x, meta, attn_mask)
        return x


# transformers name → polyvec name, for the trunk (after the base prefix, e.g. "bert.", is stripped).
_LAYER = r"^encoder\.layer\.(\d+)\."
EMBEDDING_RULES: list[Rule] = [
    (r"^embeddings\.LayerNorm\.", "encoder.embeddings.norm.", None),
    (r"^embeddings\.", "encoder.embeddings.", None),
]
FFN_RULES: list[Rule] = [
    (_LAYER + r"intermediate\.dense\.", r"encoder.layers.\1.ffn_up.", None),
    (_LAYER + r"output\.dense\.", r"encoder.layers.\1.ffn_down.", None),
    (_LAYER + r"output\.LayerNorm\.", r"encoder.layers.\1.ffn_norm.", None),
]
ENCODER_RULES: list[Rule] = (
    EMBEDDING_RULES
    + [
        (_LAYER + r"attention\.self\.query\.", r"encoder.layers.\1.qkv.", 0),
        (_LAYER + r"attention\.self\.key\.", r"encoder.layers.\1.qkv.", 1),
        (_LAYER + r"attention\.self\.value\.", r"encoder.layers.\1.qkv.", 2),
        (_LAYER + r"attention\.output\.dense\.", r"encoder.layers.\1.attn_out.", None),
        (_LAYER + r"attention\.output\.LayerNorm\.", r"encoder.layers.\1.attn_norm.", None),
    ]
    + FFN_RULES
)


# DistilBERT: BERT's layers under other names (no segment embeddings, no pooler).
_DISTIL = r"^transformer\.layer\.(\d+)\."
DISTILBERT_RULES: list[Rule] = EMBEDDING_RULES + [
    (_DISTIL + r"attention\.q_lin\.", r"encoder.layers.\1.qkv.", 0),
    (_DISTIL + r"attention\.k_lin\.", r"encoder.layers.\1.qkv.", 1),
    (_DISTIL + r"attention\.v_lin\.", r"encoder.layers.\1.qkv.", 2),
    (_DISTIL + r"attention\.out_lin\.", r"encoder.layers.\1.attn_out.", None),
    (_DISTIL + r"sa_layer_norm\.", r"encoder.layers.\1.attn_norm.", None),
    (_DISTIL + r"ffn\.lin1\.", r"encoder.layers.\1.ffn_up.", None),
    (_DISTIL + r"ffn\.lin2\.", r"encoder.layers.\1.ffn_down.", None),
    (_DISTIL + r"output_layer_norm\.", r"encoder.layers.\1.ffn_norm.", None),
]


# ---------------------------------------------------------------------------------------------- heads


class BertSequenceHead(nn.Module):
    """BertForSequenceClassification: tanh(pooler(h_CLS)) → classifier."""

    activation: Callable[[torch.Tensor], torch.Tensor] = staticmethod(torch.tanh)

    def __init__(self, hidden: int, num_labels: int):
        super().__init__()
        self.pooler_dense = nn.Linear(hidden, hidden)
        self.classifier = nn.Linear(hidden, num_labels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.activation(self.pooler_dense(x)))  # [N, H] → [N, labels]


class RobertaSequenceHead(nn.Module):
    """RobertaClassificationHead (also MPNet's): dense → tanh → out_proj."""

    def __init__(self, hidden: int, num_labels: int):
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, num_labels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.tanh(self.dense(x)))  # [N, H] → [N, labels]


class DistilBertSequenceHead(BertSequenceHead):
    """DistilBertForSequenceClassification: classifier(relu(pre_classifier(h_CLS))), pre_classifier in BERT's
    pooler's place."""

    activation = staticmethod(torch.relu)


class MaskedLMHead(nn.Module):
    """Transform (dense → act → LayerNorm) → vocabulary decoder, whose weight is usually tied to the input
    embeddings."""

    def __init__(self, hidden: int, vocab: int, act: str, eps: float):
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)
        self.act = get_act_fn(act)
        self.norm = LayerNorm(hidden, eps=eps)
        self.decoder = nn.Linear(hidden, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.act(self.dense(x)))
        return self.decoder(h.to(self.decoder.weight.dtype)).float()  # [T, H] → [T, vocab]


BERT_HEAD_RULES: dict[str, list[Rule]] = {
    "ForSequenceClassification": [
        (r"^pooler\.dense\.", "sequence_head.pooler_dense.", None),
        (r"^classifier\.", "sequence_head.classifier.", None),
    ],
    "ForTokenClassification": [(r"^classifier\.", "token_head.", None)],
    "ForMaskedLM": [
        (r"^cls\.predictions\.transform\.dense\.", "token_head.dense.", None),
        (r"^cls\.predictions\.transform\.LayerNorm\.", "token_head.norm.", None),
        (r"^cls\.predictions\.decoder\.weight$", "token_head.decoder.weight", None),
        (r"^cls\.predictions\.(decoder\.)?bias$", "token_head.decoder.bias", None),
    ],
}

ROBERTA_HEAD_RULES: dict[str, list[Rule]] = {
    "ForSequenceClassification": [(r"^classifier\.", "sequence_head.", None)],
    "ForTokenClassification": [(r"^classifier\.", "token_head.", None)],
    "ForMaskedLM": [
        (r"^lm_head\.dense\.", "token_head.dense.", None),
        (r"^lm_head\.layer_norm\.", "token_head.norm.", None),
        (r"^lm_head\.decoder\.weight$", "token_head.decoder.weight", None),
        (r"^lm_head\.(decoder\.)?bias$", "token_head.decoder.bias", None),
    ],
}

DISTILBERT_HEAD_RULES: dict[str, list[Rule]] = {
    "ForSequenceClassification": [
        (r"^pre_classifier\.", "sequence_head.pooler_dense.", None),
        (r"^classifier\.", "sequence_head.classifier.", None),
    ],
    "ForTokenClassification": [(r"^classifier\.", "token_head.", None)],
    "ForMaskedLM": [
        (r"^vocab_transform\.", "token_head.dense.", None),
        (r"^vocab_layer_norm\.", "token_head.norm.", None),
        (r"^vocab_projector\.", "token_head.decoder.", None),
    ],
}
