"""Retrieval quality and speed: BM25 (bm25s) vs all-MiniLM-L6-v2 dense vs MiniLM token vectors with MaxSim.

    python benchmarks/retrieval.py [--data cranfield vaswani] [--model M]

Prints nDCG@10, R@100 and MRR@10 (ir-measures) with encode and exact-search times for each collection.
Needs `pip install bm25s ir-measures`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import collection, hardware  # noqa: E402


def bm25(data):
    import bm25s

    start = time.perf_counter()
    retriever = bm25s.BM25()
    retriever.index(bm25s.tokenize(data.docs, stopwords="en", show_progress=False), show_progress=False)
    index_s = time.perf_counter() - start
    start = time.perf_counter()
    idx, scores = retriever.retrieve(
        bm25s.tokenize(data.queries, stopwords="en", show_progress=False), k=100, show_progress=False
    )
    scores, idx = torch.tensor(scores), torch.tensor(idx)
    # bm25s pads the top 100 with documents of score 0 (no query term): not retrieved, as polyvec.eval's BM25
    return scores, idx.masked_fill(scores <= 0, -1), index_s, time.perf_counter() - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", nargs="+", default=["cranfield", "vaswani"])
    ap.add_argument("--model", default="sentence-transformers/all-MiniLM-L6-v2")
    args = ap.parse_args()

    from polyvec import LLM
    from polyvec.eval.retrieval import evaluate, load_beir, run_retrieval

    llm = LLM(args.model, dtype="float32")
    rows = []
    for name in args.data:
        data = load_beir(collection(name))
        s, i, index_s, search_s = bm25(data)
        rows.append((name, "BM25 (bm25s)", evaluate(data, s, i), index_s, search_s))
        for mode in ("dense", "multivector"):
            r = run_retrieval(llm, data, mode=mode, use_tqdm=False)
            label = "MiniLM dense (cosine)" if mode == "dense" else "MiniLM token vectors (MaxSim)"
            rows.append((name, label, r.metrics, r.encode_docs_s + r.encode_queries_s, r.search_s))
            print(name, label, r.metrics, file=sys.stderr, flush=True)
    print(f"\n## Retrieval: {args.model}; exact search, top 100; {hardware()}; {time.strftime('%Y-%m-%d')}\n")
    print("| collection | system | nDCG@10 | R@100 | MRR@10 | index/encode s | search s |")
    print("|---|---|---|---|---|---|---|")
    for name, label, m, enc, search in rows:
        print(
            f"| {name} | {label} | {m['nDCG@10']:.4f} | {m['R@100']:.4f} | {m['MRR@10']:.4f} | {enc:.1f} | "
            f"{search:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
