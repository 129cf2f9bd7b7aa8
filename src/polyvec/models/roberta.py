"""RoBERTa and XLM-RoBERTa: BERT's encoder with fairseq positions (counted from padding_idx + 1).

Liu et al., "RoBERTa: A Robustly Optimized BERT Pretraining Approach" (2019), https://arxiv.org/abs/1907.11692;
Conneau et al., "Unsupervised Cross-lingual Representation Learning at Scale" (2020), https://arxiv.org/abs/1911.02116.
"""

from __future__ import annotations

from .bert import BertEncoder


class RobertaEncoder(BertEncoder):
    position_offset_from_padding = True
