"""Peak memory of a large offline run: N passages (default 100,000: the Cranfield and Vaswani documents,
cycled) streamed through `LLM.iter_encode`, for `embed` (rows written to a .npy memory map) and
`token_embed` (each passage's matrix written to a float16 file, as an index builder would).

Prints resident memory every 10% of the run: it must stay flat (bounded by the in-flight window, not by N).

    python benchmarks/memory.py [--passages 100000] [--dtype auto] [--tasks embed,token_embed]
"""

from __future__ import annotations

import argparse
import atexit
import itertools
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import hardware, load_passages


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--passages", type=int, default=100_000)
    p.add_argument("--model", default="sentence-transformers/all-MiniLM-L6-v2")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tasks", default="embed,token_embed")
    p.add_argument("--max-in-flight", type=int, default=4096)
    args = p.parse_args()

    import numpy as np
    import torch

    from polyvec import LLM

    corpus = load_passages()
    llm = LLM(args.model, dtype=args.dtype, num_threads=args.threads)
    llm.embed(corpus[:8], use_tqdm=False)
    print(
        f"# memory — {hardware()}; {args.threads} threads; {args.model}, dtype {llm.model_config.dtype}; "
        f"{args.passages:,} passages (the {len(corpus):,} Cranfield + Vaswani documents, cycled); "
        f"max_in_flight {args.max_in_flight}; {time.strftime('%Y-%m-%d')}"
    )
    print(f"RSS after loading the model: {rss_mib():,.0f} MiB\n")
    tmp = Path(tempfile.mkdtemp(prefix="polyvec-mem-"))
    atexit.register(shutil.rmtree, tmp, True)  # gigabytes of outputs and models
    for task in args.tasks.split(","):
        texts = itertools.islice(itertools.cycle(corpus), args.passages)
        marks = {int(args.passages * k / 10) for k in range(1, 11)}
        rows = []
        dim = llm.model_config.embed_dim if task == "embed" else llm.model_config.token_dim
        matrix = (
            np.lib.format.open_memmap(tmp / "embed.npy", mode="w+", dtype=np.float32, shape=(args.passages, dim))
            if task == "embed"
            else None
        )
        sink = open(tmp / "tokens.f16", "wb") if task == "token_embed" else None
        tokens, start = 0, time.perf_counter()
        for i, out in enumerate(llm.iter_encode(texts, pooling_task=task, max_in_flight=args.max_in_flight), 1):
            data = out.outputs.data
            if matrix is not None:
                matrix[i - 1] = data.float().numpy()
            else:
                sink.write(data.to(torch.float16).numpy().tobytes())
            tokens += len(out.prompt_token_ids)
            if i in marks:
                rows.append((i, rss_mib(), time.perf_counter() - start, tokens))
        if sink is not None:
            sink.close()
        written = (tmp / ("embed.npy" if task == "embed" else "tokens.f16")).stat().st_size / 2**20
        print(f"{task}: {tokens:,} tokens, {written:,.0f} MiB of outputs written to disk")
        print("| passages | RSS MiB | seconds | tokens/s |")
        print("|---|---|---|---|")
        for n, rss, sec, tok in rows:
            print(f"| {n:,} | {rss:,.0f} | {sec:.0f} | {tok / sec:,.0f} |")
        print(f"peak RSS so far: {peak_mib():,.0f} MiB\n")
        del matrix


if __name__ == "__main__":
    main()
