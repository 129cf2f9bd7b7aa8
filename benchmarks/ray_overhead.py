"""What Ray Data costs: one polyvec engine as a Ray actor against plain offline encoding of the same passages.

    python benchmarks/ray_overhead.py [--data vaswani] [--limit N] [--rounds 2] [--task embed token_embed]
    python benchmarks/ray_overhead.py --commands [--data vaswani] [--rounds 2] [--task token_embed]

Each round runs, one after the other on the same cores: `encode_to_parquet` over the passages in this process
(what `polyvec embed --output FILE.parquet` does, with the model loaded and warm), then `encode_dataset` with one
actor using every core on a local Ray, the passages from `ray.data.from_items`, written as Parquet with the same
columns (what `polyvec embed --ray --output DIR` does; its time includes starting the actor and loading the model
there, which a job pays once). Both write to a temporary folder. Tokens per second of each, and their ratio.

`--commands` times the two commands as a user runs them, alternated, each a process of its own from start to
exit: `polyvec embed corpus.jsonl --pooling-task T --output x.parquet` against `polyvec embed corpus.jsonl --ray
auto --pooling-task T --output DIR` on a Ray the script starts first (`ray start --head --num-cpus <cores>`), as
on a cluster that is already up.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import collection, hardware, load_passages  # noqa: E402


def commands(args: argparse.Namespace) -> None:
    """Plain `polyvec embed` against `polyvec embed --ray auto`, command to command, on a Ray started here."""
    from polyvec import LLM
    from polyvec.entrypoints.cli import read_corpus

    corpus = str(collection(args.data) / "corpus.jsonl")
    texts = read_corpus(corpus, args.limit)[1]  # as both commands read it
    tokens = sum(len(p.prompt_token_ids) for p in LLM(args.model).engine.process(texts, None, "embed"))
    cores = os.cpu_count() or 1
    limit = ["--limit", str(args.limit)] if args.limit else []
    print(f"## Command to command: {len(texts)} {args.data} passages, {tokens} tokens; {args.model} {args.dtype}\n"
          f"{time.strftime('%Y-%m-%d')}, {hardware()}; a Ray of {cores} CPUs already up\n")  # fmt: skip
    ray_cmd = [sys.executable, "-m", "ray.scripts.scripts"]
    subprocess.run([*ray_cmd, "start", "--head", f"--num-cpus={cores}", "--include-dashboard=false"], check=True,
                   capture_output=True)  # fmt: skip
    print("| task | round | polyvec embed s | --ray auto s | polyvec embed tokens/s | --ray tokens/s | ratio |")
    print("|---|---|---|---|---|---|---|")
    try:
        for task in args.task:
            for r in range(1, args.rounds + 1):
                out = Path(tempfile.mkdtemp(prefix="polyvec-ray-"))
                base = [sys.executable, "-m", "polyvec", "embed", corpus, "--model", args.model, "--dtype",
                        args.dtype, "--pooling-task", task, "--quiet", *limit]  # fmt: skip
                runs = {"plain": [*base, "--output", str(out / "plain.parquet")],
                        "ray": [*base, "--ray", "auto", "--output", str(out / "ray")]}  # fmt: skip
                took = {}
                try:
                    for name in list(runs)[:: 1 if r % 2 else -1]:
                        t0 = time.perf_counter()
                        done = subprocess.run(runs[name], capture_output=True, text=True)
                        took[name] = time.perf_counter() - t0
                        if done.returncode:
                            sys.exit(f"{name} failed:\n{done.stderr[-2000:]}")
                finally:
                    shutil.rmtree(out, ignore_errors=True)
                p, q = took["plain"], took["ray"]
                print(f"| {task} | {r} | {p:.1f} | {q:.1f} | {tokens / p:,.0f} | {tokens / q:,.0f} | {p / q:.2f} |",
                      flush=True)  # fmt: skip
    finally:
        subprocess.run([*ray_cmd, "stop"], capture_output=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="vaswani")
    ap.add_argument("--model", default="sentence-transformers/all-MiniLM-L6-v2")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=None, help="default: the library's for the task")
    ap.add_argument("--task", nargs="+", default=["embed", "token_embed"])
    ap.add_argument("--commands", action="store_true", help="time the two commands, each a process from start to exit")
    args = ap.parse_args()
    if args.commands:
        commands(args)
        return 0
    import ray
    import ray.data

    from polyvec import LLM
    from polyvec.columns import PARQUET_OPTIONS, encode_to_parquet
    from polyvec.integrations.ray import encode_dataset

    texts = load_passages((args.data,), limit=args.limit)
    cores = os.cpu_count() or 1
    llm = LLM(args.model, dtype=args.dtype)
    tokens = sum(len(p.prompt_token_ids) for p in llm.engine.process(texts, None, "embed"))
    llm.embed(texts[:64], use_tqdm=False)  # warm-up
    # a Ray of its own, even where one runs here (connecting to it refuses num_cpus)
    ray.init(address="local", num_cpus=cores, include_dashboard=False, logging_level="ERROR")
    ray.data.DataContext.get_current().enable_progress_bars = False
    ids = [str(i) for i in range(len(texts))]
    items = [{"id": i, "text": t} for i, t in zip(ids, texts)]
    print(f"## Ray Data overhead: {len(texts)} {args.data} passages, {tokens} tokens; {args.model} {args.dtype}\n"
          f"{time.strftime('%Y-%m-%d')}, {hardware()}; one actor with {cores} threads, "
          f"batches of {args.batch_size or 'the default'}\n")  # fmt: skip
    print("| task | round | polyvec embed tokens/s | Ray, 1 actor tokens/s | Ray / polyvec embed |")
    print("|---|---|---|---|---|")
    for task in args.task:
        for r in range(1, args.rounds + 1):
            out = Path(tempfile.mkdtemp(prefix="polyvec-ray-"))
            try:
                t0 = time.perf_counter()
                encode_to_parquet(llm, ids, texts, str(out / "plain.parquet"), task, batch_size=args.batch_size)
                offline = tokens / (time.perf_counter() - t0)
                ds = ray.data.from_items(items)
                t0 = time.perf_counter()
                encode_dataset(ds, args.model, task=task, dtype=args.dtype, actors=1, batch_size=args.batch_size)\
                    .write_parquet(str(out / "o"), ray_remote_args={"num_cpus": 0.25}, **PARQUET_OPTIONS)  # fmt: skip
                on_ray = tokens / (time.perf_counter() - t0)
            finally:
                shutil.rmtree(out, ignore_errors=True)
            print(f"| {task} | {r} | {offline:,.0f} | {on_ray:,.0f} | {on_ray / offline:.2f} |", flush=True)
    ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
