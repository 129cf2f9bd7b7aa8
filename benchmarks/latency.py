"""Offline latency of single short queries: polyvec vs sentence-transformers, one query per call.

    python benchmarks/latency.py [--dtypes float32 bfloat16] [--systems polyvec st] [--rounds 2]

The queries are Cranfield's (`$POLYVEC_DATA/cranfield/queries.jsonl`), each cut to its longest word prefix of at
most 10 tokens (the length a search box sends); each is embedded alone (`LLM.embed([q])`,
`SentenceTransformer.encode([q])`) after a warm-up pass over all of them, and the script prints p50 / p95 / mean
milliseconds per call with the hardware and the mean length.
Each system and dtype runs in its own process, one after the other, `--rounds` times (the machines here drift
from minute to minute: compare systems within a round).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import collection, hardware, percentile  # noqa: E402


def short_queries(model_path: str, max_tokens: int = 10) -> list[str]:
    """Each Cranfield query cut to its longest word prefix of at most `max_tokens` tokens ([CLS], [SEP] included)."""
    from polyvec.tokenizer import PolyTokenizer

    tok = PolyTokenizer(Path(model_path) / "tokenizer.json")
    out = []
    for line in open(collection("cranfield") / "queries.jsonl"):
        words = json.loads(line)["text"].split()
        lens = [
            len(e.input_ids)
            for e in tok.encode_prompts([" ".join(words[:n]) for n in range(1, len(words) + 1)], 512, truncate=True)
        ]
        n = max((i + 1 for i, k in enumerate(lens) if k <= max_tokens), default=0)
        if n:
            out.append(" ".join(words[:n]))
    return out


def worker(system: str, dtype: str, model: str, queries: list[str], threads: int) -> list[float]:
    import torch

    if system == "polyvec":
        from polyvec import LLM

        llm = LLM(model, dtype=dtype, num_threads=threads)
        run = lambda q: llm.embed([q], use_tqdm=False)  # noqa: E731
    else:
        from sentence_transformers import SentenceTransformer

        torch.set_num_threads(threads)
        kwargs = {"model_kwargs": {"torch_dtype": torch.bfloat16}} if dtype == "bfloat16" else {}
        st = SentenceTransformer(model, device="cpu", **kwargs)
        run = lambda q: st.encode([q], normalize_embeddings=True)  # noqa: E731
    for q in queries:  # warm-up: every shape once
        run(q)
    times = []
    for q in queries:
        start = time.perf_counter()
        run(q)
        times.append(time.perf_counter() - start)
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="sentence-transformers/all-MiniLM-L6-v2")
    ap.add_argument("--systems", nargs="+", default=["polyvec", "st"])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--worker", nargs=3, metavar=("SYSTEM", "DTYPE", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    from polyvec.loader import resolve_model_path

    model_path = str(resolve_model_path(args.model))
    queries = short_queries(model_path)
    if args.worker:
        json.dump(worker(args.worker[0], args.worker[1], model_path, queries, args.threads), open(args.worker[2], "w"))
        return 0
    from polyvec.tokenizer import PolyTokenizer

    enc = PolyTokenizer(Path(model_path) / "tokenizer.json").encode_prompts(queries, 512, truncate=True)
    mean_len = statistics.fmean(len(e.input_ids) for e in enc)
    print(
        f"## Single-query latency: {args.model}, {len(queries)} Cranfield queries cut to ≤ 10 tokens "
        f"(mean {mean_len:.1f}), one per call, {args.threads} threads"
    )
    print(f"Hardware: {hardware()}; date {time.strftime('%Y-%m-%d')}\n")
    print("| round | system | dtype | p50 ms | p95 ms | mean ms |\n|---|---|---|---|---|---|")
    out = Path(tempfile.mkdtemp(prefix="polyvec-latency-")) / "times.json"
    for rnd in range(args.rounds):
        for system in args.systems:
            for dtype in args.dtypes:
                cmd = [
                    sys.executable,
                    str(Path(__file__).resolve()),
                    "--model",
                    model_path,
                    "--threads",
                    str(args.threads),
                    "--worker",
                    system,
                    dtype,
                    str(out),
                ]
                proc = subprocess.run(cmd, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True)
                if proc.returncode != 0:
                    print(f"{system} {dtype} failed:\n{proc.stderr[-2000:]}", file=sys.stderr)
                    continue
                ms = [t * 1e3 for t in json.load(open(out))]
                print(
                    f"| {rnd + 1} | {system} | {dtype} | {percentile(ms, 50):.2f} | {percentile(ms, 95):.2f} | "
                    f"{statistics.fmean(ms):.2f} |",
                    flush=True,
                )
    out.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
