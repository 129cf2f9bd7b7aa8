"""Similarity scores between texts, shared by `LLM.score` and the server's score and rerank endpoints.

Pairing follows vLLM's `LLM.score`: 1:1 (two texts), 1:N (one text against a list), N:N (two lists of equal
length, scored pairwise). Embedding models score by the cosine of the two embeddings (each distinct text is
embedded once); cross-encoders (one-label classifiers) score the joint (text_1, text_2) input; late-interaction
models score by MaxSim (Khattab & Zaharia, "ColBERT", SIGIR 2020, https://arxiv.org/abs/2004.12832): for each
query token the best dot product over the document's tokens, summed over query tokens, in float32. text_1 is
encoded in query mode and text_2 in document mode, each text once, so a query's vectors serve all its documents.
"""

from __future__ import annotations

import dataclasses
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
        if self.task == "token_embed":
            queries = [outputs[i].outputs.data for i in range(self.n1)]
            docs = [o.outputs.data for o in outputs[self.n1:]]
            return maxsim_pairs(queries, docs, self.pairs)
        vecs = torch.stack([o.outputs.data for o in outputs])
        left = vecs[[i for i, _ in self.pairs]]
        right = vecs[[self.n1 + j for _, j in self.pairs]]
        return F.cosine_similarity(left.float(), right.float(), dim=-1).tolist()

    def params(self, base=None) -> list:
        """Per-prompt PoolingParams: late interaction encodes text_1 as queries and text_2 as documents."""
        from .pooling_params import PoolingParams

        base = base or PoolingParams()
        if self.task != "token_embed":
            return [base] * len(self.prompts)
        query, doc = (dataclasses.replace(base, input_type=t) for t in ("query", "document"))
        return [query] * self.n1 + [doc] * (len(self.prompts) - self.n1)

    def pair_outputs(self, outputs: list) -> list[tuple]:
        """The output(s) each pair's score came from (for token counts)."""
        if self.task == "classify":
            return [(o,) for o in outputs]
        return [(outputs[i], outputs[self.n1 + j]) for i, j in self.pairs]


def maxsim(query: torch.Tensor, docs: list[torch.Tensor], chunk: int = 256) -> torch.Tensor:
    """MaxSim of one query [Lq, d] against many documents (each [Ld_i, d]) → [N], float32 accumulation.

    Documents are padded per chunk into one [n, Lmax, d] tensor so the whole chunk is one batched matmul;
    padding rows get -inf before the max.
    """
    q = query.float()
    out = []
    for start in range(0, len(docs), chunk):
        part = docs[start:start + chunk]
        lens = torch.tensor([d.shape[0] for d in part])
        padded = torch.nn.utils.rnn.pad_sequence([d.float() for d in part], batch_first=True)  # [n, L, d]
        sims = torch.einsum("qd,nld->nql", q, padded)
        valid = torch.arange(padded.shape[1])[None, :] < lens[:, None]  # [n, L]
        sims = sims.masked_fill(~valid[:, None, :], float("-inf"))
        out.append(sims.amax(dim=2).sum(dim=1))
    return torch.cat(out) if out else torch.zeros(0)


def maxsim_pairs(queries: list[torch.Tensor], docs: list[torch.Tensor], pairs: list[tuple[int, int]]) -> list[float]:
    scores = [0.0] * len(pairs)
    by_query: dict[int, list[int]] = {}
    for k, (i, _) in enumerate(pairs):
        by_query.setdefault(i, []).append(k)
    for i, members in by_query.items():  # one batched MaxSim per distinct query
        values = maxsim(queries[i], [docs[pairs[k][1]] for k in members]).tolist()
        for k, v in zip(members, values):
            scores[k] = v
    return scores


def plan_scores(text_1, text_2, supported_tasks: tuple[str, ...], cross_encoder: bool,
                late_interaction: bool = False) -> ScorePlan:
    texts_1 = [text_1] if isinstance(text_1, str) else list(text_1)
    texts_2 = [text_2] if isinstance(text_2, str) else list(text_2)
    if not texts_1 or not texts_2:
        raise ValueError("score needs at least one text on each side (text_1 and text_2)")
    pairs = pair_indices(len(texts_1), len(texts_2))
    if cross_encoder:
        return ScorePlan([(texts_1[i], texts_2[j]) for i, j in pairs], "classify", pairs, len(texts_1))
    if late_interaction:
        return ScorePlan(texts_1 + texts_2, "token_embed", pairs, len(texts_1))
    if "embed" not in supported_tasks:
        raise ValueError(f"score needs an embedding model or a cross-encoder (one-label classifier); this "
                         f"model supports: {', '.join(supported_tasks)}")
    return ScorePlan(texts_1 + texts_2, "embed", pairs, len(texts_1))
