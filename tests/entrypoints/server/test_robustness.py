"""Hostile and unlucky clients: an internal error keeps its keep-alive connection, streamed and stalled bodies are
bounded, tokenizing a huge prompt leaves /health answering, overload gets 429, and the OpenAPI document lists
the statuses the server really sends."""

from __future__ import annotations

import gc
import json
import logging
import socket
import threading
import time

import httpx
import pytest

from polyvec.entrypoints.cli import build_parser
from tests.entrypoints.server.conftest import in_process_server

OK = {"input": "a good request"}


class _FaultyEngine:
    """The real engine, except that the prompt "raise" makes `process` fail the way a bug would."""

    def __init__(self, engine):
        self._engine = engine

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def process(self, prompts, *args, **kwargs):
        if "raise" in prompts:
            raise RuntimeError("injected fault")
        return self._engine.process(prompts, *args, **kwargs)


def _local_port(response: httpx.Response) -> int:
    return response.extensions["network_stream"].get_extra_info("client_addr")[1]


def test_internal_error_is_a_logged_500_and_the_connection_stays_usable(minilm_llm, caplog):
    with (
        in_process_server(_FaultyEngine(minilm_llm.engine)) as url,
        httpx.Client(base_url=url, timeout=60) as client,
    ):
        bad = client.post("/v1/embeddings", json={"input": "raise"})
        assert bad.status_code == 500
        assert bad.json() == {
            "error": {
                "message": "internal error: RuntimeError",
                "type": "InternalServerError",
                "param": None,
                "code": 500,
            }
        }
        port = _local_port(bad)
        good = client.post("/v1/embeddings", json=OK)  # on the same keep-alive connection
        assert good.status_code == 200 and len(good.json()["data"][0]["embedding"]) == 384
        assert _local_port(good) == port
    logged = [r for r in caplog.records if r.levelno == logging.ERROR and "unexpected error" in r.getMessage()]
    assert logged and logged[0].exc_info[0] is RuntimeError


def test_streamed_body_over_the_limit_is_413(tight_server):
    def chunks():  # 1.2 MB of JSON whitespace without a Content-Length (chunked)
        for _ in range(12):
            yield b" " * 100_000

    r = httpx.post(
        tight_server.url + "/v1/embeddings",
        content=chunks(),
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert r.status_code == 413, r.text
    assert "larger than the limit of 1000000 bytes" in r.json()["error"]["message"]
    assert tight_server.post("/v1/embeddings", OK).status_code == 200


def _stalled(server, path: str = "/v1/embeddings") -> socket.socket:
    """A connection that sends its headers and half its body, then nothing."""
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n".encode()
        + b'{"input": "half'
    )
    return sock


def _read_all(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_stalled_body_gets_408_and_its_connection_closed(tight_server):
    sock = _stalled(tight_server)
    start = time.monotonic()
    with sock:
        response = _read_all(sock)  # the server closes the connection after answering
    assert response.startswith(b"HTTP/1.1 408 "), response
    assert b"the request body did not arrive within 2 seconds" in response
    assert b'"type":"RequestTimeout"' in response and b'"code":408' in response
    assert 1.5 < time.monotonic() - start < 20
    assert tight_server.post("/v1/embeddings", OK).status_code == 200


def test_overload_gets_429_with_retry_after(tight_server):
    stalled = [_stalled(tight_server) for _ in range(2)]  # the server's limit: 2 requests in progress
    try:
        time.sleep(0.2)
        names = ('te_request_count{method="batch"}', 'te_request_failure{err="overloaded"}')

        def counts() -> list[float]:
            text = tight_server.get("/metrics").text
            return [float(next((ln.split()[-1] for ln in text.splitlines() if ln.startswith(n)), 0)) for n in names]

        before = counts()
        r = tight_server.post("/v1/embeddings", OK)
        assert r.status_code == 429, r.text
        assert r.headers["retry-after"] == "1"
        err = r.json()["error"]
        assert err["type"] == "TooManyRequests" and err["code"] == 429 and "limit of 2 requests" in err["message"]
        assert tight_server.get("/health").status_code == 200  # not counted
        # as TEI, counted as received and failed for its cause (failures outnumbered requests); not /tokenize's
        assert [b - a for a, b in zip(before, counts())] == [1, 1]
        assert tight_server.post("/tokenize", {"prompt": "x"}).status_code == 429
        assert [b - a for a, b in zip(before, counts())] == [1, 1]
    finally:
        for sock in stalled:
            sock.close()
    deadline = time.monotonic() + 10
    while (r := tight_server.post("/v1/embeddings", OK)).status_code == 429 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert r.status_code == 200


def _post_while_probing(server, path: str, **request) -> tuple[httpx.Response, list[float]]:
    """POST `request` to `path` from a thread while this one times GET /health, until the POST is answered:
    (its response, the probes' latencies)."""
    result: dict[str, httpx.Response] = {}
    # Both clients made before measuring: a client's TLS context (this process's GIL while its CA bundle loads)
    # is not the server's latency; nor is this process's collector (a full suite's heap).
    poster = httpx.Client(base_url=server.url, timeout=120)
    worker = threading.Thread(target=lambda: result.update(r=poster.post(path, **request)))
    latencies = []
    gc.disable()
    try:
        with httpx.Client(base_url=server.url, timeout=30) as probe:
            probe.get("/health")  # connect before measuring
            worker.start()
            while worker.is_alive():
                start = time.perf_counter()
                assert probe.get("/health").status_code == 200
                latencies.append(time.perf_counter() - start)
                time.sleep(0.005)
    finally:
        gc.enable()
        worker.join()
        poster.close()
    return result["r"], latencies


def test_tokenize_runs_off_the_event_loop(tight_server):
    """A maximum-size /tokenize (about a second of tokenizing) leaves /health answering within 100 ms."""
    prompt = "turbulent boundary layer over a flat plate " * (990_000 // 44)
    r, latencies = _post_while_probing(tight_server, "/tokenize", json={"prompt": prompt})
    body = r.json()
    assert r.status_code == 200 and body["count"] == len(body["tokens"]) > 100_000
    assert len(latencies) >= 5, "the probes did not overlap the tokenization"
    assert max(latencies) < 0.1, sorted(latencies)[-5:]


def test_many_tiny_items_are_counted_off_the_event_loop(tight_server):
    """A body of 190,000 one-token items (under 1 MB): refused by the item limit, counted before FastAPI validates
    it on the event loop (3 million such items held /health for 4-5 s), and /health answers within 100 ms."""
    for path, name in (("/v1/embeddings", "input"), ("/embed", "inputs")):
        data = json.dumps({name: [[1]] * 190_000}, separators=(",", ":")).encode()
        r, latencies = _post_while_probing(tight_server, path, content=data)
        assert r.status_code == 400 and r.json()["error"]["param"] == name, r.text
        assert f"'{name}' has 190000 items; the limit is 4096 per request" in r.json()["error"]["message"]
        assert max(latencies) < 0.1, sorted(latencies)[-5:]


def test_counting_items_pauses_the_collector():
    """The count's parse holds the GIL (and the event loop) throughout; the collector, run every few hundred of its
    lists, made that stall several times longer. Paused for the parse and the freeing, restored after (left off
    where it was off)."""
    from polyvec.entrypoints.server.app import _too_many_items

    body = json.dumps({"input": [[1]] * 190_000}).encode()
    runs: list[int] = []

    def count(phase: str, info: dict) -> None:
        runs.append(info["generation"])

    gc.callbacks.append(count)
    try:
        assert _too_many_items(body, 4096) == ("input", 190_000, False)
        assert runs == [] and gc.isenabled()
        gc.disable()
        assert _too_many_items(body, 4096) == ("input", 190_000, False)
        assert not gc.isenabled()
    finally:
        gc.enable()
        gc.callbacks.remove(count)


def test_head_and_get_carry_no_body_limits(tight_server):
    """HEAD on a GET route is its headers (it was 405); a GET's declared body is not read, limited or waited for
    (413 and 408 before, statuses /health does not document); a JSON media type with a suffix is JSON."""
    for path in ("/health", "/v1/models", "/info"):
        get, head = tight_server.get(path), httpx.head(tight_server.url + path)
        assert head.status_code == get.status_code == 200 and head.content == b"", path
        for name in ("content-type", "content-length"):
            assert head.headers.get(name) == get.headers.get(name), (path, name)
    with socket.create_connection(("127.0.0.1", tight_server.port), timeout=10) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: 999999999\r\n\r\n")
        assert sock.recv(100).startswith(b"HTTP/1.1 200 ")
    for media in ("application/vnd.api+json", "application/json; charset=utf-8", "text/plain", "application/jsonx"):
        r = httpx.post(tight_server.url + "/v1/embeddings", content=json.dumps(OK), headers={"content-type": media})
        assert r.status_code == 200 and len(r.json()["data"][0]["embedding"]) == 384, (media, r.text)


def test_detokenize_runs_off_the_event_loop(tight_server):
    r = tight_server.post("/detokenize", {"tokens": [7592, 2088] * 50_000})
    assert r.status_code == 200 and r.json()["prompt"].startswith("hello world hello")


def test_new_flags_have_defaults_and_environment_variables(monkeypatch):
    args = build_parser().parse_args(["serve"])
    assert args.request_body_timeout == 30.0 and args.max_concurrent_requests == 512
    monkeypatch.setenv("POLYVEC_MAX_CONCURRENT_REQUESTS", "7")
    args = build_parser().parse_args(["serve", "--request-body-timeout", "2.5"])
    assert args.request_body_timeout == 2.5 and args.max_concurrent_requests == 7


ERROR_REF = {"$ref": "#/components/schemas/ErrorResponse"}


def test_openapi_documents_the_statuses_and_the_error_schema(server):
    doc = server.get("/openapi.json").json()
    schemas = doc["components"]["schemas"]
    assert "HTTPValidationError" not in schemas and "ValidationError" not in schemas
    assert schemas["ErrorResponse"]["properties"]["error"] == {"$ref": "#/components/schemas/ErrorDetail"}
    assert set(schemas["ErrorDetail"]["properties"]) == {"message", "type", "param", "code"}
    posts = 0
    tei_only = {"/", "/embed", "/embed_all", "/embed_sparse", "/predict", "/similarity", "/decode", "/info"}
    tei_shared = {"/rerank", "/tokenize", "/invocations"}  # TEI's body or vLLM's: errors document both shapes
    for path, operations in doc["paths"].items():
        for method, operation in operations.items():
            responses = operation["responses"]
            if path not in tei_only | tei_shared:  # TEI answers 422 for invalid bodies; polyvec's routes never
                assert "422" not in responses, (method, path)
            if path in tei_only:
                continue
            if method == "post" and path != "/ping":
                posts += 1
                for status in ("400", "401", "404", "408", "413", "429", "500"):
                    schema = responses[status]["content"]["application/json"]["schema"]
                    assert schema == ERROR_REF or ERROR_REF in schema.get("anyOf", schema.get("oneOf", [])), (
                        path,
                        status,
                    )
            elif path not in ("/health", "/ping"):
                assert responses["401"]["content"]["application/json"]["schema"] == ERROR_REF, path
    assert posts == 14  # + /v1/embed, /invocations and /embeddings
    assert {"/embed", "/embed_all", "/predict", "/similarity", "/decode", "/info"} <= set(doc["paths"])
    health = doc["paths"]["/health"]["get"]["responses"]
    assert (
        list(health) == ["200", "503"]
        and "content" not in health["503"]
        and "engine stopped" in health["503"]["description"]
    )
    assert health["200"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/HealthResponse"}


def _arrays(schema: dict) -> list[dict]:
    return [s for s in schema.get("anyOf", [schema]) if s.get("type") == "array"]


@pytest.mark.parametrize(
    "model,field",
    [
        ("EmbeddingRequest", "input"),
        ("PoolingRequest", "input"),
        ("ClassificationRequest", "input"),
        ("RerankRequest", "documents"),
        ("CohereEmbedRequest", "texts"),
        ("ScoreRequest", "text_1"),
        ("ScoreRequest", "documents"),
    ],
)
def test_openapi_lists_that_must_not_be_empty(server, model, field):
    schemas = server.get("/openapi.json").json()["components"]["schemas"]
    arrays = _arrays(schemas[model]["properties"][field])
    assert arrays and all(a.get("minItems") == 1 for a in arrays), arrays
    for inner in (a["items"] for a in arrays if a["items"].get("type") == "array"):  # each token-id list
        assert inner.get("minItems") == 1, inner


class _PoisonedEngine:
    """The real engine, except that a forward pass with the token id POISON in it raises, as a kernel bug would;
    batches are held until two requests wait, so that a poisoned request shares its batch with a good one."""

    POISON = 29999

    def __init__(self, engine):
        self._engine = engine
        self.held = True  # until the first poisoned batch

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def schedule(self):
        return self._engine.schedule() if not self.held or len(self._engine.scheduler) >= 2 else []

    def run(self, batch):
        if any(self.POISON in c.request.prompt_token_ids for c in batch):
            self.held = False
            raise RuntimeError("injected fault")
        return self._engine.run(batch)


def test_a_faulting_request_fails_alone_not_its_batch(minilm_llm):
    """A forward pass that raises fails the request at fault only: the others of its batch run again one at a
    time and are answered (every request of the batch got a 500 before)."""
    from concurrent.futures import ThreadPoolExecutor

    with in_process_server(_PoisonedEngine(minilm_llm.engine)) as url:
        bodies = [{"input": [[101, 7592, 102]]}, {"input": [[101, _PoisonedEngine.POISON, 102]]}]
        with ThreadPoolExecutor(2) as pool:
            good, bad = pool.map(lambda b: httpx.post(url + "/v1/embeddings", json=b, timeout=60), bodies)
        assert bad.status_code == 500 and good.status_code == 200, (good.text, bad.text)
        want = minilm_llm.embed([[101, 7592, 102]], use_tqdm=False)[0].outputs.data.tolist()
        assert good.json()["data"][0]["embedding"] == pytest.approx(want, abs=1e-6)
        assert httpx.post(url + "/v1/embeddings", json=OK, timeout=60).status_code == 200


@pytest.mark.parametrize("where", ["forward", "output"])
def test_a_decoder_batch_that_faults_after_pooling_fails_its_faulting_request_only(tmp_path, minilm_path, where):
    """A decoder's batch holding the last chunk of a long prompt and a request at fault: the fault comes after the
    forward pass wrote the KV cache and the chunk's pooling state ("forward": the chunk runs again alone), or while
    the faulting request's output is made, after the long prompt's was ("output": that one is kept; run again, it
    had lost its KV cache). Either way the long prompt's vector is the one it has alone (its batch failed whole
    before)."""
    from concurrent.futures import ThreadPoolExecutor

    from polyvec import LLM, PoolerConfig
    from tests.models.test_decoder_parity import save_decoder

    save_decoder("qwen3", "ForCausalLM", tmp_path, minilm_path)
    make = lambda: LLM(  # noqa: E731
        str(tmp_path), dtype="float32", max_num_batched_tokens=16, pooler_config=PoolerConfig(pooling_type="MEAN")
    )
    long = [1000 + 7 * k for k in range(40)]  # three chunks of a 16-token budget
    want = make().embed([{"prompt_token_ids": long}], use_tqdm=False)[0].outputs.data
    llm = make()
    engine, execute = _PoisonedEngine(llm.engine), llm.engine.runner.execute
    engine.run = llm.engine.run  # the fault is the runner's, after its work

    def execute_then_fault(chunks):
        out = execute(chunks)
        if any(_PoisonedEngine.POISON in c.request.prompt_token_ids for c in chunks):
            engine.held = False
            raise RuntimeError("injected fault")
        return out

    output = llm.engine._output

    def output_or_fault(r, data):
        if _PoisonedEngine.POISON in r.prompt_token_ids:
            engine.held = False
            raise RuntimeError("injected fault")
        return output(r, data)

    if where == "forward":
        llm.engine.runner.execute = execute_then_fault
    else:
        llm.engine._output = output_or_fault
    with in_process_server(engine) as url:
        with ThreadPoolExecutor(2) as pool:
            good_f = pool.submit(httpx.post, url + "/v1/embeddings", json={"input": [long]}, timeout=60)
            deadline = time.monotonic() + 30
            while not len(llm.engine.scheduler):  # the long prompt first: the poisoned one joins its last chunk
                assert time.monotonic() < deadline
                time.sleep(0.01)
            poisoned = {"input": [[1001, _PoisonedEngine.POISON, 1002]]}
            bad, good = (
                pool.submit(httpx.post, url + "/v1/embeddings", json=poisoned, timeout=60).result(),
                good_f.result(),
            )
        assert bad.status_code == 500 and good.status_code == 200, (good.text, bad.text)
        assert good.json()["data"][0]["embedding"] == pytest.approx(want.tolist(), abs=1e-5)
        assert httpx.post(url + "/v1/embeddings", json={"input": [[1001, 1002]]}, timeout=60).status_code == 200


class _SchedulerBug:
    """The real engine, except that scheduling raises (a bug outside the forward pass ends the engine loop)."""

    def __init__(self, engine):
        self._engine = engine

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def schedule(self):
        raise RuntimeError("scheduler bug")


def test_a_dead_engine_loop_fails_health_checks_and_requests_not_hangs(minilm_path):
    """vLLM's /health (and SageMaker's /ping) answer 503 once the engine is dead; the request in flight and every
    later one get a 503 error body. Before, the health checks said 200 and every request waited forever."""
    from polyvec import LLM

    with in_process_server(_SchedulerBug(LLM(str(minilm_path)).engine), warmup=False) as url:
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        for _ in range(2):  # the one that meets the bug, then one to a dead engine
            r = httpx.post(url + "/v1/embeddings", json=OK, timeout=30)
            assert r.status_code == 503, r.text
            assert r.json()["error"]["message"] == "the engine stopped on an internal error; the server needs a restart"
        assert httpx.post(url + "/embed", json={"inputs": "x"}, timeout=30).json()["error_type"] == "Unhealthy"
        for path in ("/health", "/ping", "/"):
            assert httpx.get(url + path, timeout=10).status_code == 503, path
        assert httpx.post(url + "/tokenize", json={"prompt": "x"}, timeout=10).status_code == 200


class _HeldEngine:
    """The real engine, except that nothing is scheduled until `held` is cleared."""

    def __init__(self, engine):
        self._engine, self.held = engine, threading.Event()
        self.held.set()

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def schedule(self):
        return [] if self.held.is_set() else self._engine.schedule()


def test_load_counts_the_requests_in_progress(minilm_llm):
    """vLLM's GET /load ({"server_load": N}, polled by routers in front of several servers) was a 404."""
    from concurrent.futures import ThreadPoolExecutor

    engine = _HeldEngine(minilm_llm.engine)
    with in_process_server(engine, warmup=False) as url, ThreadPoolExecutor(2) as pool:
        assert httpx.get(url + "/load", timeout=10).json() == {"server_load": 0}
        held = [pool.submit(httpx.post, url + "/v1/embeddings", json=OK, timeout=60) for _ in range(2)]
        deadline = time.monotonic() + 30
        while httpx.get(url + "/load", timeout=10).json() != {"server_load": 2}:
            assert time.monotonic() < deadline, httpx.get(url + "/load", timeout=10).text
            time.sleep(0.02)
        engine.held.clear()
        assert [f.result().status_code for f in held] == [200, 200]
        assert httpx.get(url + "/load", timeout=10).json() == {"server_load": 0}


class _SlowTokenizer:
    """The real engine, with tokenization jobs that take `seconds` more (all, or those with a prompt "slow": a
    huge request's); `started` records each job's prompts."""

    def __init__(self, engine, seconds: float, only_slow: bool = True):
        self._engine, self.seconds, self.only_slow, self.started = engine, seconds, only_slow, []

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def process(self, prompts, *args, **kwargs):
        self.started.append(list(prompts))
        if "slow" in prompts or not self.only_slow:
            time.sleep(self.seconds)
        return self._engine.process(prompts, *args, **kwargs)


def test_a_client_leaving_during_tokenization_is_let_go(minilm_llm):
    """A client that left while its inputs were tokenized held its slot (/load, --max-concurrent-requests)
    until tokenization ended, and tokenization queued behind busy tokenizer threads still ran for it. It is let
    go at once now (TEI's "dropped"), and a tokenization its client left before it began never starts."""
    engine = _SlowTokenizer(minilm_llm.engine, 3.0)
    with in_process_server(engine, warmup=False) as url, httpx.Client(base_url=url, timeout=60) as client:
        before = client.get("/metrics").text.count("\n")  # the families are there
        assert before
        start = time.monotonic()
        for body in ({"input": "slow"}, {"input": "slow"}, {"input": "also queued"}):  # 2 tokenizer threads
            with pytest.raises(httpx.ReadTimeout):
                client.post("/v1/embeddings", json=body, timeout=0.3)
        deadline = time.monotonic() + 5
        while client.get("/load").json()["server_load"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.get("/load").json()["server_load"] == 0
        assert time.monotonic() - start < 2.5  # before the slow tokenizations end
        time.sleep(3.5)  # both threads free again: the third request's job was skipped, not run
        assert engine.started == [["slow"], ["slow"]]
        text = client.get("/metrics").text
        assert 'te_request_failure{err="dropped"} 3.0' in text, text
        assert client.post("/v1/embeddings", json=OK).status_code == 200


def test_a_large_request_is_tokenized_in_parts(minilm_llm):
    """Two large requests held both tokenizer threads until they were done, every other client's inputs waiting
    behind them (a one-token request waited for both). Many text inputs are tokenized in parts of 256, each a job of
    the pool: a small request runs between them. Results and error positions are the request's."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    engine = _SlowTokenizer(minilm_llm.engine, 0.4, only_slow=False)
    texts = [f"passage {i} on wing flutter" for i in range(1024)]
    with in_process_server(engine, warmup=False) as url, ThreadPoolExecutor(3) as pool:
        big = [pool.submit(httpx.post, f"{url}/v1/embeddings", json={"input": texts}, timeout=60) for _ in range(2)]
        time.sleep(0.2)  # both large requests' first parts are in the two tokenizer threads
        start = time.monotonic()
        small = httpx.post(f"{url}/v1/embeddings", json={"input": "one"}, timeout=60)
        waited = time.monotonic() - start
        bodies = [f.result() for f in big]
        assert small.status_code == 200 and all(b.status_code == 200 for b in bodies)
        assert waited < 1.5, waited  # one part's wait, not the large requests' 2 x 4 parts
        assert sorted(map(len, engine.started)) == [1] + [256] * 8
        got = torch.tensor([d["embedding"] for d in bodies[0].json()["data"]])
        want = torch.stack([o.outputs.data for o in minilm_llm.embed(texts, use_tqdm=False)])
        assert torch.allclose(got, want, atol=1e-5)  # in order
        bad = [*texts[:700], [999999], *texts[701:]]
        r = httpx.post(f"{url}/v1/embeddings", json={"input": bad}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["message"].startswith("'input' item 700"), r.text


def test_a_stopped_server_lets_its_model_go(minilm_path):
    """A server started and stopped in a process (a notebook, Ray Serve, these tests) gives its model back: the
    lifespan froze the collector's view of everything alive at start and never thawed it, so each cycle kept a
    model."""
    import weakref

    from polyvec import LLM

    models = []
    for _ in range(2):
        engine = LLM(str(minilm_path), dtype="float32").engine
        models.append(weakref.ref(engine.runner.model))
        with in_process_server(engine) as url:
            assert httpx.post(url + "/v1/embeddings", json={"input": "wing"}, timeout=60).status_code == 200
        del engine
        gc.collect()
    assert [m() for m in models] == [None, None]
