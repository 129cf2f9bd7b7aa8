"""Similarity scores between pooled outputs, accumulated in float32.

Pairing follows vLLM's `LLM.score`: 1:1 (two texts), 1:N (one text against a list), N:N (two lists of equal
length, scored pairwise).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def pair_indices(n1: int, n2: int) -> list[tuple[int, int]]:
    if n1 == 1:
        return [(0, j) for j in range(n2)]
    if n1 == n2:
        return [(i, i) for i in range(n1)]
    raise ValueError(f"text_1 has {n1} items and text_2 has {n2}: score takes 1:1, 1:N or N:N (equal lengths)")


def cosine_scores(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Row-wise cosine similarity of [N, D] and [N, D] → [N]."""
    return F.cosine_similarity(a.float(), b.float(), dim=-1)
