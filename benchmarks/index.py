"""Token vectors at storage scale: bytes per document, build time, query latency and retrieval quality for exact
MaxSim, token pooling, int8 / binary codes, MUVERA + MaxSim re-rank, and Qdrant indexes (embedded Qdrant Edge).

    python benchmarks/index.py [--data vaswani] [--model MODEL] [--prefetch 300] [--dtype float32]

The collection is encoded once (token vectors and, for the dense first stage, embed vectors, one forward
pass); every form is then built from those vectors and asked each query alone (latency per query, the query's
own encoding excluded: it is the same for every form), k = 100. Storage: the vectors' bytes per document as
held (float32: n · dim · 4; int8: n · (dim + 4); binary: n · dim / 8; MUVERA: its encoding too), and for the
Qdrant indexes the folder's size on disk (blocks in use) and what Qdrant keeps in RAM (quantized: the codes).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import collection, hardware, percentile  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="vaswani")
    ap.add_argument("--model", default="sentence-transformers/all-MiniLM-L6-v2")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prefetch", type=int, default=300, help="first-stage candidates re-ranked by MaxSim")
    ap.add_argument("--k-sim", type=int, default=4)
    ap.add_argument("--dim-proj", type=int, default=16)
    ap.add_argument("--r-reps", type=int, default=20)
    ap.add_argument("--only", nargs="*", default=None, help="run only the forms whose names contain these words")
    ap.add_argument("--sparse-model", default=None, help="the sparse first stage's model (default: SPLADE-tiny)")
    args = ap.parse_args()

    import torch

    from polyvec import LLM, PoolingParams
    from polyvec.eval.retrieval import evaluate, load_beir
    from polyvec.index import Index
    from polyvec.muvera import MuveraParams, muvera_for
    from polyvec.scoring import iter_maxsim
    from polyvec.token_codes import encode_tokens
    from polyvec.token_pooling import hierarchical_pool

    torch.manual_seed(0)
    data = load_beir(collection(args.data))
    llm = LLM(args.model, dtype=args.dtype)
    start = time.perf_counter()
    # A ColBERT model has no single vector: its run skips the dense first stage.
    dense_too = "embed" in llm.supported_tasks
    tasks: str | list[str] = ["token_embed", "embed"] if dense_too else "token_embed"
    d_out = llm.encode(data.docs, PoolingParams(input_type="document"), pooling_task=tasks, use_tqdm=False)
    q_out = llm.encode(data.queries, PoolingParams(input_type="query"), pooling_task=tasks, use_tqdm=False)
    docs = [(o.outputs.data["token_embed"] if dense_too else o.outputs.data).float() for o in d_out]
    queries = [(o.outputs.data["token_embed"] if dense_too else o.outputs.data).float() for o in q_out]
    d_dense = q_dense = None
    if dense_too:
        d_dense = torch.stack([o.outputs.data["embed"].float() for o in d_out]).numpy()
        q_dense = torch.stack([o.outputs.data["embed"].float() for o in q_out]).numpy()
    del d_out, q_out
    dim, nvec = docs[0].shape[1], sum(d.shape[0] for d in docs)
    position = {d: i for i, d in enumerate(data.doc_ids)}
    params = MuveraParams(k_sim=args.k_sim, dim_proj=args.dim_proj, r_reps=args.r_reps)
    print(f"## {args.data}: {len(docs)} documents ({nvec / len(docs):.0f} vectors each), {len(queries)} queries; "
          f"{args.model} {args.dtype}, token vectors {dim}-d, encoded in {time.perf_counter() - start:.0f} s\n"
          f"{time.strftime('%Y-%m-%d')}, {hardware()}; k = 100, prefetch {args.prefetch}, MUVERA k_sim {params.k_sim} "
          f"dim_proj {params.dim_proj} r_reps {params.r_reps} ({params.output_dim()} numbers)\n")  # fmt: skip
    base: dict[str, float] = {}
    pooled_n: dict[int, int] = {}

    def wanted(name: str) -> bool:
        return args.only is None or any(w in name for w in args.only)

    def report(
        name: str, held: float, disk: float | None, build: float | None, lat: list[float], q: dict[str, float], note=""
    ) -> None:
        if not base:
            base.update(q)
        build_s = "-" if build is None else f"{build:.1f}"
        disk_s = "-" if disk is None else f"{disk / 1024:.1f}"
        p50, p95 = percentile(lat, 50) * 1e3, percentile(lat, 95) * 1e3
        print(f"| {name} | {held / 1024:.1f} | {disk_s} | {build_s} | {p50:.1f} | {p95:.1f} | {q['nDCG@10']:.4f} | "
              f"{q['R@100']:.4f} | {q['nDCG@10'] / base['nDCG@10']:.4f} | {q['R@100'] / base['R@100']:.4f} | "
              f"{note} |", flush=True)  # fmt: skip

    def exact_form(forms: list[torch.Tensor]) -> tuple[dict[str, float], list[float]]:
        lat, top_s, top_i = [], [], []
        for qv in queries:
            t0 = time.perf_counter()
            scores = torch.empty(len(forms))
            for index, s in iter_maxsim([qv], forms):
                scores[index] = s[0]
            top = scores.topk(min(100, len(forms)))
            lat.append(time.perf_counter() - t0)
            top_s.append(top.values)
            top_i.append(top.indices)
        return evaluate(data, torch.stack(top_s), torch.stack(top_i)), lat

    def hits_quality(hits: list[list]) -> dict[str, float]:
        k = max(len(h) for h in hits)
        s = torch.full((len(hits), k), float("-inf"))
        i = torch.full((len(hits), k), -1, dtype=torch.long)
        for r, h in enumerate(hits):
            for c, x in enumerate(h):
                s[r, c], i[r, c] = x.score, position[x.id]
        return evaluate(data, s, i)

    print("| form | in RAM, KiB / doc | on disk | build s | p50 ms | p95 ms | nDCG@10 | R@100 | nDCG@10 / exact "
          "| R@100 / exact | notes |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    q, lat = exact_form(docs)
    report("exact MaxSim, float32 in memory", nvec * dim * 4 / len(docs), None, None, lat, q)
    for factor in (2, 3):
        if not wanted(f"pool_factor {factor}"):
            continue
        t0 = time.perf_counter()
        pooled = [hierarchical_pool(d, factor) for d in docs]
        took = time.perf_counter() - t0
        q, lat = exact_form(pooled)
        n = pooled_n[factor] = sum(p.shape[0] for p in pooled)
        report(f"pool_factor {factor}, exact", n * dim * 4 / len(docs), None, took, lat, q,
               f"{n / nvec:.2f} of the vectors; {took / len(docs) * 1e3:.2f} ms/doc to pool")  # fmt: skip
    for encoding in ("int8", "binary"):
        if not wanted(encoding + ", exact"):
            continue
        t0 = time.perf_counter()
        codes = [encode_tokens(d, encoding) for d in docs]
        took = time.perf_counter() - t0
        q, lat = exact_form([c.dequantize() for c in codes])
        per = sum(c.nbytes for c in codes) / len(docs)
        report(f"{encoding}, exact", per, None, took, lat, q, "read back to float32")
    if wanted("MUVERA, in memory"):
        t0 = time.perf_counter()
        m = muvera_for(dim, params)
        fde = torch.from_numpy(m.encode(docs))
        took = time.perf_counter() - t0
        lat, top_s, top_i = [], [], []
        for qv in queries:
            t0 = time.perf_counter()
            cand = (fde @ torch.from_numpy(m(qv, query=True))).topk(min(args.prefetch, len(docs))).indices
            scores = torch.empty(len(cand))
            for index, s in iter_maxsim([qv], [docs[int(c)] for c in cand]):
                scores[index] = s[0]
            top = scores.topk(min(100, len(cand)))  # a collection or prefetch under 100: all candidates
            lat.append(time.perf_counter() - t0)
            top_s.append(top.values)
            top_i.append(cand[top.indices])
        q = evaluate(data, torch.stack(top_s), torch.stack(top_i))
        per = (nvec * dim * 4 + fde.shape[0] * fde.shape[1] * 4) / len(docs)
        report(f"MUVERA top {args.prefetch} + MaxSim, in memory (brute-force dot)", per, None, took, lat, q,
               f"encoding {took / len(docs) * 1e3:.2f} ms/doc")  # fmt: skip

    qdrant = [
        ("Qdrant Edge, MaxSim over all documents", dict(first_stage="none"), {}),
        ("Qdrant Edge, MUVERA HNSW + MaxSim", dict(first_stage="muvera"), {}),
        ("Qdrant Edge, dense HNSW + MaxSim", dict(first_stage="dense"), {}),
        ("Qdrant Edge, MUVERA HNSW + MaxSim, int8", dict(first_stage="muvera", quantization="int8"), {}),
        ("Qdrant Edge, MUVERA HNSW + MaxSim, int8 rescored", dict(first_stage="muvera", quantization="int8"),
         dict(rescore=True)),
        ("Qdrant Edge, MUVERA HNSW + MaxSim, pool_factor 2, int8",
         dict(first_stage="muvera", quantization="int8", pool_factor=2), {}),
        ("Qdrant Edge, MUVERA HNSW + MaxSim, binary", dict(first_stage="muvera", quantization="binary"), {}),
        ("Qdrant Edge, dense HNSW + MaxSim, int8", dict(first_stage="dense", quantization="int8"), {}),
        ("Qdrant Edge, dense HNSW + MaxSim, pool_factor 2, int8",
         dict(first_stage="dense", quantization="int8", pool_factor=2), {}),
        ("Qdrant Edge, sparse (SPLADE) + MaxSim", dict(first_stage="sparse"), {}),
        ("Qdrant Edge, sparse (SPLADE) + MaxSim, int8", dict(first_stage="sparse", quantization="int8"), {}),
    ]  # fmt: skip
    sparse_model, d_sparse, q_sparse, nnz = args.sparse_model, [], [], 0
    if any(c["first_stage"] == "sparse" and wanted(n) for n, c, _ in qdrant):
        if sparse_model is None:
            sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
            from tests.packaged import splade_tiny_path

            sparse_model = str(splade_tiny_path())
        sllm = LLM(sparse_model, dtype=args.dtype)

        def pairs(texts: list[str]) -> list:
            return [(o.outputs.indices, o.outputs.values) for o in sllm.embed_sparse(texts, use_tqdm=False)]

        d_sparse, q_sparse = pairs(data.docs), pairs(data.queries)
        nnz = sum(len(i) for i, _ in d_sparse)
    dense_dim = None if d_dense is None else d_dense.shape[1]
    tmp = Path(tempfile.mkdtemp(prefix="polyvec-index-"))
    try:
        for name, create, search in qdrant:
            stage = create["first_stage"]
            if not wanted(name) or (stage == "dense" and d_dense is None):
                continue
            path = tmp / "idx"
            t0 = time.perf_counter()
            index = Index.create(path, model=args.model, dim=dim, dense_dim=dense_dim, muvera=params,
                                 sparse_model=sparse_model if stage == "sparse" else None, **create)  # fmt: skip
            for s in range(0, len(docs), 256):
                dense = d_dense[s : s + 256] if stage == "dense" else None
                sparse = d_sparse[s : s + 256] if stage == "sparse" else None
                index.add_vectors(data.doc_ids[s : s + 256], docs[s : s + 256], dense, sparse)
            written = time.perf_counter() - t0
            index.optimize()
            build = time.perf_counter() - t0
            disk = index.disk_bytes() or 0
            wal = sum(f.stat().st_blocks * 512 for f in (path / "shard" / "wal").rglob("*") if f.is_file())
            # What Qdrant keeps in RAM: the vectors, or with quantization their codes (originals on disk).
            factor = create.get("pool_factor")
            if factor and factor not in pooled_n:
                pooled_n[factor] = sum(hierarchical_pool(d, factor).shape[0] for d in docs)
            kept = pooled_n[factor] if factor else nvec
            first = {"muvera": params.output_dim(), "dense": dense_dim or 0}.get(stage, 0)
            width = {"none": 4.0, "int8": 1.0, "binary": 1 / 8}[create.get("quantization", "none")]
            held = (kept * dim + first * len(docs)) * width + (nnz * 8 if stage == "sparse" else 0)

            def one(i: int) -> list:
                qs = [q_sparse[i]] if stage == "sparse" else None
                qd = None if q_dense is None else q_dense[i : i + 1]
                return index.search_vectors([queries[i]], qd, qs, k=100, prefetch=args.prefetch,
                                            **search)  # fmt: skip

            for i in range(3):  # warm the page cache and the search threads
                one(i)
            lat, hits = [], []
            for i in range(len(queries)):
                t0 = time.perf_counter()
                hits += one(i)
                lat.append(time.perf_counter() - t0)
            index.close()
            shutil.rmtree(path)
            q = hits_quality(hits)
            note = f"written {written:.1f} s, optimized {build - written:.1f} s; write-ahead log {wal / 2**20:.0f} MiB"
            report(name, held / len(docs), disk / len(docs), build, lat, q, note)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
