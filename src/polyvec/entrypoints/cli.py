"""`polyvec` command line.

    polyvec embed FILE [--model M]   embed a corpus offline; print throughput and a sample similarity
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

from ..loader import DEFAULT_MODEL


def read_texts(path: str, limit: int | None = None) -> list[str]:
    """Texts of a BEIR-style `corpus.jsonl` (title + text) or of a plain file, one text per line."""
    texts = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            if path.endswith(".jsonl"):
                row = json.loads(line)
                line = " ".join(x for x in (row.get("title", ""), row.get("text", "")) if x).strip()
            texts.append(line)
            if limit is not None and len(texts) >= limit:
                break
    return texts


def cmd_embed(args: argparse.Namespace) -> int:
    from .. import LLM

    texts = read_texts(args.file, args.limit)
    if not texts:
        print(f"no texts in {args.file}", file=sys.stderr)
        return 1
    llm = LLM(args.model, dtype=args.dtype, device=args.device, max_num_batched_tokens=args.max_num_batched_tokens,
              num_threads=args.threads)
    llm.embed(texts[:8], use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.embed(texts, use_tqdm=not args.quiet)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.prompt_token_ids) for o in outs)
    import torch

    vecs = torch.stack([o.outputs.data for o in outs])
    sims = vecs[1:] @ vecs[0]
    best = int(sims.argmax()) + 1
    print(f"model: {llm.model_config.model} ({llm.model_config.architecture}, dtype {llm.model_config.dtype}, "
          f"device {llm.engine.runner.device}, threads {torch.get_num_threads()}, {platform.processor() or platform.machine()})")
    print(f"embedded {len(texts)} texts, {tokens} tokens (mean {tokens / len(texts):.1f}) in {elapsed:.2f} s: "
          f"{tokens / elapsed:,.0f} tokens/s, {len(texts) / elapsed:,.1f} texts/s; dim {vecs.shape[1]}")
    print(f"nearest neighbour of text 0 is text {best}, cosine {float(sims[best - 1]):.4f}")
    print(f"  [0] {texts[0][:100]}")
    print(f"  [{best}] {texts[best][:100]}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="polyvec", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("embed", help="embed a corpus offline and print throughput")
    p.add_argument("file", help="corpus.jsonl (BEIR) or a text file with one text per line")
    p.add_argument("--model", default=os.environ.get("POLYVEC_MODEL", DEFAULT_MODEL))
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--limit", type=int, default=None, help="embed only the first N texts")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_embed)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
