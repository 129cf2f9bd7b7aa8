"""Real `polyvec serve` processes on free loopback ports, with the real MiniLM weights (and an in-process server
for engines a test rigs)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import uvicorn

from tests.conftest import MINILM, REPO


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, *args: str, env: dict[str, str] | None = None):
        if "--dtype" not in args:  # compared against float32 offline results
            args = (*args, "--dtype", "float32")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = Path(os.environ.get("TMPDIR", "/tmp")) / f"polyvec-serve-{self.port}.log"
        full_env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "polyvec",
                "serve",
                *args,
                "--port",
                str(self.port),
                *(() if "--log-level" in args else ("--log-level", "warning")),
            ],  # fmt: skip
            cwd=REPO,
            env=full_env,
            stdout=self.log.open("w"),
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log.read_text()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server did not become healthy:\n{self.log.read_text()}")

    def post(self, path: str, json=None, **kw) -> httpx.Response:
        return httpx.post(self.url + path, json=json, timeout=120, **kw)

    def get(self, path: str, **kw) -> httpx.Response:
        return httpx.get(self.url + path, timeout=30, **kw)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@pytest.fixture(scope="session")
def server():
    s = Server(MINILM, "--served-model-name", "minilm", MINILM)
    yield s
    s.stop()


@pytest.fixture(scope="session")
def strict_server():
    """API key from the environment, truncation=error, a small body limit; at most 10,000 tokens per request
    and 150 windows per input."""
    s = Server(
        MINILM,
        "--truncation",
        "error",
        "--max-request-bytes",
        "200000",
        "--max-tokens-per-request",
        "10000",
        "--max-windows-per-input",
        "150",
        env={"POLYVEC_API_KEY": "sekret", "POLYVEC_MAX_MODEL_LEN": "64"},
    )
    yield s
    s.stop()


@pytest.fixture(scope="session")
def tight_server():
    """A 1 MB body limit; from the environment, a 2 s body timeout and at most 2 requests in progress."""
    s = Server(
        MINILM,
        "--max-request-bytes",
        "1000000",
        env={"POLYVEC_REQUEST_BODY_TIMEOUT": "2", "POLYVEC_MAX_CONCURRENT_REQUESTS": "2"},
    )
    yield s
    s.stop()


@contextmanager
def in_process_server(engine, **config) -> Iterator[str]:
    """`build_app` over `engine` (which may be rigged) served by uvicorn in a thread; yields the base URL."""
    from polyvec.entrypoints.server.app import ServerConfig, build_app

    port = free_port()
    app = build_app(engine, ServerConfig(**config))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="test-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the in-process server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=60)
