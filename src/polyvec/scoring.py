"""Similarity scores between texts, shared by `LLM.score` and the server's score and rerank endpoints.

Pairing follows vLLM's `LLM.score`: 1:1 (two texts), 1:N (one text against a list), N:N (two lists of equal
length, scored pairwise). Embedding models score by the cosine of the two embeddings (each distinct text is
embedded once); cross-encoders (one-label classifiers) score the joint (text_1, text_2) input.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def pair_indices(n1: int, n2: int) -> list[tuple[int, int]]:
    if n1 == 1:
        return [(0, j) for j in range(n2)]
    if n1 == n2:
        return [(i, i) for i in range(n1)]
    raise ValueError(f"text_1 has {n1} items and text_2 has {n2}: score takes 1:1, 1:N or N:N (equal lengths)")


@dataclass
class ScorePlan:
    """What to run for a score request, and how to turn the outputs into one score per pair."""

    prompts: list
    task: str  # "embed" (bi-encoder) or "classify" (cross-encoder)
    pairs: list[tuple[int, int]]
    n1: int

    def scores(self, outputs: list) -> list[float]:
        if self.task == "classify":
            return [float(o.outputs.data[0]) for o in outputs]
        vecs = torch.stack([o.outputs.data for o in outputs])
        left = vecs[[i for i, _ in self.pairs]]
        right = vecs[[self.n1 + j for _, j in self.pairs]]
        return F.cosine_similarity(left.float(), right.float(), dim=-1).tolist()

    def pair_outputs(self, outputs: list) -> list[tuple]:
        """The output(s) each pair's score came from (for token counts)."""
        if self.task == "classify":
            return [(o,) for o in outputs]
        return [(outputs[i], outputs[self.n1 + j]) for i, j in self.pairs]


def plan_scores(text_1, text_2, supported_tasks: tuple[str, ...], cross_encoder: bool) -> ScorePlan:
    texts_1 = [text_1] if isinstance(text_1, str) else list(text_1)
    texts_2 = [text_2] if isinstance(text_2, str) else list(text_2)
    if not texts_1 or not texts_2:
        raise ValueError("score needs at least one text on each side (text_1 and text_2)")
    pairs = pair_indices(len(texts_1), len(texts_2))
    if cross_encoder:
        return ScorePlan([(texts_1[i], texts_2[j]) for i, j in pairs], "classify", pairs, len(texts_1))
    if "embed" not in supported_tasks:
        raise ValueError(f"score needs an embedding model or a cross-encoder (one-label classifier); this "
                         f"model supports: {', '.join(supported_tasks)}")
    return ScorePlan(texts_1 + texts_2, "embed", pairs, len(texts_1))
