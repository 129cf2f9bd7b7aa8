"""Reliability of `polyvec serve`: soak, client disconnects, SIGTERM, batching consistency, CPU overhead.

    python benchmarks/reliability.py soak --clients 16 --minutes 10 [--interval 30]
    python benchmarks/reliability.py disconnects --clients 16 --rounds 5 [--batch 16] [--max-delay 0.5]
    python benchmarks/reliability.py sigterm --clients 16 [--after 5] [--batch 4]
    python benchmarks/reliability.py consistency --clients 64 [--requests 256]     (the server runs float32)
    python benchmarks/reliability.py overhead --clients 32 [--requests 2000] [--dtype auto] [--rounds 3]
    every subcommand: [--model M] [--threads T] [--timeout S] [--max-requests N] [--max-seconds S]

Each starts its own server (`python -m polyvec serve MODEL --port P --log-level warning`, HF_HUB_OFFLINE=1)
on a free loopback port, drives it with httpx clients, reads its RSS and CPU time from /proc/<pid>, stops it
and prints a markdown table and a verdict against the goal (figures only; nothing is asserted):
- soak: embeddings (1 and 8 texts), pooling token_embed, score, rerank, tokenize, v2/embed and bad requests
  (must get 4xx); per interval errors (5xx/transport), req/s, p50/p99, server RSS. Goal: 0 errors, RSS
  growth (first to last interval) < 5% over 10 minutes.
- disconnects: large token_embed requests cancelled (connection closed) after 0..max-delay s; after each
  round the time until /metrics reads polyvec_queue_depth = polyvec_requests_in_flight = 0, and RSS; then a
  normal request must succeed.
- sigterm: SIGTERM mid-load. Goal: every request in flight at the signal answered 200, exit code 0.
- consistency: distinct embedding requests alone (twice), then all at once from the clients; max abs diff and
  min cosine item by item. Goal (float32): max abs diff <= 1e-5.
- overhead: server CPU s per 1,000 tokens vs `polyvec.LLM(model).embed` of the same texts in another process
  (same dtype and threads), in rounds that alternate the two. Goal: median <= 1.15x offline.
Texts: Cranfield passages from $POLYVEC_DATA/cranfield when there, else the tests/data/cranfield slice.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import DATA, REPO, hardware, load_passages, percentile  # noqa: E402
from serve import free_port  # noqa: E402

MODEL = "sentence-transformers/all-MiniLM-L6-v2"
TICK = os.sysconf("SC_CLK_TCK")
JSON = {"content-type": "application/json"}


def passages() -> tuple[list[str], str]:
    if (DATA / "cranfield" / "corpus.jsonl").is_file():
        return load_passages(("cranfield",)), str(DATA / "cranfield")
    path = REPO / "tests" / "data" / "cranfield" / "corpus.jsonl"
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    from polyvec.eval import document_text

    texts = [document_text(r) for r in rows]
    return [t for t in texts if t], "tests/data/cranfield (slice)"


def rss_mib(pid: int) -> float:
    return int(re.search(r"VmRSS:\s+(\d+)", Path(f"/proc/{pid}/status").read_text())[1]) / 1024


def cpu_s(pid: int | str = "self") -> float:
    """utime + stime of a whole process (all threads), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds per thread name of a process (threads of one name summed)."""
    out: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def header(title: str, args: argparse.Namespace, source: str) -> None:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    print(f"\n## Reliability: {title}\n{time.strftime('%Y-%m-%d')}, commit {commit.stdout.strip() or '?'}, "
          f"{hardware()}; model {args.model}; texts {source}\n")  # fmt: skip


def verdict(ok: bool, goal: str, detail: str) -> None:
    print(f"\n**Verdict: {'PASS' if ok else 'FAIL'}** (goal: {goal}): {detail}")


class Server:
    """`polyvec serve` in a subprocess on a free loopback port; stop() sends SIGTERM and returns the exit code."""

    def __init__(self, args: argparse.Namespace, *extra: str, env: dict[str, str] | None = None):
        self.url = f"http://127.0.0.1:{free_port()}"
        cmd = [sys.executable, "-m", "polyvec", "serve", args.model, "--port", self.url.rsplit(":", 1)[1]]
        cmd += ["--log-level", "warning", *(["--threads", str(args.threads)] if args.threads else []), *extra]
        self.log = tempfile.NamedTemporaryFile("w+", prefix="polyvec-reliability-", suffix=".log", delete=False)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self.pid = self.proc.pid
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                sys.exit(f"the server exited with {self.proc.returncode}; see {self.log.name}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        sys.exit(f"the server did not start in 300 s; see {self.log.name}")

    def stop(self, timeout: float = 90) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                print(f"the server did not exit {timeout:g} s after SIGTERM; killed", file=sys.stderr)
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def problems(self) -> str:
        text = Path(self.log.name).read_text(errors="replace")
        n = sum(1 for line in text.splitlines() if "ERROR" in line or "Traceback" in line)
        return f"server log {self.log.name}: {n} ERROR/Traceback lines"


async def settle(server: Server, limit: float = 120) -> float:
    """Wait until the server's CPU use stops (its warm-up done); returns the seconds waited."""
    t0 = time.monotonic()
    last = cpu_s(server.pid)
    while time.monotonic() - t0 < limit:
        await asyncio.sleep(0.5)
        now = cpu_s(server.pid)
        if now - last < 0.02:
            break
        last = now
    return time.monotonic() - t0


async def metrics(client: httpx.AsyncClient) -> dict[str, float]:
    """polyvec's Prometheus samples as {name{labels}: value}."""
    r = await client.get("/metrics")
    out = {}
    for line in r.text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


async def fan_out(server: Server, clients: int, timeout: float, items: list, fn) -> list:
    """`await fn(client, item)` for every item, from `clients` workers sharing one connection pool."""
    results: list = [None] * len(items)
    queue = list(enumerate(items))[::-1]
    limits = httpx.Limits(max_connections=clients)
    async with httpx.AsyncClient(base_url=server.url, timeout=timeout, limits=limits) as c:

        async def worker() -> None:
            while queue:
                i, item = queue.pop()
                results[i] = await fn(c, item)

        await asyncio.gather(*(worker() for _ in range(clients)))
    return results


def pct(values: list[float], q: float) -> str:
    return f"{percentile(values, q) * 1e3:.0f}" if values else "-"


MIX = ("embed1", "embed8", "token_embed", "embed1", "score", "rerank", "tokenize", "v2embed", "embed1", "bad")
BAD = ("bad_field", "bad_model", "bad_empty", "bad_json", "bad_route", "bad_token")


def build(kind: str, n: int, texts: list[str]) -> tuple[str, dict]:
    def t(k: int) -> str:
        return texts[(n + k) % len(texts)]

    path, body = {
        "embed1": lambda: ("/v1/embeddings", {"input": t(0)}),
        "embed8": lambda: ("/v1/embeddings", {"input": [t(k) for k in range(8)]}),
        "token_embed": lambda: ("/pooling", {"input": t(0), "task": "token_embed"}),
        "score": lambda: ("/score", {"text_1": t(0)[:200], "text_2": [t(1), t(2), t(3)]}),
        "rerank": lambda: ("/rerank", {"query": t(0)[:200], "documents": [t(k) for k in range(1, 5)]}),
        "tokenize": lambda: ("/tokenize", {"prompt": t(0)}),
        "v2embed": lambda: ("/v2/embed", {"texts": [t(0), t(1)], "input_type": "search_document"}),
        "bad_field": lambda: ("/v1/embeddings", {"input": t(0), "no_such_field": 1}),
        "bad_model": lambda: ("/v1/embeddings", {"input": t(0), "model": "no-such-model"}),
        "bad_empty": lambda: ("/v1/embeddings", {"input": []}),
        "bad_json": lambda: ("/v1/embeddings", b'{"input": "unterminated'),
        "bad_route": lambda: ("/v1/no-such-route", {"input": t(0)}),
        "bad_token": lambda: ("/v1/embeddings", {"input": [[-1, 5]]}),
    }[kind]()
    return path, {"content": body, "headers": JSON} if isinstance(body, bytes) else {"json": body}


async def soak(args: argparse.Namespace, server: Server, texts: list[str]) -> None:
    records: list[tuple[float, float, bool, int]] = []  # (start, latency, bad request?, status; 0 = transport)
    samples: list[tuple[float, float]] = []  # (seconds since start, server RSS MiB), once a second
    idle_rss = rss_mib(server.pid)
    waited = await settle(server)  # the start-up warm-up (kernels for every batch size) runs while idle
    warm_rss = rss_mib(server.pid)
    start = time.monotonic()
    deadline = start + args.minutes * 60

    async def client(cid: int) -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=args.timeout) as c:
            for i in range(args.max_requests):
                if time.monotonic() >= deadline:
                    return
                n = cid * 7919 + i
                kind = MIX[n % len(MIX)]
                bad = kind == "bad"
                path, kw = build(BAD[n // len(MIX) % len(BAD)] if bad else kind, n, texts)
                t0 = time.monotonic()
                try:
                    status = (await c.post(path, **kw)).status_code
                except httpx.HTTPError:
                    status = 0
                records.append((t0 - start, time.monotonic() - t0, bad, status))

    async def monitor() -> None:
        # Sampled every second: one sample lands anywhere in the allocator's cycle (a batch's activations
        # live, or just trimmed), so an interval is summed up by its median and its peak.
        while time.monotonic() < deadline:
            await asyncio.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
            samples.append((time.monotonic() - start, rss_mib(server.pid)))

    await asyncio.gather(monitor(), *(client(i) for i in range(args.clients)))
    n_intervals = max(1, math.ceil(args.minutes * 60 / args.interval))
    rss = [[r for t, r in samples if min(int(t // args.interval), n_intervals - 1) == k] for k in range(n_intervals)]
    print(f"server RSS when /health first answered: {idle_rss:.0f} MiB; after its warm-up ({waited:.1f} s, idle): "
          f"{warm_rss:.0f} MiB\n")  # fmt: skip
    print("| interval | requests | errors (5xx/transport) | 4xx on bad requests | unexpected status | req/s "
          "| p50 ms | p99 ms | server RSS MiB, median | peak |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    errors = unexpected = 0
    for k, r in enumerate(rss):
        rows = [x for x in records if min(int(x[0] // args.interval), n_intervals - 1) == k]
        err = sum(1 for x in rows if x[3] == 0 or x[3] >= 500)
        bad4 = sum(1 for x in rows if x[2] and 400 <= x[3] < 500)
        odd = sum(1 for x in rows if 0 < x[3] < 500 and (x[3] != 200 if not x[2] else not 400 <= x[3] < 500))
        lat = [x[1] for x in rows if not x[2]]
        span = min(args.interval, args.minutes * 60 - k * args.interval)
        errors, unexpected = errors + err, unexpected + odd
        med, top = statistics.median(r or [math.nan]), max(r or [math.nan])
        print(f"| {k + 1} | {len(rows)} | {err} | {bad4} | {odd} | {len(rows) / span:.1f} | {pct(lat, 50)} "
              f"| {pct(lat, 99)} | {med:.0f} | {top:.0f} |")  # fmt: skip
    first, last = statistics.median(rss[0] or [math.nan]), statistics.median(rss[-1] or [math.nan])
    growth = (last / first - 1) * 100
    peak = (max(rss[-1] or [math.nan]) / max(rss[0] or [math.nan]) - 1) * 100
    print(f"\nRSS median {first:.0f} -> {last:.0f} MiB ({growth:+.1f}%), peak {peak:+.1f}%, first to last "
          f"interval, over {args.minutes:g} min, {args.clients} clients")  # fmt: skip
    short = "" if args.minutes >= 10 else f"; ran {args.minutes:g} min, shorter than the goal's 10"
    detail = f"{errors} errors, {unexpected} unexpected statuses, RSS growth {growth:+.1f}%{short}"
    verdict(errors == unexpected == 0 and growth < 5, "0 errors, RSS growth < 5% over 10 minutes", detail)


async def disconnects(args: argparse.Namespace, server: Server, texts: list[str]) -> None:
    body = {"input": texts[: args.batch], "task": "token_embed"}
    rng = random.Random(0)
    await settle(server)  # the server's own start-up warm-up first
    async with httpx.AsyncClient(base_url=server.url, timeout=args.timeout) as c:
        # Warm-up with one full-size request, answered (base64: a smaller body), so RSS before is after warm-up.
        (await c.post("/pooling", json={**body, "encoding_format": "base64"})).raise_for_status()
        before = rss_mib(server.pid)
        print("| round | requests cut | answered before the cut | drain s | first /metrics: depth, ms "
              "| aborted (total) | 499 (total) | server RSS MiB |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|")
        drains = []
        for rnd in range(args.rounds):
            answered = 0

            async def cut(delay: float) -> None:
                nonlocal answered
                # A client of its own, so that cancelling the request closes its connection.
                async with httpx.AsyncClient(base_url=server.url, timeout=args.timeout) as own:
                    task = asyncio.ensure_future(own.post("/pooling", json=body))
                    await asyncio.sleep(delay)
                    if task.done() and not task.exception():
                        answered += 1
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)

            for _ in range(args.per_client):
                await asyncio.gather(*(cut(rng.uniform(0, args.max_delay)) for _ in range(args.clients)))
            t0 = time.monotonic()
            m = await metrics(c)
            first_ms = (time.monotonic() - t0) * 1e3  # /metrics waits for the event loop, busy or not
            depth = depth0 = m["polyvec_queue_depth"] + m["polyvec_requests_in_flight"]
            while depth and time.monotonic() - t0 < args.drain_timeout:
                await asyncio.sleep(0.05)
                m = await metrics(c)
                depth = m["polyvec_queue_depth"] + m["polyvec_requests_in_flight"]
            drain = time.monotonic() - t0 if not depth else float("inf")
            drains.append(drain)
            aborted = m.get("polyvec_aborted_requests_total", 0)
            e499 = sum(v for k, v in m.items() if k.startswith("polyvec_requests_total") and 'status="499"' in k)
            print(f"| {rnd + 1} | {args.clients * args.per_client} | {answered} | {drain:.2f} | "
                  f"{depth0:.0f}, {first_ms:.0f} | {aborted:.0f} | {e499:.0f} "
                  f"| {rss_mib(server.pid):.0f} |")  # fmt: skip
        after = rss_mib(server.pid)
        t0 = time.monotonic()
        try:
            r = await c.post("/pooling", json={"input": texts[1], "task": "token_embed"})
            final = f"{r.status_code} in {(time.monotonic() - t0) * 1e3:.0f} ms"
            ok = r.status_code == 200
        except httpx.HTTPError as exc:
            final, ok = f"failed ({exc.__class__.__name__})", False
    print(f"\nRSS before {before:.0f} MiB, after {after:.0f} MiB ({(after / before - 1) * 100:+.1f}%); "
          f"max drain {max(drains):.2f} s; normal request afterwards: {final}")  # fmt: skip
    goal = "the queue drains after every round, a normal request succeeds afterwards"
    verdict(ok and max(drains) < args.drain_timeout, goal, f"max drain {max(drains):.2f} s, final request {final}")


async def sigterm(args: argparse.Namespace, server: Server, texts: list[str]) -> None:
    records: list[tuple[float, float, int | str]] = []  # (start, end, status or exception name)
    signalled: list[float] = []
    active: dict[int, float] = {}
    start = time.monotonic()

    async def client(cid: int) -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=args.timeout) as c:
            for i in range(args.max_requests):
                if time.monotonic() - start > args.after + args.timeout:
                    return
                n = cid * 7919 + i * args.batch
                body = {"input": [texts[(n + k) % len(texts)] for k in range(args.batch)]}
                t0 = active[cid] = time.monotonic()
                try:
                    r = await c.post("/v1/embeddings", json=body)
                    status: int | str = r.status_code
                except httpx.HTTPError as exc:
                    status = exc.__class__.__name__
                del active[cid]
                records.append((t0, time.monotonic(), status))
                if signalled and status != 200:
                    return  # the server is going away

    tasks = [asyncio.ensure_future(client(i)) for i in range(args.clients)]
    await asyncio.sleep(args.after)
    in_flight = len(active)
    signalled.append(time.monotonic())
    server.proc.send_signal(signal.SIGTERM)
    try:
        code: int | str = await asyncio.to_thread(server.proc.wait, 90)
    except subprocess.TimeoutExpired:
        code = "none: still running 90 s after SIGTERM (killed)"
    exit_s = time.monotonic() - signalled[0]
    await asyncio.wait(tasks, timeout=args.timeout)
    for t in tasks:
        t.cancel()
    sig = signalled[0]
    at = [x for x in records if x[0] < sig < x[1]]
    after = [x for x in records if x[0] >= sig]
    ok = sum(1 for x in at if x[2] == 200)
    fails = sorted({str(x[2]) for x in at if x[2] != 200})
    print("| clients | completed before the signal | in flight at the signal | of those 200 | of those failed "
          "| started after: 200 / failed | signal to exit s | exit code |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    print(f"| {args.clients} | {sum(1 for x in records if x[1] <= sig)} | {in_flight} | {ok} | {len(at) - ok} "
          f"| {sum(1 for x in after if x[2] == 200)} / {sum(1 for x in after if x[2] != 200)} | {exit_s:.2f} "
          f"| {code} |")  # fmt: skip
    late = sorted({str(x[2]) for x in after if x[2] != 200})
    print(f"\nfailures: in flight {', '.join(fails) or 'none'}; started after the signal {', '.join(late) or 'none'}")
    detail = f"{ok}/{in_flight} in-flight requests answered 200, exit code {code}"
    verdict(ok == len(at) == in_flight and code == 0, "every in-flight request completed, exit code 0", detail)


async def consistency(args: argparse.Namespace, server: Server, texts: list[str]) -> None:
    bodies = [{"input": [texts[(i * 4 + k) % len(texts)] for k in range(1 + i % 4)]} for i in range(args.requests)]

    async def send(c: httpx.AsyncClient, body: dict) -> np.ndarray:
        r = await c.post("/v1/embeddings", json=body)
        r.raise_for_status()
        data = sorted(r.json()["data"], key=lambda d: d["index"])
        return np.asarray([d["embedding"] for d in data], dtype=np.float64)

    alone = await fan_out(server, 1, args.timeout, bodies, send)
    again = await fan_out(server, 1, args.timeout, bodies, send)
    async with httpx.AsyncClient(base_url=server.url) as c:
        m0 = await metrics(c)
        together = await fan_out(server, args.clients, args.timeout, bodies, send)
        m1 = await metrics(c)
    seqs, passes = (m1[k] - m0[k] for k in ("polyvec_batch_sequences_sum", "polyvec_batch_sequences_count"))

    def compare(a: list[np.ndarray], b: list[np.ndarray]) -> tuple[float, float, float, int]:
        x, y = np.concatenate(a), np.concatenate(b)
        cos = (x * y).sum(1) / (np.linalg.norm(x, axis=1) * np.linalg.norm(y, axis=1))
        diff = np.abs(x - y)
        return float(diff.max()), float(diff.mean()), float(cos.min()), int((diff.max(1) == 0).sum())

    items = sum(len(a) for a in alone)
    print("| comparison | requests | items | max abs diff | mean abs diff | min cosine | items bit-identical |")
    print("|---|---|---|---|---|---|---|")
    for name, other in (("alone vs alone again", again), (f"alone vs {args.clients} concurrent clients", together)):
        mx, mean, cos, same = compare(alone, other)
        print(f"| {name} | {len(bodies)} | {items} | {mx:.2e} | {mean:.2e} | {cos:.7f} | {same} |")
    print(f"\nconcurrent phase: {seqs / max(passes, 1):.1f} sequences per forward pass ({passes:.0f} passes)")
    mx = compare(alone, together)[0]
    verdict(mx <= 1e-5, "float32, max abs diff <= 1e-5", f"max abs diff {mx:.2e} alone vs concurrent")


def offline_worker(args: argparse.Namespace) -> None:
    """Hidden subcommand: the offline side of `overhead`, in a process of its own. Loads the model once, then
    embeds the texts each time a line arrives on stdin and prints one JSON line per run."""
    from polyvec import LLM

    texts = passages()[0]
    work = [texts[i % len(texts)] for i in range(args.requests)]
    llm = LLM(args.model, dtype=args.dtype, num_threads=args.threads)
    llm.embed(work, use_tqdm=False)  # warm-up: kernels for its batch shapes, the heap (the server's is warm too)
    print("ready", flush=True)
    for _ in sys.stdin:
        c0, w0 = cpu_s(), time.perf_counter()
        outs = llm.embed(work, use_tqdm=False)
        tokens = sum(len(o.prompt_token_ids) for o in outs)
        print(json.dumps({"cpu": cpu_s() - c0, "wall": time.perf_counter() - w0, "tokens": tokens}), flush=True)


class Offline:
    """The offline worker, started once and idle (blocked on stdin) while the server is measured."""

    def __init__(self, args: argparse.Namespace):
        cmd = [sys.executable, __file__, "offline-worker", "--model", args.model, "--requests", str(args.requests)]
        cmd += ["--dtype", args.dtype, *(["--threads", str(args.threads)] if args.threads else [])]
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._expect("ready")

    def _expect(self, what: str) -> str:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(what):
                return line
        sys.exit(f"the offline run failed (exit {self.proc.wait()})")

    def run(self, server_pid: int) -> tuple[dict, float]:
        """One timed run, and the CPU seconds the idle server used meanwhile."""
        assert self.proc.stdin is not None
        idle = cpu_s(server_pid)
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        out = json.loads(self._expect("{"))
        return out, cpu_s(server_pid) - idle

    def stop(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(60)


async def fan_out_aiohttp(server: Server, clients: int, timeout: float, texts: list[str]) -> list[tuple[float, int]]:
    """POST /v1/embeddings {"input": text} for every text from `clients` workers over aiohttp: (latency, prompt
    tokens) each. A lighter load generator than httpx's (less of the shared cores' time away from the server)."""
    import aiohttp

    results: list = [None] * len(texts)
    queue = list(enumerate(texts))[::-1]
    connector = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(server.url, connector=connector, timeout=aiohttp.ClientTimeout(timeout)) as s:

        async def worker() -> None:
            while queue:
                i, text = queue.pop()
                t0 = time.perf_counter()
                async with s.post("/v1/embeddings", json={"input": text}) as r:
                    r.raise_for_status()
                    body = await r.json()
                results[i] = (time.perf_counter() - t0, body["usage"]["prompt_tokens"])

        await asyncio.gather(*(worker() for _ in range(clients)))
    return results


async def overhead(args: argparse.Namespace, server: Server, texts: list[str]) -> None:
    work = [texts[i % len(texts)] for i in range(args.requests)]

    async def one(c: httpx.AsyncClient, text: str) -> tuple[float, int]:
        t0 = time.perf_counter()
        r = await c.post("/v1/embeddings", json={"input": text})
        r.raise_for_status()
        return time.perf_counter() - t0, r.json()["usage"]["prompt_tokens"]

    async def load() -> list:
        if args.client == "aiohttp":
            return await fan_out_aiohttp(server, args.clients, args.timeout, work)
        return await fan_out(server, args.clients, args.timeout, work, one)

    def passes() -> tuple[float, float]:
        """The server's forward passes so far and the sequences in them (its polyvec_batch_sequences histogram)."""
        text = httpx.get(server.url + "/metrics", timeout=30).text
        value = {
            n: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            for n in ("polyvec_batch_sequences_count", "polyvec_batch_sequences_sum")
            if line.startswith(n + " ")
        }
        return value.get("polyvec_batch_sequences_count", 0.0), value.get("polyvec_batch_sequences_sum", 0.0)

    async def measure_server() -> dict:
        c0, w0, own, t0, p0 = cpu_s(server.pid), time.perf_counter(), cpu_s(), thread_cpu(server.pid), passes()
        done = await load()
        threads = {k: v - t0.get(k, 0.0) for k, v in thread_cpu(server.pid).items()}
        p1 = passes()
        return {"cpu": cpu_s(server.pid) - c0, "wall": time.perf_counter() - w0, "tokens": sum(x[1] for x in done),
                "own": cpu_s() - own, "latencies": [x[0] for x in done], "threads": threads,
                "seqs": (p1[1] - p0[1]) / max(p1[0] - p0[0], 1)}  # fmt: skip

    await settle(server)  # the server compiles its kernels while idle after start; not part of the figure
    await load()  # warm-up, as the offline side's
    # Both sides stay loaded and take turns (server first in even rounds, offline first in odd ones), so the
    # drift of a shared machine falls on both; each idles while the other runs.
    offline = Offline(args)
    rounds: list[tuple[dict, dict, float]] = []
    try:
        for k in range(args.rounds):
            if k % 2:
                off, idle = offline.run(server.pid)
                srv = await measure_server()
            else:
                srv = await measure_server()
                off, idle = offline.run(server.pid)
            rounds.append((srv, off, idle))
    finally:
        offline.stop()
    print("| round | system | requests | tokens | wall s | CPU s | CPU s / 1k tokens | tokens/s | p50 ms | p99 ms |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    ratios = []
    for k, (srv, off, _) in enumerate(rounds, 1):
        per = [m["cpu"] / m["tokens"] * 1e3 for m in (srv, off)]
        ratios.append(per[0] / per[1])
        for name, m, p in ((f"server, {args.clients} clients", srv, per[0]), ("offline LLM.embed", off, per[1])):
            lat = (pct(srv["latencies"], 50), pct(srv["latencies"], 99)) if m is srv else ("-", "-")
            print(f"| {k} | {name} | {args.requests} | {m['tokens']} | {m['wall']:.2f} | {m['cpu']:.2f} | {p:.4f} "
                  f"| {m['tokens'] / m['wall']:.0f} | {lat[0]} | {lat[1]} |")  # fmt: skip
    busy: dict[str, float] = {}
    for srv, _, _ in rounds:
        for name, v in srv["threads"].items():
            busy[name] = busy.get(name, 0.0) + v / len(rounds)
    own = statistics.mean(s["own"] for s, _, _ in rounds)
    print(f"\ndtype {args.dtype}; server/offline CPU per token by round: {', '.join(f'{r:.2f}x' for r in ratios)}; "
          f"the clients (this process) used {own:.2f} CPU s a round on the same cores; the idle server used "
          f"{max(i for _, _, i in rounds):.2f} CPU s at most while the offline ran")  # fmt: skip
    top = sorted(((v, k) for k, v in busy.items() if v >= 0.05), reverse=True)
    print("server CPU s by thread, mean of the rounds: " + ", ".join(f"{k} {v:.2f}" for v, k in top))
    print("sequences per forward pass by round: " + ", ".join(f"{s['seqs']:.1f}" for s, _, _ in rounds))
    ratio = statistics.median(ratios)
    verdict(ratio <= 1.15, "server CPU per token <= 1.15x offline, median of the rounds", f"{ratio:.2f}x")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--model", default=MODEL)
    common.add_argument("--threads", type=int, default=None, help="server (and offline) threads; default one per core")
    common.add_argument("--timeout", type=float, default=120, help="seconds one request may take")
    common.add_argument("--max-requests", type=int, default=1_000_000, help="per client, on top of the time bound")
    common.add_argument("--max-seconds", type=float, default=3600, help="bound on the whole run")
    common.add_argument("--server-env", action="append", default=[], metavar="KEY=VALUE", help="for the server only")
    spec: dict[str, dict[str, int | float | str]] = {
        "soak": {"clients": 16, "minutes": 10.0, "interval": 30.0},
        "disconnects": {"clients": 16, "rounds": 5, "per-client": 2, "batch": 16, "max-delay": 0.5},
        "sigterm": {"clients": 16, "after": 5.0, "batch": 4},
        "consistency": {"clients": 64, "requests": 256},
        "overhead": {"clients": 32, "requests": 2000, "dtype": "auto", "rounds": 3, "client": "httpx"},
    }
    spec["disconnects"]["drain-timeout"] = 120.0
    spec["offline-worker"] = spec["overhead"]  # the offline side of overhead, in a process of its own
    for name, options in spec.items():
        p = sub.add_parser(name, parents=[common])
        for key, default in options.items():
            p.add_argument(f"--{key}", type=type(default), default=default)
    args = ap.parse_args()
    if args.command == "offline-worker":
        offline_worker(args)
        return 0
    texts, source = passages()
    extra = {"consistency": ["--dtype", "float32"], "overhead": ["--dtype", getattr(args, "dtype", "auto")]}
    run = {"soak": soak, "disconnects": disconnects, "sigterm": sigterm, "consistency": consistency}
    run["overhead"] = overhead
    header(args.command, args, source)
    env = dict(kv.split("=", 1) for kv in args.server_env)
    server = Server(args, *extra.get(args.command, []), env=env)
    try:
        asyncio.run(asyncio.wait_for(run[args.command](args, server, texts), args.max_seconds))
    except TimeoutError:
        print(f"\n**gave up after --max-seconds {args.max_seconds:g}**")
    finally:
        server.stop()
        print(server.problems())
    return 0


if __name__ == "__main__":
    sys.exit(main())
