"""Token vectors as int8 codes and sign bits: storage per vector and retrieval quality against float32, with
exact MaxSim (float32 queries, documents read back from their codes).

    python benchmarks/token_codes.py [--data cranfield] [--model MODEL] [--dtype float32]

Encodes the collection's documents and queries with `token_embed` once, then ranks every query against every
document for each form and reports nDCG@10 / R@100 / MRR@10 (ir-measures) and bytes per vector.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import collection, hardware  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="cranfield")
    ap.add_argument("--model", default="sentence-transformers/all-MiniLM-L6-v2")
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    import torch

    from polyvec import LLM
    from polyvec.eval.retrieval import evaluate, load_beir
    from polyvec.scoring import iter_maxsim
    from polyvec.token_codes import encode_tokens

    data = load_beir(collection(args.data))
    llm = LLM(args.model, dtype=args.dtype)
    start = time.perf_counter()
    docs = [o.outputs.data for o in llm.token_embed(data.docs, use_tqdm=False)]
    queries = [o.outputs.data for o in llm.token_embed(data.queries, use_tqdm=False)]
    vectors = sum(d.shape[0] for d in docs)
    print(f"## {args.data}: {len(docs)} documents ({vectors / len(docs):.0f} vectors each), {len(queries)} queries, "
          f"{args.model} {args.dtype}, encoded in {time.perf_counter() - start:.0f} s\n"
          f"{time.strftime('%Y-%m-%d')}, {hardware()}\n")  # fmt: skip

    def run(forms: list) -> dict[str, float]:
        matrix = torch.empty(len(queries), len(forms))
        for index, scores in iter_maxsim(queries, forms):
            matrix[:, index] = scores
        top, ids = matrix.topk(min(100, len(forms)), dim=1)
        return evaluate(data, top, ids)

    print("| form | bytes / vector | smaller | nDCG@10 | R@100 | MRR@10 | nDCG@10 / float32 |")
    print("|---|---|---|---|---|---|---|")
    width = docs[0].shape[1]
    base = run(docs)
    print(f"| float32 | {4 * width} | 1x | {base['nDCG@10']:.4f} | {base['R@100']:.4f} | {base['MRR@10']:.4f} | 1 |")
    for encoding in ("int8", "binary"):
        codes = [encode_tokens(d, encoding) for d in docs]
        got = run([c.dequantize() for c in codes])
        per = sum(c.nbytes for c in codes) / vectors
        print(f"| {encoding} | {per:.0f} | {4 * width / per:.2f}x | {got['nDCG@10']:.4f} | {got['R@100']:.4f} | "
              f"{got['MRR@10']:.4f} | {got['nDCG@10'] / base['nDCG@10']:.4f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
