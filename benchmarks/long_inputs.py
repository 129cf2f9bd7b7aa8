"""Long inputs: one 32k-token prompt on a decoder, prefilled in chunks of 512, 2048 and 8192 tokens; and an
encoder document far longer than max_model_len, split into windows.

Each configuration runs in its own process so its peak RSS is its own. Prints time, tokens/s, peak RSS
(and its growth over the loaded model), the KV cache reserved, and the cosine of each chunked result
against the largest chunk size (chunked prefill must not change results).

    python benchmarks/long_inputs.py [--tokens 32768] [--model DECODER_FOLDER] [--dtype float32]

Without --model, a decoder with Qwen3's architecture (random weights, fixed seed; 4 layers, hidden 256,
GQA 4/2 heads, 41k positions) is built with transformers: no decoder checkpoint can be downloaded here.
"""

from __future__ import annotations

import argparse
import atexit
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import hardware, load_passages


def build_decoder(folder: Path) -> None:
    import shutil

    import torch
    import transformers

    from polyvec.loader import resolve_model_path

    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(
        vocab_size=30522,
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=768,
        max_position_embeddings=40960,
    )
    transformers.Qwen3ForCausalLM(cfg).eval().save_pretrained(folder)
    minilm = resolve_model_path("sentence-transformers/all-MiniLM-L6-v2")
    shutil.copy(minilm / "tokenizer.json", folder / "tokenizer.json")


def prompt_ids(tokenizer_folder: str, n: int) -> list[int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(tokenizer_folder) / "tokenizer.json"))
    ids: list[int] = []
    for text in load_passages(("vaswani",)):
        ids += tok.encode(text, add_special_tokens=False).ids
        if len(ids) >= n:
            break
    return ids[:n]


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def worker(args: argparse.Namespace) -> None:
    """One configuration, in its own process; prints one JSON line."""
    import torch

    from polyvec import LLM, PoolingParams

    ids = json.loads(Path(args.ids_file).read_text())
    kwargs = dict(dtype=args.dtype, num_threads=args.threads)
    if args.mode == "decoder":
        llm = LLM(args.model, max_num_batched_tokens=args.chunk, enable_prefix_caching=False, **kwargs)
        llm.embed([{"prompt_token_ids": ids[:64]}], use_tqdm=False)  # warm-up
        params, prompt = None, {"prompt_token_ids": ids}
    else:
        llm = LLM(args.model, **kwargs)
        llm.embed(["warm up"], use_tqdm=False)
        params = PoolingParams(long_input="window", window_overlap=args.overlap)
        prompt = {"prompt_token_ids": ids}
    base, warm_batches = rss_mib(), llm.engine.stats.num_batches
    start = time.perf_counter()
    if args.task == "embed":
        (out,) = llm.embed([prompt], params, use_tqdm=False)
    else:
        (out,) = llm.token_embed([prompt], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    torch.save(out.outputs.data, args.out)
    engine = llm.engine
    print(
        json.dumps(
            {
                "seconds": elapsed,
                "tokens": len(ids),
                "peak_rss_mib": rss_mib(),
                "base_rss_mib": base,
                "batches": engine.stats.num_batches - warm_batches,
                "kv_cache_mib": len(ids) * engine.runner.kv_bytes_per_token() / 2**20 if engine.causal else 0.0,
                "shape": list(out.outputs.data.shape),
            }
        )
    )


def run(cmd: list[str]) -> dict:
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        sys.stderr.write(res.stderr[-3000:])
        raise SystemExit(f"worker failed: {' '.join(cmd)}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--model", default=None, help="decoder checkpoint folder (default: a random Qwen3-style one)")
    p.add_argument("--chunks", default="512,2048,8192")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--encoder", default="sentence-transformers/all-MiniLM-L6-v2")
    p.add_argument("--overlap", type=int, default=32)
    p.add_argument("--skip-encoder", action="store_true")
    # worker mode
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="decoder", help=argparse.SUPPRESS)
    p.add_argument("--task", default="embed", help=argparse.SUPPRESS)
    p.add_argument("--chunk", type=int, default=2048, help=argparse.SUPPRESS)
    p.add_argument("--ids-file", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return

    import torch

    tmp = Path(tempfile.mkdtemp(prefix="polyvec-long-"))

    atexit.register(shutil.rmtree, tmp, True)  # gigabytes of outputs and models
    model = args.model
    if model is None:
        model = str(tmp / "decoder")
        build_decoder(Path(model))
    ids_file = tmp / "ids.json"
    ids_file.write_text(json.dumps(prompt_ids(model, args.tokens)))
    base_cmd = [
        sys.executable,
        __file__,
        "--worker",
        "--ids-file",
        str(ids_file),
        "--dtype",
        args.dtype,
        "--threads",
        str(args.threads),
    ]
    print(f"# long inputs — {hardware()}; {args.threads} threads; dtype {args.dtype}; {time.strftime('%Y-%m-%d')}")
    print(
        f"\nDecoder ({'random Qwen3-style, 4 layers, hidden 256' if args.model is None else model}): one "
        f"{args.tokens}-token prompt, embed (LAST pooling), prefilled in chunks\n"
    )
    print(
        "| chunk (max_num_batched_tokens) | steps | seconds | tokens/s | peak RSS MiB | RSS growth MiB "
        "| KV cache MiB | cosine vs largest chunk |"
    )
    print("|---|---|---|---|---|---|---|---|")
    chunks = [int(c) for c in args.chunks.split(",")]
    results = {}
    for chunk in chunks:
        out = tmp / f"dec-{chunk}.pt"
        results[chunk] = (
            run(base_cmd + ["--mode", "decoder", "--model", model, "--chunk", str(chunk), "--out", str(out)]),
            torch.load(out),
        )
    ref = results[max(chunks)][1]
    for chunk in chunks:
        r, vec = results[chunk]
        cos = float(torch.nn.functional.cosine_similarity(vec.double(), ref.double(), dim=0))
        print(
            f"| {chunk} | {r['batches']} | {r['seconds']:.2f} | {r['tokens'] / r['seconds']:,.0f} | "
            f"{r['peak_rss_mib']:,.0f} | {r['peak_rss_mib'] - r['base_rss_mib']:,.0f} | {r['kv_cache_mib']:,.0f} "
            f"| {cos:.7f} |"
        )

    if args.skip_encoder:
        return
    enc_ids_file = tmp / "enc-ids.json"
    from polyvec.loader import resolve_model_path

    enc_path = resolve_model_path(args.encoder)
    body = prompt_ids(str(enc_path), args.tokens - 2)
    enc_ids_file.write_text(json.dumps([101] + body + [102]))  # [CLS] ... [SEP] (BERT vocabulary)
    print(
        f"\nEncoder ({args.encoder}, max_model_len 256): one {args.tokens}-token document, long_input='window', "
        f"overlap {args.overlap}\n"
    )
    print("| task | batches | seconds | tokens/s | peak RSS MiB | output shape |")
    print("|---|---|---|---|---|---|")
    for task in ("embed", "token_embed"):
        r = run(
            [
                sys.executable,
                __file__,
                "--worker",
                "--ids-file",
                str(enc_ids_file),
                "--dtype",
                args.dtype,
                "--threads",
                str(args.threads),
                "--mode",
                "encoder",
                "--task",
                task,
                "--model",
                str(enc_path),
                "--overlap",
                str(args.overlap),
                "--out",
                str(tmp / f"enc-{task}.pt"),
            ]
        )
        print(
            f"| {task} | {r['batches']} | {r['seconds']:.2f} | {r['tokens'] / r['seconds']:,.0f} | "
            f"{r['peak_rss_mib']:,.0f} | {r['shape']} |"
        )


if __name__ == "__main__":
    main()
