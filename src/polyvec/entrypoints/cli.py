"""`polyvec` command line.

    polyvec serve [MODEL]            start the HTTP server (vLLM / OpenAI compatible)
    polyvec embed FILE [--model M]   embed a corpus offline; print throughput and a sample similarity
    polyvec eval-retrieval --model M --data DIR [--mode dense|multivector] [--top-k 100]
                                     rank a BEIR-style folder exactly; print nDCG@10, R@100, MRR@10

Every `serve` flag can also be set by an environment variable: --max-model-len ↔ POLYVEC_MAX_MODEL_LEN.
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
    import numpy as np
    import torch

    from .. import LLM

    texts = read_texts(args.file, args.limit)
    if not texts:
        print(f"no texts in {args.file}", file=sys.stderr)
        return 1
    llm = LLM(args.model, dtype=args.dtype, device=args.device, max_num_batched_tokens=args.max_num_batched_tokens,
              num_threads=args.threads, quantization=args.quantization)
    llm.embed(texts[:8], use_tqdm=False)  # warm-up
    dim = llm.model_config.embed_dim
    # Streamed into one float32 array (a .npy memory map with --output): memory does not grow with the corpus.
    vecs = (np.lib.format.open_memmap(args.output, mode="w+", dtype=np.float32, shape=(len(texts), dim))
            if args.output else np.empty((len(texts), dim), dtype=np.float32))
    bar = None
    if not args.quiet:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(texts), desc="Embedded", dynamic_ncols=True)
    tokens = 0
    start = time.perf_counter()
    for i, out in enumerate(llm.iter_encode(texts, pooling_task="embed")):
        vecs[i] = out.outputs.data.float().numpy()
        tokens += len(out.prompt_token_ids)
        if bar is not None:
            bar.update(1)
    elapsed = time.perf_counter() - start
    if bar is not None:
        bar.close()
    sims = torch.from_numpy(np.asarray(vecs[1:])) @ torch.from_numpy(np.asarray(vecs[0]))
    best = int(sims.argmax()) + 1 if len(texts) > 1 else 0
    print(f"model: {llm.model_config.model} ({llm.model_config.architecture}, dtype {llm.model_config.dtype}, "
          f"device {llm.engine.runner.device}, threads {torch.get_num_threads()}, {platform.processor() or platform.machine()})")
    print(f"embedded {len(texts)} texts, {tokens} tokens (mean {tokens / len(texts):.1f}) in {elapsed:.2f} s: "
          f"{tokens / elapsed:,.0f} tokens/s, {len(texts) / elapsed:,.1f} texts/s; dim {dim}"
          + (f"; written to {args.output}" if args.output else ""))
    if best:
        print(f"nearest neighbour of text 0 is text {best}, cosine {float(sims[best - 1]):.4f}")
        print(f"  [0] {texts[0][:100]}")
        print(f"  [{best}] {texts[best][:100]}")
    if args.output:
        vecs.flush()
    return 0


QUANTIZATION_HELP = ("int8: int8 projections with per-token activation scales (CPU, opt-in; about twice float32, "
                     "on a par with bfloat16 on AMX; cosine >= 0.99 of float32 instead of exact)")


def _env(flag: str, default=None, cast=str):
    value = os.environ.get("POLYVEC_" + flag.lstrip("-").replace("-", "_").upper())
    return default if value is None else cast(value)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    e = _env
    p.add_argument("model", nargs="?", default=e("model", DEFAULT_MODEL),
                   help="local folder, HF cache entry or hub id (resolved offline)")
    p.add_argument("--host", default=e("--host", "127.0.0.1"))
    p.add_argument("--port", type=int, default=e("--port", 8000, int))
    p.add_argument("--api-key", default=e("--api-key"), help="require 'Authorization: Bearer KEY' (not on /health)")
    p.add_argument("--served-model-name", nargs="+", default=e("--served-model-name", None, str.split),
                   help="name(s) clients use in 'model' (default: the model argument)")
    p.add_argument("--dtype", default=e("--dtype", "auto"), choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--quantization", default=e("--quantization"), choices=["int8"],
                   help=QUANTIZATION_HELP)
    p.add_argument("--max-model-len", type=int, default=e("--max-model-len", None, int))
    p.add_argument("--max-num-batched-tokens", type=int, default=e("--max-num-batched-tokens", None, int))
    p.add_argument("--max-num-seqs", type=int, default=e("--max-num-seqs", 256, int))
    p.add_argument("--device", default=e("--device", "auto"))
    p.add_argument("--threads", type=int, default=e("--threads", None, int), help="CPU threads for torch")
    p.add_argument("--truncation", default=e("--truncation", "auto"), choices=["auto", "error"],
                   help="auto: cut over-long input to max_model_len; error: reject it with 400")
    p.add_argument("--long-input", default=e("--long-input", "truncate"), choices=["truncate", "window"],
                   help="encoder input longer than max_model_len: truncate (default), or split into windows "
                        "(requests may choose with long_input)")
    p.add_argument("--window-overlap", type=int, default=e("--window-overlap", 0, int),
                   help="default tokens shared by consecutive windows")
    p.add_argument("--convert", default=e("--convert"), choices=["embed", "classify"],
                   help="serve a *ForCausalLM checkpoint as an embedding model or a classifier")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=e("--kv-cache-memory-bytes", None, int),
                   help="causal models: memory for KV caches of chunked prefills (default 4 GiB)")
    p.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   default=e("--enable-prefix-caching", None, lambda v: v.lower() not in ("0", "false", "no")),
                   help="causal models: do not reuse computed prompt prefixes")
    p.add_argument("--max-request-bytes", type=int, default=e("--max-request-bytes", 32 * 1024 * 1024, int))
    p.add_argument("--max-inputs-per-request", type=int, default=e("--max-inputs-per-request", 4096, int))
    p.add_argument("--log-level", default=e("--log-level", "info"))


def cmd_serve(args: argparse.Namespace) -> int:
    import logging
    import signal

    import torch
    import uvicorn

    from .. import LLM
    from .server.app import ServerConfig, build_app

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("polyvec.serve")
    llm = LLM(args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
              max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
              truncation=args.truncation, num_threads=args.threads, convert=args.convert,
              long_input=args.long_input, window_overlap=args.window_overlap,
              kv_cache_memory_bytes=args.kv_cache_memory_bytes, enable_prefix_caching=args.enable_prefix_caching,
              quantization=args.quantization)
    engine, mc = llm.engine, llm.model_config
    tasks = engine.supported_tasks
    log.info("model %s (%s) from %s [architecture: %s]", mc.model, mc.architecture, mc.path,
             mc.sources.get("architecture", "config.json"))
    log.info("tasks: %s; embed pooling %s [%s]; embed dim %d, token dim %d", ", ".join(tasks),
             "+".join(engine.default_pooling("embed")), mc.sources.get("pooling_type", "model default"),
             mc.embed_dim, mc.token_dim)
    log.info("dtype %s [%s]%s; device %s; threads %d; max_model_len %d [%s]; truncation %s; long input %s; "
             "max_num_batched_tokens %d; max_num_seqs %d", mc.dtype, "--dtype " + args.dtype,
             f", int8 projections [--quantization {args.quantization}]" if args.quantization else "",
             engine.runner.device,
             torch.get_num_threads(), mc.max_model_len, mc.sources["max_model_len"], args.truncation,
             args.long_input, engine.engine_config.max_num_batched_tokens, engine.engine_config.max_num_seqs)
    app = build_app(engine, ServerConfig(served_model_names=args.served_model_name or [args.model],
                                         api_key=args.api_key, max_request_bytes=args.max_request_bytes,
                                         max_inputs_per_request=args.max_inputs_per_request))
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level.lower(),
                                           timeout_graceful_shutdown=60))
    # uvicorn finishes in-flight requests on SIGTERM, then re-raises the signal to the previous handler;
    # a no-op handler there lets the process exit 0 after a graceful shutdown.
    signal.signal(signal.SIGTERM, lambda *_: None)
    server.run()
    return 0


def cmd_eval_retrieval(args: argparse.Namespace) -> int:
    from .. import LLM
    from ..eval.retrieval import load_beir, run_retrieval

    data = load_beir(args.data)
    llm = LLM(args.model, dtype=args.dtype, device=args.device, num_threads=args.threads,
              quantization=args.quantization)
    report = run_retrieval(llm, data, mode=args.mode, top_k=args.top_k, use_tqdm=not args.quiet)
    metrics = "  ".join(f"{k} {v:.4f}" for k, v in report.metrics.items())
    print(f"{args.data}: {report.num_docs} docs, {report.num_queries} queries; {args.model} {args.mode}")
    print(f"  {metrics}")
    print(f"  encode docs {report.encode_docs_s:.1f} s, queries {report.encode_queries_s:.2f} s, "
          f"search {report.search_s:.2f} s (exact, top {args.top_k})")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="polyvec", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="start the HTTP server")
    add_serve_args(serve)
    serve.set_defaults(func=cmd_serve)
    p = sub.add_parser("embed", help="embed a corpus offline and print throughput")
    p.add_argument("file", help="corpus.jsonl (BEIR) or a text file with one text per line")
    p.add_argument("--model", default=os.environ.get("POLYVEC_MODEL", DEFAULT_MODEL))
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", default=None, choices=["int8"],
                   help=QUANTIZATION_HELP)
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--limit", type=int, default=None, help="embed only the first N texts")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--output", default=None, help="write the embeddings to this .npy file (float32, one row per text)")
    p.set_defaults(func=cmd_embed)
    ev = sub.add_parser("eval-retrieval", help="retrieval quality on a BEIR-style folder")
    ev.add_argument("--model", default=os.environ.get("POLYVEC_MODEL", DEFAULT_MODEL))
    ev.add_argument("--data", required=True, help="folder with corpus.jsonl, queries.jsonl, qrels.tsv")
    ev.add_argument("--mode", choices=["dense", "multivector"], default="dense",
                    help="dense: cosine of pooled vectors; multivector: MaxSim of token vectors")
    ev.add_argument("--top-k", type=int, default=100)
    ev.add_argument("--dtype", default="auto")
    ev.add_argument("--quantization", default=None, choices=["int8"],
                    help=QUANTIZATION_HELP)
    ev.add_argument("--device", default="auto")
    ev.add_argument("--threads", type=int, default=None)
    ev.add_argument("--quiet", action="store_true", help="no progress bar")
    ev.set_defaults(func=cmd_eval_retrieval)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
