"""Many clients at once share batches and each get their own answers; disconnects and SIGTERM are clean."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch

from polyvec.entrypoints.server.async_engine import AsyncEngine
from tests.conftest import MINILM
from tests.entrypoints.server.conftest import Server, free_port, in_process_server
from tests.helpers import cosine_rows


def test_64_concurrent_clients_get_their_own_results(server, minilm_llm, cranfield_texts):
    texts = [cranfield_texts[i % len(cranfield_texts)] + f" (client {i})" for i in range(64)]
    ref = torch.stack([o.outputs.data for o in minilm_llm.embed(texts, use_tqdm=False)])
    before = _metric(server, "polyvec_batch_sequences_count")

    async def one(client, i):
        r = await client.post("/v1/embeddings", json={"input": texts[i]})
        assert r.status_code == 200, r.text
        return torch.tensor(r.json()["data"][0]["embedding"])

    async def main():
        async with httpx.AsyncClient(
            base_url=server.url, timeout=120, limits=httpx.Limits(max_connections=64)
        ) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    got = torch.stack(asyncio.run(main()))
    assert cosine_rows(got, ref).min() >= 0.9999
    batches = _metric(server, "polyvec_batch_sequences_count") - before
    assert batches < 64, "concurrent requests should share forward passes"


def _metric(server, name: str) -> float:
    for line in server.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(name)


def test_cancelled_request_is_dropped_from_the_queue(minilm_llm):
    """A request whose awaiting coroutine is cancelled (its client left) leaves the scheduler queue."""
    engine = AsyncEngine(minilm_llm.engine)  # loop thread not started: requests stay queued

    async def main():
        requests = await engine.process(["abandoned"] * 3, None, "embed")
        task = asyncio.ensure_future(engine.run(requests))
        await asyncio.sleep(0.05)
        assert engine.queue_depth == 3 and engine.num_pending == 3
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert engine.queue_depth == 0 and engine.num_pending == 0

    asyncio.run(main())
    engine.stop()


def test_requests_are_served_while_the_engine_warms_up(minilm_llm, cranfield_texts):
    """The warm-up runs between requests, one batch size per step: a request sent at start does not wait for
    the rest of it, gets the same vectors as offline, and the warm-up then finishes."""
    engine = AsyncEngine(minilm_llm.engine, warmup=True)
    sizes = len(minilm_llm.engine.runner.bucket_sizes(minilm_llm.engine.engine_config.max_num_batched_tokens))
    assert sizes >= 90  # float32: up to 4,096 tokens
    engine.start()

    async def main():
        requests = await engine.process(cranfield_texts[:3], None, "embed")
        outputs = await engine.run(requests)
        return outputs, engine._warmup_steps

    try:
        outputs, steps = asyncio.run(main())
        assert steps < sizes, "the request waited for the whole warm-up"
        assert engine.warmed_up.wait(300), "the warm-up did not finish"
        assert engine._warmup_steps == sizes
    finally:
        engine.stop()
    offline = minilm_llm.embed(cranfield_texts[:3], use_tqdm=False)
    for got, want in zip(outputs, offline):
        assert torch.equal(got.outputs.data, want.outputs.data)


def test_stop_during_the_warm_up_returns_at_once(minilm_llm):
    engine = AsyncEngine(minilm_llm.engine, warmup=True)
    engine.start()
    time.sleep(0.2)
    t0 = time.monotonic()
    engine.stop()
    assert not engine._thread.is_alive() and time.monotonic() - t0 < 10
    assert not engine.warmed_up.is_set()


def test_disconnected_clients_do_not_block_others(server):
    """Clients that give up mid-request have their queued work dropped; the next request is answered fast.

    Each abandoned request is ~80k tokens (over 10 s of work here); if they were not dropped, the probe
    request would wait behind all three.
    """
    big = {"input": ["a long document about boundary layers " * 30] * 400}
    aborted = _metric(server, "polyvec_aborted_requests_total")
    for _ in range(3):
        with pytest.raises(httpx.TimeoutException):
            httpx.post(server.url + "/v1/embeddings", json=big, timeout=0.5)
    start = time.monotonic()
    r = server.post("/v1/embeddings", {"input": "after the disconnects"})
    assert r.status_code == 200
    assert time.monotonic() - start < 8
    assert _metric(server, "polyvec_aborted_requests_total") - aborted >= 3 * 300
    assert _metric(server, "polyvec_queue_depth") == 0


def test_sigterm_finishes_in_flight_requests_and_exits_zero():
    s = Server(MINILM)
    result = {}

    def request():
        result["r"] = httpx.post(
            s.url + "/v1/embeddings", json={"input": ["in flight during shutdown " * 20] * 200}, timeout=120
        )

    t = threading.Thread(target=request)
    t.start()
    time.sleep(0.5)  # the request is being served
    s.proc.send_signal(signal.SIGTERM)
    t.join(timeout=120)
    assert result["r"].status_code == 200 and len(result["r"].json()["data"]) == 200
    assert s.proc.wait(timeout=60) == 0


def test_ctrl_c_stops_the_server_without_a_traceback():
    """SIGINT (Ctrl-C) once serving and during start-up: one line, exit 130, no Python traceback."""
    s = Server(MINILM)
    assert s.post("/v1/embeddings", {"input": "before Ctrl-C"}).status_code == 200
    s.proc.send_signal(signal.SIGINT)
    assert s.proc.wait(timeout=60) == 130
    log = s.log.read_text()
    assert "Traceback" not in log and "polyvec: interrupted" in log, log
    starting = subprocess.Popen(
        [sys.executable, "-m", "polyvec", "serve", MINILM, "--port", str(free_port())],
        stderr=subprocess.PIPE,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    time.sleep(1.5)  # importing torch or loading the model
    starting.send_signal(signal.SIGINT)
    _, err = starting.communicate(timeout=60)
    assert starting.returncode == 130 and b"Traceback" not in err, err.decode()
    # twice (uvicorn's forced exit, without the lifespan's shutdown): exited 0, or aborted in C++ (134) when the
    # engine thread was inside a kernel at the interpreter's exit
    twice = Server(MINILM)
    twice.proc.send_signal(signal.SIGINT)
    time.sleep(0.05)
    twice.proc.send_signal(signal.SIGINT)
    assert twice.proc.wait(timeout=60) == 130
    log = twice.log.read_text()
    assert "terminate called" not in log and "Traceback" not in log and "polyvec: interrupted" in log, log


def test_waiting_requests_count_a_long_input_once():
    """vllm:num_requests_waiting counts requests: a long input's queued windows are one request, and none
    once one of its windows has started (it counted 352 windows and 0 running for 48 requests)."""
    from types import SimpleNamespace

    from polyvec.entrypoints.server.async_engine import waiting_requests

    def req(rid, parent=None):
        return SimpleNamespace(request_id=rid, parent=parent, windows=None)

    whole, started = req("a"), req("b")
    whole.windows = [req(f"a{i}", whole) for i in range(3)]
    started.windows = [req(f"b{i}", started) for i in range(3)]
    plain = req("c")
    assert waiting_requests([*whole.windows, *started.windows[1:], plain]) == 2  # a and c; b is running
    assert waiting_requests([]) == 0


def test_a_large_response_is_encoded_off_the_event_loop(minilm_llm, monkeypatch):
    """Encoding token vectors as JSON ran on the event loop: a 1.2 GB body held /health for 2.3 s. Responses of
    more than 2^18 numbers are built in a worker thread; small ones stay in place."""
    from polyvec.entrypoints.server import serving

    threads = []
    encode = serving.encoded_response

    def recording(*args, **kwargs):
        threads.append(threading.current_thread())
        return encode(*args, **kwargs)

    monkeypatch.setattr(serving, "encoded_response", recording)
    monkeypatch.setattr("polyvec.entrypoints.server.routes.embeddings.encoded_response", recording)
    with in_process_server(minilm_llm.engine, warmup=False) as url:
        small = httpx.post(url + "/pooling", json={"input": "short", "task": "token_embed"}, timeout=60)
        big = httpx.post(url + "/pooling", json={"input": ["word " * 200] * 8, "task": "token_embed"}, timeout=60)
        assert small.status_code == big.status_code == 200
        assert big.json()["data"][0]["shape"] == [202, 384]  # 8 x 202 x 384 numbers: over 2^18
    loop_thread = threads[0]
    assert threads[1] is not loop_thread  # a worker thread


def test_a_large_body_is_encoded_with_the_gil_free_between_pieces():
    """Built in a worker thread, a large JSON body still held the event loop: orjson holds the GIL for a whole
    call (/health stalled while a large token_embed response was encoded). In a worker, VectorJSONResponse now
    encodes in pieces of at most 2^16 numbers, byte for byte orjson's: another thread runs between them."""
    import numpy as np
    import orjson

    from polyvec.entrypoints.server.encoding import VectorJSONResponse, build_large, dumps_in_pieces

    rng = np.random.default_rng(0)
    body = {"id": "x", "data": [{"index": i, "data": rng.standard_normal((300, 384))} for i in range(4)],
            "wide": rng.standard_normal((2, 3, 40000)), "flat": rng.standard_normal(70000), "none": [],
            "empty": {}, "rows": np.zeros((0, 3)), "mixed": [1.5, None, "é", (1, 2)]}  # fmt: skip
    want = orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)
    assert dumps_in_pieces(body) == want
    assert build_large(lambda: VectorJSONResponse(body)).body == want == VectorJSONResponse(body).body
    content = {"data": [{"index": i, "data": rng.standard_normal((2000, 384))} for i in range(4)]}
    for encode, holds in ((lambda: orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY), True),
                          (lambda: dumps_in_pieces(content), False)):  # fmt: skip
        ticks: list[float] = []
        done = threading.Event()

        def tick(ticks: list[float] = ticks, done: threading.Event = done) -> None:
            while not done.is_set():
                ticks.append(time.perf_counter())
                time.sleep(0.001)

        ticker = threading.Thread(target=tick)
        ticker.start()
        time.sleep(0.02)
        start = time.perf_counter()
        encode()
        end = time.perf_counter()
        done.set()
        ticker.join()
        longest = max(np.diff([start, *[t for t in ticks if start <= t <= end], end]))
        # one orjson call: the other thread waits through it; in pieces, it runs all along
        assert (longest > 0.8 * (end - start)) if holds else (longest < 0.4 * (end - start)), (longest, end - start)


def test_a_bodys_priority_reaches_the_scheduler(minilm_path):
    """Each vLLM / Cohere route hands its body's `priority` to the engine's queue (null: 0), which orders by it
    under --scheduling-policy priority (the flag was an unknown argument, and the field was dropped)."""
    from polyvec import LLM
    from polyvec.entrypoints.cli import build_parser

    args = build_parser().parse_args(["serve", "m", "--scheduling-policy", "priority"])
    assert args.scheduling_policy == "priority"
    assert build_parser().parse_args(["serve", "m"]).scheduling_policy == "fcfs"
    from polyvec.config import EngineConfig

    with pytest.raises(ValueError, match="scheduling_policy must be 'fcfs' or 'priority', got 'lifo'"):
        EngineConfig(scheduling_policy="lifo")  # type: ignore[arg-type]
    engine = LLM(str(minilm_path), dtype="float32", scheduling_policy="priority").engine
    assert engine.scheduler.policy == "priority"
    seen: list[int] = []
    add = engine.scheduler.add_all

    def recording(requests):
        requests = list(requests)
        seen.extend(r.priority for r in requests)
        add(requests)

    engine.scheduler.add_all = recording
    cases = [
        ("/v1/embeddings", {"input": ["a", "b"], "priority": 5}, 5),
        ("/pooling", {"input": "a", "task": "token_embed", "priority": -2}, -2),
        ("/score", {"queries": "a", "documents": ["b"], "priority": 3}, 3),
        ("/v1/rerank", {"query": "a", "documents": ["b"], "priority": None}, 0),
        ("/v2/embed", {"texts": ["a"], "input_type": "search_query", "priority": 2**63 - 1}, 2**63 - 1),
        ("/v1/embed", {"texts": ["a"]}, 0),
    ]
    with in_process_server(engine, warmup=False) as url:
        for path, body, want in cases:
            seen.clear()
            r = httpx.post(url + path, json=body, timeout=60)
            assert r.status_code == 200, (path, r.text)
            assert seen and set(seen) == {want}, (path, seen)
