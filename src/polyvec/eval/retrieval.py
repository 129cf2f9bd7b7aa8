"""Retrieval evaluation on BEIR-style folders: dense (cosine) or multi-vector (exact MaxSim) ranking.

A folder holds `corpus.jsonl` (`_id`, `title`, `text`), `queries.jsonl` (`_id`, `text`) and `qrels.tsv`
(query-id, corpus-id, score; header line). Search is exact and streams over the corpus in chunks: document
vectors are held in float16, each chunk is cast to float32 for the batched matrix products (float32
accumulation), and a running top-k per query keeps memory bounded by the chunk size, not the corpus.
Metrics (nDCG@10, R@100, RR@10) come from `ir-measures` (pytrec_eval underneath).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..scoring import iter_maxsim
from . import document_text


@dataclass
class BeirData:
    doc_ids: list[str]
    docs: list[str]
    query_ids: list[str]
    queries: list[str]
    qrels: dict[str, dict[str, int]]


def load_beir(folder: str | Path) -> BeirData:
    folder = Path(folder)
    doc_ids, docs, query_ids, queries = [], [], [], []
    with open(folder / "corpus.jsonl", encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            doc_ids.append(str(row["_id"]))
            docs.append(document_text(row) or ".")
    qrels: dict[str, dict[str, int]] = {}
    with open(folder / "qrels.tsv", encoding="utf-8") as f:
        for i, line in enumerate(f):
            parts = line.rstrip("\n").split("\t")
            if i == 0 and not parts[-1].lstrip("-").isdigit() and not parts[2].lstrip("-").isdigit():
                continue  # header
            qrels.setdefault(parts[0], {})[parts[1]] = int(parts[2])
    with open(folder / "queries.jsonl", encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            if str(row["_id"]) in qrels:  # evaluate judged queries only, as BEIR does
                query_ids.append(str(row["_id"]))
                queries.append(row["text"])
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


def evaluate(data: BeirData, scores: torch.Tensor, indices: torch.Tensor) -> dict[str, float]:
    import ir_measures
    from ir_measures import RR, R, nDCG

    run = {
        qid: {data.doc_ids[int(j)]: float(s) for s, j in zip(row_s, row_i)}
        for qid, row_s, row_i in zip(data.query_ids, scores.tolist(), indices.tolist())
    }
    measures = [nDCG @ 10, R @ 100, RR @ 10]
    result = ir_measures.calc_aggregate(measures, data.qrels, run)
    return {"nDCG@10": result[nDCG @ 10], "R@100": result[R @ 100], "MRR@10": result[RR @ 10]}


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
    """Encode the corpus and queries with `llm`, rank exactly, and score the run."""
    from ..pooling_params import PoolingParams

    if mode not in ("dense", "multivector"):
        raise ValueError(f"mode must be dense or multivector, not {mode!r}")
    task = "embed" if mode == "dense" else "token_embed"
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
    encode_queries = time.perf_counter() - start
    start = time.perf_counter()
    if mode == "dense":
        scores, idx = dense_search(torch.stack(q_vecs), torch.stack(doc_vecs), top_k)
    else:
        scores, idx = maxsim_search(q_vecs, doc_vecs, top_k)
    search = time.perf_counter() - start
    return RetrievalReport(
        evaluate(data, scores, idx), encode_docs, encode_queries, search, len(data.docs), len(data.queries)
    )
