"""Retrieval evaluation on BEIR-style folders: dense (cosine), multi-vector (exact MaxSim), sparse (exact dot
product of SPLADE-style vocabulary vectors), BM25, and hybrids of these.

A folder holds `corpus.jsonl` (`_id`, `title`, `text`), `queries.jsonl` (`_id`, `text`) and `qrels.tsv`
(query-id, corpus-id, score; header line). Search is exact and streams over the corpus in chunks: document
vectors are held in float16, each chunk is cast to float32 for the batched matrix products (float32
accumulation), and a running top-k per query keeps memory bounded by the chunk size, not the corpus.
Sparse search is a product of SciPy CSR matrices (queries x the transposed document matrix, which is the
inverted index), a block of queries at a time; a document that shares no term with a query is not retrieved.
BM25 is `bm25s` with its defaults (Lucene BM25, k1 1.5, b 0.75; lower-cased `\\w\\w+` tokens, English stop words
removed, no stemming); likewise a document without a query term is not retrieved.

Hybrids (`fuse`) combine the top `depth` documents of each system, two ways:

* `rrf`, reciprocal rank fusion (Cormack, Clarke & Buettcher, 2009): score(d) = sum over systems of
  1 / (k + rank(d)), k = 60, rank 1-based in that system's list; a system that did not return d adds nothing.
* `weighted`, bge-m3's weighted sum of raw scores (FlagEmbedding `BGEM3FlagModel.compute_score`):
  score(d) = sum_s w_s * score_s(d) / sum_s w_s, with bge-m3's weights by default (dense 0.4, sparse 0.2,
  multivector 0.4; BM25, a lexical score like sparse, 0.2). The multi-vector score is MaxSim averaged over the
  query's tokens, as bge-m3's colbert score is. It is computed on the union of the systems' candidates, and a
  document missing from one system's list gets that system's exact score for it (a dot product, a MaxSim, a
  BM25 score: cheap for a few hundred candidates per query), never 0, so the fused score of every candidate is
  what a full-corpus computation would give. `normalize="minmax"` rescales each system's scores to [0, 1]
  over each query's candidates first (raw scores differ in scale: cosine <= 1, SPLADE and BM25 often 10-30).

Ties in a fused ranking go to the lower corpus position. Rankings are (scores, indices) pairs of [queries, k]
tensors, best first; an index of -1 (score -inf) is an empty slot.
Metrics (nDCG@10, R@100, RR@10) come from `ir-measures` (pytrec_eval underneath); a query with no retrieved
document counts as 0.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..scoring import iter_maxsim
from . import json_line, row_id, row_text

logger = logging.getLogger(__name__)


@dataclass
class BeirData:
    doc_ids: list[str]
    docs: list[str]
    query_ids: list[str]
    queries: list[str]
    qrels: dict[str, dict[str, int]]


def _jsonl_rows(path: Path) -> Iterator[tuple[int, str, dict[str, Any], str]]:
    """(line number, id, row, title and text) of a BEIR JSONL file, blank lines skipped; ValueError naming the
    file and line."""
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json_line(line, f"{path.name} line {n}")
            try:
                text, row_key = row_text(row), row_id(row)
            except ValueError as exc:
                raise ValueError(f"{path.name} line {n} {exc}") from None
            if row_key is None:
                raise ValueError(f"{path.name} line {n} has no '_id'")
            yield n, row_key, row, text


def load_beir(folder: str | Path) -> BeirData:
    """A BEIR folder: corpus.jsonl, queries.jsonl (judged queries kept) and qrels.tsv (query, document, integer
    score, then any columns; a header line allowed). OSError for a missing file, ValueError naming the file and
    line otherwise."""
    folder = Path(folder)
    doc_ids, docs, query_ids, queries = [], [], [], []
    seen: dict[str, int] = {}
    for n, doc_id, _, text in _jsonl_rows(folder / "corpus.jsonl"):
        if (first := seen.setdefault(doc_id, n)) != n:  # two documents under one id: a ranking could not tell them
            raise ValueError(f"corpus.jsonl line {n} repeats the id {doc_id!r} of line {first}")
        doc_ids.append(doc_id)
        docs.append(text or ".")
    if not docs:
        raise ValueError("no documents in corpus.jsonl")
    qrels: dict[str, dict[str, int]] = {}
    with open(folder / "qrels.tsv", encoding="utf-8") as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            parts = line.rstrip("\r\n").split("\t")
            if len(parts) < 3:
                raise ValueError(f"qrels.tsv line {i + 1} has {len(parts)} columns, not 3 (query, document, score)")
            if i == 0 and not parts[-1].lstrip("-").isdigit() and not parts[2].lstrip("-").isdigit():
                continue  # header
            if not parts[2].strip().lstrip("-").isdigit():
                raise ValueError(f"qrels.tsv line {i + 1}: the score {parts[2]!r} is not an integer")
            qrels.setdefault(parts[0], {})[parts[1]] = int(parts[2])
    seen = {}
    for n, query_id, row, _ in _jsonl_rows(folder / "queries.jsonl"):
        if (first := seen.setdefault(query_id, n)) != n:
            raise ValueError(f"queries.jsonl line {n} repeats the id {query_id!r} of line {first}")
        if query_id in qrels:  # evaluate judged queries only, as BEIR does
            if not isinstance(row.get("text"), str):
                raise ValueError(f"queries.jsonl line {n} has no 'text'")
            query_ids.append(query_id)
            queries.append(row["text"])
    if not query_ids:
        raise ValueError("no judged queries: no query of queries.jsonl is in qrels.tsv")
    # the metrics average over the queries evaluated (as BEIR's): judgments of others would count as misses
    missing = [q for q in qrels if q not in seen]
    if missing:
        logger.warning("%d judged queries of qrels.tsv are not in queries.jsonl, left out (e.g. %r)", len(missing),
                       missing[0])  # fmt: skip
    qrels = {q: qrels[q] for q in query_ids}
    relevant = [d for q in query_ids for d, score in qrels[q].items() if score > 0]
    in_corpus = set(doc_ids)
    absent = [d for d in relevant if d not in in_corpus]
    if relevant and len(absent) == len(relevant):
        raise ValueError(
            f"none of the relevant documents of qrels.tsv is in corpus.jsonl (e.g. {absent[0]!r}): another "
            "collection's ids, or TREC's layout (query, iteration, document, score) where BEIR's is (query, "
            "document, score)"
        )
    if absent:
        logger.warning("%d of qrels.tsv's %d relevant judgments name documents not in corpus.jsonl (e.g. %r)",
                       len(absent), len(relevant), absent[0])  # fmt: skip
    return BeirData(doc_ids, docs, query_ids, queries, qrels)


def _merge_topk(best_s, best_i, scores, doc_index: torch.Tensor, k: int):
    """Keep the k best of (running best, this chunk's scores); `doc_index` [n] names the chunk's columns."""
    idx = doc_index.expand(scores.shape[0], -1)
    s = torch.cat([best_s, scores], dim=1)
    i = torch.cat([best_i, idx], dim=1)
    top = s.topk(min(k, s.shape[1]), dim=1)
    return top.values, i.gather(1, top.indices)


def dense_search(queries: torch.Tensor, docs: torch.Tensor, top_k: int, chunk: int = 8192):
    """Cosine (inner product of normalized vectors) top-k: [nq, d] × [N, d] → (scores, indices) [nq, k]."""
    q = queries.float()
    best_s = q.new_empty(q.shape[0], 0)
    best_i = torch.empty(q.shape[0], 0, dtype=torch.long)
    for start in range(0, docs.shape[0], chunk):
        scores = q @ docs[start : start + chunk].float().T
        best_s, best_i = _merge_topk(best_s, best_i, scores, torch.arange(start, start + scores.shape[1]), top_k)
    return best_s, best_i


def maxsim_search(
    queries: list[torch.Tensor], docs: list[torch.Tensor], top_k: int, chunk: int = 128, budget: int = 1 << 25
):
    """Exact MaxSim top-k of every query over every document, streamed over the corpus (`iter_maxsim`)."""
    best_s = torch.empty(len(queries), 0)
    best_i = torch.empty(len(queries), 0, dtype=torch.long)
    for doc_index, scores in iter_maxsim(queries, docs, chunk, budget):
        best_s, best_i = _merge_topk(best_s, best_i, scores, doc_index, top_k)
    return best_s, best_i


def sparse_matrix(vectors, dim: int | None = None):
    """A SciPy CSR matrix [n, dim] (float32) of sparse vectors: objects with `.indices` and `.values` (lists, by
    ascending index) and `.dim`, such as `embed_sparse` outputs' `.outputs`."""
    from itertools import chain

    import numpy as np
    import scipy.sparse as sp

    vectors = list(vectors)
    if dim is None:
        if not vectors:
            raise ValueError("sparse_matrix() of no vectors needs dim")
        dim = int(vectors[0].dim)
    indices = [v.indices for v in vectors]
    indptr = np.zeros(len(vectors) + 1, dtype=np.int64)
    np.cumsum([len(x) for x in indices], out=indptr[1:])
    nnz = int(indptr[-1])
    cols = np.fromiter(chain.from_iterable(indices), dtype=np.int64, count=nnz)
    vals = np.fromiter(chain.from_iterable(v.values for v in vectors), dtype=np.float32, count=nnz)
    return sp.csr_matrix((vals, cols, indptr), shape=(len(vectors), dim))


def sparse_search(queries, docs, top_k: int, budget: int = 1 << 24):
    """Exact sparse dot-product top-k: CSR [nq, V] x CSR [N, V] -> (scores, indices) [nq, k] (torch, float32).

    One sparse product per block of queries against the transposed document matrix (the inverted index: a row
    of document weights per term), densified into a block of at most `budget` scores for the top-k. Documents
    that share no term with the query get -inf and index -1: they are not retrieved."""
    import numpy as np
    import scipy.sparse as sp

    queries, inverted = sp.csr_matrix(queries), sp.csr_matrix(docs).T.tocsr()  # [V, N]
    n = inverted.shape[1]
    k = min(top_k, n)
    rows = max(1, budget // max(n, 1))
    best_s, best_i = [], []
    for start in range(0, queries.shape[0], rows):
        hits = (queries[start : start + rows] @ inverted).tocsr()  # [b, N], non-zeros = shared terms
        hits.sum_duplicates()
        block = np.full(hits.shape, -np.inf, dtype=np.float32)
        block[np.repeat(np.arange(hits.shape[0]), np.diff(hits.indptr)), hits.indices] = hits.data
        top = torch.from_numpy(block).topk(k, dim=1)
        best_s.append(top.values)
        best_i.append(top.indices.masked_fill(top.values == -torch.inf, -1))
    if not best_s:
        return torch.empty(0, k), torch.empty(0, k, dtype=torch.long)
    return torch.cat(best_s), torch.cat(best_i)


def evaluate(data: BeirData, scores: torch.Tensor, indices: torch.Tensor) -> dict[str, float]:
    import ir_measures
    from ir_measures import RR, R, nDCG

    run = {
        qid: {data.doc_ids[int(j)]: float(s) for s, j in zip(row_s, row_i) if j >= 0}
        for qid, row_s, row_i in zip(data.query_ids, scores.tolist(), indices.tolist())
    }
    measures = [nDCG @ 10, R @ 100, RR @ 10]
    result = ir_measures.calc_aggregate(measures, data.qrels, run)
    return {"nDCG@10": result[nDCG @ 10], "R@100": result[R @ 100], "MRR@10": result[RR @ 10]}


# Systems: an encoded collection that can rank exactly and score any (query, document) pair exactly.

KINDS = ("dense", "multivector", "sparse", "bm25")
# bge-m3's default weights for dense / sparse / colbert (FlagEmbedding BGEM3FlagModel.compute_score); BM25 is a
# lexical score like bge-m3's sparse one.
DEFAULT_WEIGHTS = {"dense": 0.4, "sparse": 0.2, "multivector": 0.4, "bm25": 0.2}


class System:
    kind = ""

    def __init__(self) -> None:
        self.encode_docs_s = 0.0
        self.encode_queries_s = 0.0

    def search(self, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Exact top-k of every query: (scores, indices) [nq, k], best first, -1 for an empty slot."""
        raise NotImplementedError

    def fusion_scores(self, candidates: torch.Tensor) -> torch.Tensor:
        """Exact scores [nq, m] (float32) of the documents `candidates` [nq, m] names, on the scale weighted
        fusion uses; the value at a -1 slot is unspecified."""
        raise NotImplementedError


class DenseSystem(System):
    kind = "dense"

    def __init__(self, queries: torch.Tensor, docs: torch.Tensor) -> None:
        super().__init__()
        self.queries, self.docs = queries.float(), docs

    def search(self, top_k: int):
        return dense_search(self.queries, self.docs, top_k)

    def fusion_scores(self, candidates: torch.Tensor, block: int = 64) -> torch.Tensor:
        out = torch.empty(candidates.shape, dtype=torch.float32)
        for s in range(0, candidates.shape[0], block):
            vecs = self.docs[candidates[s : s + block].clamp(min=0)].float()  # [b, m, d]
            out[s : s + block] = torch.einsum("bd,bmd->bm", self.queries[s : s + block], vecs)
        return out


class MultivectorSystem(System):
    kind = "multivector"

    def __init__(self, queries: list[torch.Tensor], docs: list[torch.Tensor]) -> None:
        super().__init__()
        self.queries, self.docs = queries, docs

    def search(self, top_k: int):
        return maxsim_search(self.queries, self.docs, top_k)

    def fusion_scores(self, candidates: torch.Tensor, block: int = 64) -> torch.Tensor:
        """MaxSim averaged over the query's tokens (bge-m3's colbert score); search ranks by the sum.

        For a block of queries, every query against every document any of them has among its candidates (one
        streamed `iter_maxsim` pass), then the candidates' scores are picked out."""
        out = torch.zeros(candidates.shape, dtype=torch.float32)
        for s in range(0, candidates.shape[0], block):
            rows = candidates[s : s + block]
            unique, where = torch.unique(rows.clamp(min=0), return_inverse=True)  # where: rows -> unique
            queries = self.queries[s : s + block]
            matrix = torch.empty(len(queries), len(unique))
            for doc_index, scores in iter_maxsim(queries, [self.docs[j] for j in unique.tolist()]):
                matrix[:, doc_index] = scores
            lengths = torch.tensor([q.shape[0] for q in queries], dtype=torch.float32)[:, None]
            out[s : s + block] = matrix.gather(1, where) / lengths
        return out


class SparseSystem(System):
    kind = "sparse"

    def __init__(self, queries, docs) -> None:
        super().__init__()
        self.queries, self.docs = queries, docs  # SciPy CSR [nq, V], [N, V]

    def search(self, top_k: int):
        return sparse_search(self.queries, self.docs, top_k)

    def fusion_scores(self, candidates: torch.Tensor) -> torch.Tensor:
        import numpy as np

        nq, m = candidates.shape
        q = self.queries[np.repeat(np.arange(nq), m)]
        d = self.docs[candidates.clamp(min=0).reshape(-1).numpy()]
        dots = np.asarray(q.multiply(d).sum(axis=1), dtype=np.float32).reshape(nq, m)
        return torch.from_numpy(dots)


class BM25System(System):
    """bm25s with its defaults: BM25 (Lucene variant, k1 1.5, b 0.75), `bm25s.tokenize`'s defaults (lower case,
    tokens of two or more word characters, English stop words removed (`stopwords="en"`, bm25s 0.3's default,
    named for older versions), no stemmer)."""

    kind = "bm25"

    def __init__(self, docs: list[str], queries: list[str]) -> None:
        import bm25s

        super().__init__()
        start = time.perf_counter()
        self.retriever = bm25s.BM25()
        self.retriever.index(bm25s.tokenize(docs, stopwords="en", show_progress=False), show_progress=False)
        self.num_docs = len(docs)
        self.encode_docs_s = time.perf_counter() - start
        start = time.perf_counter()
        tokens = bm25s.tokenize(queries, stopwords="en", return_ids=False, show_progress=False)
        self.query_ids = [self.retriever.get_tokens_ids(t) for t in tokens]  # words not in the corpus dropped
        self.encode_queries_s = time.perf_counter() - start

    def _scores(self, start: int, stop: int) -> torch.Tensor:
        import numpy as np

        rows = [
            self.retriever.get_scores(ids) if ids else np.zeros(self.num_docs, dtype=np.float32)
            for ids in self.query_ids[start:stop]
        ]
        return torch.from_numpy(np.stack(rows).astype(np.float32)).reshape(stop - start, self.num_docs)

    def search(self, top_k: int, block: int = 256):
        k = min(top_k, self.num_docs)
        best_s, best_i = [], []
        for s in range(0, len(self.query_ids), block):
            scores = self._scores(s, min(s + block, len(self.query_ids)))
            scores[scores <= 0] = -torch.inf  # no query term in the document
            top = scores.topk(k, dim=1)
            best_s.append(top.values)
            best_i.append(top.indices.masked_fill(top.values == -torch.inf, -1))
        return torch.cat(best_s), torch.cat(best_i)

    def fusion_scores(self, candidates: torch.Tensor, block: int = 256) -> torch.Tensor:
        out = torch.empty(candidates.shape, dtype=torch.float32)
        for s in range(0, candidates.shape[0], block):
            stop = min(s + block, candidates.shape[0])
            out[s:stop] = self._scores(s, stop).gather(1, candidates[s:stop].clamp(min=0))
        return out


def encode_system(kind: str, llm, data: BeirData, use_tqdm: bool = True, encode_chunk: int = 2048) -> System:
    """Encode `data`'s corpus and queries with `llm` (None for bm25) into a `System` of that kind."""
    from ..pooling_params import PoolingParams

    if kind not in KINDS:
        raise ValueError(f"mode must be one of {', '.join(KINDS)}, not {kind!r}")
    if kind == "bm25":
        return BM25System(data.docs, data.queries)
    system: System
    if kind == "sparse":
        if "embed_sparse" not in llm.supported_tasks:
            raise ValueError(
                f"sparse retrieval needs an embed_sparse (SPLADE) model; this one supports: "
                f"{', '.join(llm.supported_tasks)}"
            )
        import scipy.sparse as sp

        start = time.perf_counter()
        blocks = []
        step = min(encode_chunk, 512)  # each output holds its whole vocabulary-sized vector
        for s in range(0, len(data.docs), step):  # stream: keep the CSR rows only
            outs = llm.embed_sparse(data.docs[s : s + step], use_tqdm=use_tqdm)
            blocks.append(sparse_matrix([o.outputs for o in outs]))
        docs = sp.vstack(blocks, format="csr")
        encode_docs = time.perf_counter() - start
        start = time.perf_counter()
        queries = sparse_matrix([o.outputs for o in llm.embed_sparse(data.queries, use_tqdm=False)], docs.shape[1])
        system = SparseSystem(queries, docs)
    else:
        task = "embed" if kind == "dense" else "token_embed"
        start = time.perf_counter()
        doc_vecs: list[torch.Tensor] = []
        params = PoolingParams(input_type="document") if task == "token_embed" else None
        for s in range(0, len(data.docs), encode_chunk):  # stream: keep float16 copies only
            outs = llm.encode(data.docs[s : s + encode_chunk], params, pooling_task=task, use_tqdm=use_tqdm)
            doc_vecs.extend(o.outputs.data.to(torch.float16) for o in outs)
        encode_docs = time.perf_counter() - start
        start = time.perf_counter()
        qparams = PoolingParams(input_type="query") if task == "token_embed" else None
        q_vecs = [o.outputs.data for o in llm.encode(data.queries, qparams, pooling_task=task, use_tqdm=False)]
        if kind == "dense":
            system = DenseSystem(torch.stack(q_vecs), torch.stack(doc_vecs))
        else:
            system = MultivectorSystem(q_vecs, doc_vecs)
    system.encode_docs_s, system.encode_queries_s = encode_docs, time.perf_counter() - start
    return system


# Fusion.


def candidate_union(indices: list[torch.Tensor]) -> torch.Tensor:
    """Per query, the documents any of the rankings [nq, k_s] names, ascending, padded with -1: [nq, m]."""
    cand = torch.cat(indices, dim=1).sort(dim=1).values
    dup = torch.zeros_like(cand, dtype=torch.bool)
    dup[:, 1:] = cand[:, 1:] == cand[:, :-1]
    cand = cand.masked_fill(dup, -1).sort(dim=1).values  # -1s first, then each document once, ascending
    width = int((cand >= 0).sum(dim=1).max()) if cand.numel() else 0
    return cand[:, cand.shape[1] - width :] if width else cand[:, :0]


def _top(fused: torch.Tensor, candidates: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top_k of fused scores of ascending candidates; a stable sort keeps ties in corpus order."""
    fused = fused.masked_fill(candidates < 0, -torch.inf)
    order = fused.sort(dim=1, descending=True, stable=True).indices[:, :top_k]
    scores = fused.gather(1, order)
    return scores, candidates.gather(1, order).masked_fill(scores == -torch.inf, -1)


def rrf_fuse(rankings: list[tuple[torch.Tensor, torch.Tensor]], top_k: int, k: int = 60):
    """Reciprocal rank fusion of rankings (scores, indices) [nq, k_s]: sum over rankings of 1 / (k + rank),
    rank 1-based; a document absent from a ranking gets nothing from it."""
    cand = candidate_union([i for _, i in rankings])
    fused = torch.zeros(cand.shape, dtype=torch.float64)
    for _, idx in rankings:
        if idx.shape[1] == 0:
            continue
        keyed = idx.masked_fill(idx < 0, torch.iinfo(torch.long).max)  # empty slots never match
        ordered, perm = keyed.sort(dim=1)
        pos = torch.searchsorted(ordered, cand.contiguous()).clamp(max=idx.shape[1] - 1)
        found = (ordered.gather(1, pos) == cand) & (cand >= 0)
        rank = perm.gather(1, pos) + 1
        fused += torch.where(found, 1.0 / (k + rank.double()), 0.0)
    return _top(fused, cand, top_k)


def weighted_fuse(
    candidates: torch.Tensor,
    scores: list[torch.Tensor],
    weights: list[float],
    top_k: int,
    normalize: str = "none",
):
    """bge-m3's weighted sum: sum_s w_s * scores_s / sum_s w_s over `candidates` [nq, m] (-1 = empty slot),
    `scores[s]` [nq, m] being system s's exact score of each candidate. normalize="minmax" first maps each
    system's scores to [0, 1] over each query's candidates (all equal: 0)."""
    if len(scores) != len(weights):
        raise ValueError(f"{len(scores)} systems but {len(weights)} weights")
    if not all(math.isfinite(w) and w >= 0 for w in weights) or not sum(weights) > 0:
        raise ValueError(f"weights must be finite, at least 0 and not all 0, got {list(weights)}")
    if normalize not in ("none", "minmax"):
        raise ValueError(f"normalize must be none or minmax, not {normalize!r}")
    valid = candidates >= 0
    fused = torch.zeros(candidates.shape, dtype=torch.float64)
    for s, w in zip(scores, weights):
        s = s.double()
        if normalize == "minmax":
            lo = s.masked_fill(~valid, torch.inf).amin(dim=1, keepdim=True)
            hi = s.masked_fill(~valid, -torch.inf).amax(dim=1, keepdim=True)
            span = hi - lo
            s = torch.where(span > 0, (s - lo) / span.where(span > 0, 1.0), 0.0)
        fused += w * s.masked_fill(~valid, 0.0)
    return _top(fused / sum(weights), candidates, top_k)


def fuse(
    systems: list[System],
    rankings: list[tuple[torch.Tensor, torch.Tensor]],
    fusion: str = "rrf",
    top_k: int = 100,
    weights: list[float] | None = None,
    normalize: str = "none",
    rrf_k: int = 60,
):
    """Fuse the systems' rankings (each system's top `depth`, as searched): `rrf` or bge-m3's `weighted` sum
    (each system's exact scores over the union of the candidates; default weights DEFAULT_WEIGHTS)."""
    if fusion == "rrf":
        if weights is not None:
            raise ValueError("weights apply to fusion=weighted, not rrf")
        return rrf_fuse(rankings, top_k, rrf_k)
    if fusion != "weighted":
        raise ValueError(f"fusion must be rrf or weighted, not {fusion!r}")
    weights = [DEFAULT_WEIGHTS[s.kind] for s in systems] if weights is None else list(weights)
    cand = candidate_union([i for _, i in rankings])
    return weighted_fuse(cand, [s.fusion_scores(cand) for s in systems], weights, top_k, normalize)


@dataclass
class RetrievalReport:
    metrics: dict[str, float]
    encode_docs_s: float
    encode_queries_s: float
    search_s: float
    num_docs: int
    num_queries: int
    extra: dict = field(default_factory=dict)


def run_retrieval(
    llm, data: BeirData, mode: str = "dense", top_k: int = 100, use_tqdm: bool = True, encode_chunk: int = 2048
) -> RetrievalReport:
    """Encode the corpus and queries with `llm` (None for bm25), rank exactly, and score the run."""
    system = encode_system(mode, llm, data, use_tqdm, encode_chunk)
    start = time.perf_counter()
    scores, idx = system.search(top_k)
    search = time.perf_counter() - start
    return RetrievalReport(
        evaluate(data, scores, idx),
        system.encode_docs_s,
        system.encode_queries_s,
        search,
        len(data.docs),
        len(data.queries),
    )


def run_hybrid(
    components: list[tuple[str, object]],
    data: BeirData,
    fusion: str = "rrf",
    top_k: int = 100,
    depth: int | None = None,
    weights: list[float] | None = None,
    normalize: str = "none",
    rrf_k: int = 60,
    use_tqdm: bool = True,
    encode_chunk: int = 2048,
) -> RetrievalReport:
    """Fuse systems `components` [(kind, llm or None for bm25)], each searched to `depth` (default top_k).

    `extra["systems"]` holds each system's own metrics, in order."""
    if len(components) < 2:
        raise ValueError("a hybrid needs at least two systems")
    systems = [encode_system(kind, llm, data, use_tqdm, encode_chunk) for kind, llm in components]
    start = time.perf_counter()
    rankings = [s.search(depth or top_k) for s in systems]
    search = time.perf_counter() - start
    start = time.perf_counter()
    scores, idx = fuse(systems, rankings, fusion, top_k, weights, normalize, rrf_k)
    fusion_s = time.perf_counter() - start
    return RetrievalReport(
        evaluate(data, scores, idx),
        sum(s.encode_docs_s for s in systems),
        sum(s.encode_queries_s for s in systems),
        search + fusion_s,
        len(data.docs),
        len(data.queries),
        extra={"systems": [evaluate(data, *r) for r in rankings], "fusion_s": fusion_s},
    )
