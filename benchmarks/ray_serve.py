"""What Ray Serve costs: `polyvec serve --replicas 1` (one replica behind HAProxy, and behind Ray's Python proxy)
against plain `polyvec serve`.

    python benchmarks/ray_serve.py [--clients 8 32] [--requests 1500] [--rounds 2] [--texts-per-request 1]
        [--ingress haproxy proxy] [--ray-env K=V[,K=V] ...]

Each round starts one server after the other, each round from another one (same model, dtype, threads, a free
loopback port), waits until the machine is idle (the kernels' warm-up done), sends 64 warm-up requests, then
`--requests` /v1/embeddings requests from each number of concurrent clients, and stops it (SIGTERM). Prints
tokens/s and p50/p99 latency per system and client count, and Ray / plain per round. Texts: Cranfield passages
($POLYVEC_DATA, else the tests/data slice).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import hardware  # noqa: E402
from reliability import MODEL, Server, fan_out, passages, pct  # noqa: E402


def busy_fraction(seconds: float = 1.0) -> float:
    """The machine's CPU use over `seconds` (all processes), from /proc/stat."""

    def sample() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        idle = fields[3] + fields[4]
        return sum(fields) - idle, sum(fields)

    b0, t0 = sample()
    time.sleep(seconds)
    b1, t1 = sample()
    return (b1 - b0) / max(1, t1 - t0)


def settle(limit: float = 300) -> float:
    """Wait until the machine is idle (below 10% busy for a second); returns the seconds waited."""
    start = time.monotonic()
    while time.monotonic() - start < limit and busy_fraction() > 0.10:
        pass
    return time.monotonic() - start


async def load(server: Server, clients: int, texts: list[str], timeout: float) -> dict[str, float | list[float]]:
    async def one(c: httpx.AsyncClient, batch: list[str]) -> tuple[float, int]:
        t0 = time.perf_counter()
        r = await c.post("/v1/embeddings", json={"input": batch})
        r.raise_for_status()
        return time.perf_counter() - t0, r.json()["usage"]["prompt_tokens"]

    start = time.perf_counter()
    done = await fan_out(server, clients, timeout, texts, one)
    wall = time.perf_counter() - start
    return {"tokens_s": sum(d[1] for d in done) / wall, "latency": [d[0] for d in done]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--clients", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--requests", type=int, default=1500)
    ap.add_argument("--texts-per-request", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=120)
    ap.add_argument("--ingress", nargs="*", default=["haproxy", "proxy"], choices=["haproxy", "proxy"])
    ap.add_argument("--ray-env", nargs="*", default=[], metavar="K=V[,K=V]", help="one more system per item")
    args = ap.parse_args()
    texts, source = passages()
    k = args.texts_per_request
    work = [[texts[(i * k + j) % len(texts)] for j in range(k)] for i in range(args.requests)]
    systems = {"polyvec serve": ([], {})}
    for ingress in args.ingress:
        systems[f"Ray Serve, 1 replica, {ingress}"] = (["--replicas", "1", "--ingress", ingress], {})
    for variant in args.ray_env:  # more Ray Serve systems, each with these environment variables
        env = dict(kv.split("=", 1) for kv in variant.split(","))
        systems[f"Ray Serve, 1 replica, {variant}"] = (["--replicas", "1"], env)
    print(f"## Ray Serve overhead: {args.requests} requests of {k} text(s) per client count; {args.model} "
          f"{args.dtype}\n{time.strftime('%Y-%m-%d')}, {hardware()}; texts {source}\n")  # fmt: skip
    print("| round | clients | system | tokens/s | p50 ms | p99 ms | Ray / plain |")
    print("|---|---|---|---|---|---|---|")
    for r in range(1, args.rounds + 1):
        results: dict[tuple[str, int], dict] = {}
        names = list(systems)
        for name in names[r - 1 :] + names[: r - 1]:  # each round starts with another system
            extra, env = systems[name]
            server = Server(args, "--dtype", args.dtype, *extra, env=env)
            try:
                settle()
                asyncio.run(load(server, 8, work[:64], args.timeout))  # warm-up
                for clients in args.clients:
                    results[name, clients] = asyncio.run(load(server, clients, work, args.timeout))
            finally:
                server.stop()
        for clients in args.clients:
            plain = results["polyvec serve", clients]["tokens_s"]
            for name in systems:
                m = results[name, clients]
                lat = m["latency"]
                ratio = f"{m['tokens_s'] / plain:.2f}x" if name != "polyvec serve" else ""
                print(f"| {r} | {clients} | {name} | {m['tokens_s']:,.0f} | {pct(lat, 50)} | {pct(lat, 99)} "
                      f"| {ratio} |", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
