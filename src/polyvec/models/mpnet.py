"""MPNet: BERT-style post-LN layers plus a T5-style relative position bias shared by all layers.

Song et al., "MPNet: Masked and Permuted Pre-training for Language Understanding" (2020),
https://arxiv.org/abs/2004.09297. The bias depends only on the key-query offset, so one `[1, heads, L, L]`
tensor per batch serves every sequence in the padded attention grid.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ..layers.attention import AttentionMetadata
from ..layers.embedding import Embedding
from .args import EncoderArgs
from .bert import _LAYER, EMBEDDING_RULES, FFN_RULES, BertEncoder
from .weights import Rule


def relative_position_bucket(
    relative_position: torch.Tensor, num_buckets: int = 32, max_distance: int = 128
) -> torch.Tensor:
    """Bidirectional log-spaced buckets: exact for small offsets, logarithmic up to `max_distance`."""
    num_buckets //= 2
    n = -relative_position
    bucket = (n < 0).long() * num_buckets
    n = n.abs()
    max_exact = num_buckets // 2
    is_small = n < max_exact
    large = (
        max_exact
        + (
            torch.log(n.float().clamp(min=1) / max_exact)
            / math.log(max_distance / max_exact)
            * (num_buckets - max_exact)
        ).long()
    )
    large = large.clamp(max=num_buckets - 1)
    return bucket + torch.where(is_small, n, large)


class MPNetEncoder(BertEncoder):
    fixed_padding_idx = 1  # transformers' MPNetEmbeddings.padding_idx

    def __init__(self, args: EncoderArgs):
        args = dataclasses.replace(args, type_vocab_size=0)  # MPNet has no segment embeddings
        super().__init__(args)
        self.num_buckets = args.relative_attention_num_buckets
        self.relative_attention_bias = Embedding(self.num_buckets, args.num_attention_heads)

    def attention_bias(self, meta: AttentionMetadata) -> torch.Tensor:
        length = meta.max_seqlen
        pos = torch.arange(length, device=self.relative_attention_bias.weight.device)
        buckets = relative_position_bucket(pos[None, :] - pos[:, None], self.num_buckets)  # [L, L]
        return self.relative_attention_bias(buckets).permute(2, 0, 1).unsqueeze(0)  # [1, heads, L, L]


MPNET_ENCODER_RULES: list[Rule] = (
    EMBEDDING_RULES
    + [
        (r"^encoder\.relative_attention_bias\.", "encoder.relative_attention_bias.", None),
        (_LAYER + r"attention\.attn\.q\.", r"encoder.layers.\1.qkv.", 0),
        (_LAYER + r"attention\.attn\.k\.", r"encoder.layers.\1.qkv.", 1),
        (_LAYER + r"attention\.attn\.v\.", r"encoder.layers.\1.qkv.", 2),
        (_LAYER + r"attention\.attn\.o\.", r"encoder.layers.\1.attn_out.", None),
        (_LAYER + r"attention\.LayerNorm\.", r"encoder.layers.\1.attn_norm.", None),
    ]
    + FFN_RULES
)
