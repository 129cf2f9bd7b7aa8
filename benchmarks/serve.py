"""HTTP serving benchmark: polyvec serve vs vllm serve, same model, corpus, cores; the systems take turns.

    python benchmarks/serve.py [--model M] [--requests 400] [--concurrency 1 8 32 64] [--rounds 3]
                               [--systems polyvec vllm]

Each request embeds one passage (Cranfield + Vaswani documents, in order) through POST /v1/embeddings. Both
servers stay up; for each round and concurrency level the script sends the same requests to each system in
turn and prints requests/s, tokens/s (from the servers' usage counts), p50/p95/p99 latency, the medians over
rounds, and the polyvec/vLLM ratio of each round. vLLM runs from a venv the
script creates on first use (benchmarks/.venv-vllm).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import REPO, hardware, load_passages, percentile, vllm_env, vllm_python  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(system: str, model_path: str, threads: int, dtype: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    if system == "polyvec":
        cmd = [
            sys.executable,
            "-m",
            "polyvec",
            "serve",
            model_path,
            "--served-model-name",
            "m",
            "--port",
            str(port),
            "--threads",
            str(threads),
            "--dtype",
            dtype,
            "--log-level",
            "warning",
        ]
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    else:
        cmd = [
            str(vllm_python()),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model_path,
            "--runner",
            "pooling",
            "--served-model-name",
            "m",
            "--port",
            str(port),
            "--dtype",
            dtype,
            "--gpu-memory-utilization",
            "0.3",
            "--uvicorn-log-level",
            "warning",
        ]
        env = vllm_env(threads)
    log = open(f"/tmp/bench-serve-{system}.log", "w")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{system} exited; see /tmp/bench-serve-{system}.log")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"{system} did not start")


async def run_level(url: str, texts: list[str], concurrency: int) -> dict:
    latencies: list[float] = []
    tokens = 0
    queue = list(enumerate(texts))

    async def worker(client: httpx.AsyncClient):
        nonlocal tokens
        while queue:
            _, text = queue.pop()
            t0 = time.perf_counter()
            # vLLM rejects over-long input unless asked to truncate; both systems get the same request.
            r = await client.post("/v1/embeddings", json={"input": text, "model": "m", "truncate_prompt_tokens": 256})
            latencies.append(time.perf_counter() - t0)
            r.raise_for_status()
            tokens += r.json()["usage"]["prompt_tokens"]

    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=concurrency)) as client:
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    return {
        "rps": len(texts) / elapsed,
        "tps": tokens / elapsed,
        "p50": percentile(latencies, 50) * 1e3,
        "p95": percentile(latencies, 95) * 1e3,
        "p99": percentile(latencies, 99) * 1e3,
        "tokens": tokens,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="sentence-transformers/all-MiniLM-L6-v2")
    ap.add_argument("--requests", type=int, default=400, help="requests per concurrency level and round")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--rounds", type=int, default=3, help="interleaved repeats of every level on every system")
    ap.add_argument("--systems", nargs="+", default=["polyvec", "vllm"], choices=["polyvec", "vllm"])
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()

    from polyvec.loader import resolve_model_path

    model_path = str(resolve_model_path(args.model))
    texts = load_passages(limit=args.requests)
    # All servers stay up for the whole run and take turns per level, the order flipped every round: this
    # VM's speed drifts by tens of percent over minutes, so only a ratio of runs made back to back means anything.
    servers: dict[str, tuple[subprocess.Popen, str]] = {}
    results: dict[tuple[str, int], list[dict]] = {}
    try:
        for system in args.systems:
            servers[system] = start(system, model_path, args.threads, args.dtype)
            asyncio.run(run_level(servers[system][1], texts[:32], 8))  # warm-up
        for rnd in range(args.rounds):
            for c in args.concurrency:
                for system in args.systems if rnd % 2 == 0 else args.systems[::-1]:
                    r = asyncio.run(run_level(servers[system][1], texts, c))
                    results.setdefault((system, c), []).append(r)
                    print(
                        f"round {rnd + 1} {system:8s} c={c:<3d} {r['rps']:8.1f} req/s {r['tps']:9.0f} tok/s  "
                        f"p50 {r['p50']:7.1f} ms  p95 {r['p95']:7.1f} ms  p99 {r['p99']:7.1f} ms",
                        file=sys.stderr,
                        flush=True,
                    )
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(timeout=60)

    tokens = next(iter(results.values()))[0]["tokens"]
    print(
        f"\n## Serving: {args.model}, {args.dtype}, {args.requests} requests of one passage each "
        f"(mean {tokens / args.requests:.0f} tokens), {args.threads} threads, {args.rounds} interleaved rounds"
    )
    print(f"Hardware: {hardware()}; date {time.strftime('%Y-%m-%d')}\n")
    print("| system | concurrency | req/s (median) | tokens/s | p50 ms | p95 ms | p99 ms |")
    print("|---|---|---|---|---|---|---|")
    for (system, c), runs in results.items():
        m = {k: statistics.median([r[k] for r in runs]) for k in ("rps", "tps", "p50", "p95", "p99")}
        print(
            f"| {system} | {c} | {m['rps']:.1f} | {m['tps']:.0f} | {m['p50']:.1f} | {m['p95']:.1f} | {m['p99']:.1f} |"
        )
    if len(args.systems) == 2:
        print("\n| concurrency | polyvec / vLLM throughput, per round (median) | vLLM / polyvec p50 latency (median) |")
        print("|---|---|---|")
        for c in args.concurrency:
            a, b = results["polyvec", c], results["vllm", c]
            ratios = [x["rps"] / y["rps"] for x, y in zip(a, b)]
            p50 = statistics.median([y["p50"] / x["p50"] for x, y in zip(a, b)])
            per_round = " ".join(f"{q:.2f}" for q in ratios)
            print(f"| {c} | {per_round} ({statistics.median(ratios):.2f}x) | {p50:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
