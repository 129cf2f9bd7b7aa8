"""Long inputs over HTTP: encoder windows (per request, and refused with a clear 400 under truncation=error
without them), and a causal model served with a 16-token budget so prompts are prefilled in chunks while
other requests are served."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

from polyvec import LLM, PoolingParams
from tests.conftest import MINILM
from tests.entrypoints.server.conftest import Server
from tests.models.test_decoder_parity import prompts, save_decoder


@pytest.fixture(scope="module")
def long_doc(cranfield_texts) -> str:
    return " ".join(cranfield_texts[:40])  # well over 1,000 tokens


def test_embeddings_long_input_window(server, minilm_llm, long_doc):
    windowed = server.post("/v1/embeddings", json={"input": long_doc, "long_input": "window", "window_overlap": 8})
    assert windowed.status_code == 200, windowed.text
    (offline,) = minilm_llm.embed([long_doc], PoolingParams(long_input="window", window_overlap=8), use_tqdm=False)
    got = torch.tensor(windowed.json()["data"][0]["embedding"])
    assert torch.allclose(got, offline.outputs.data, atol=1e-5)
    assert windowed.json()["usage"]["prompt_tokens"] == len(offline.prompt_token_ids) > 1000
    truncated = server.post("/v1/embeddings", json={"input": long_doc})
    assert truncated.json()["usage"]["prompt_tokens"] == 256
    tokens = server.post("/pooling", json={"input": long_doc, "task": "token_embed", "long_input": "window"})
    assert tokens.status_code == 200
    assert tokens.json()["data"][0]["shape"] == [len(offline.prompt_token_ids), 384]


def test_truncation_error_names_the_limit_and_the_option(strict_server, long_doc):
    headers = {"Authorization": "Bearer sekret"}
    r = strict_server.post("/v1/embeddings", json={"input": long_doc}, headers=headers)
    assert r.status_code == 400
    assert "64 tokens" in r.text and "long_input" in r.text
    ok = strict_server.post("/v1/embeddings", json={"input": long_doc, "long_input": "window"}, headers=headers)
    assert ok.status_code == 200
    bad = strict_server.post("/v1/embeddings", json={"input": "x", "long_input": "slide"}, headers=headers)
    assert bad.status_code == 400 and "long_input" in bad.text


@pytest.fixture(scope="module")
def decoder_server(tmp_path_factory, minilm_path):
    folder = tmp_path_factory.mktemp("qwen3-serve")
    save_decoder("qwen3", "ForCausalLM", folder, minilm_path)
    s = Server(str(folder), "--max-num-batched-tokens", "16")
    yield s, folder
    s.stop()


def test_causal_model_chunked_prefill_over_http(decoder_server):
    server, folder = decoder_server
    ps = prompts(seed=7)
    offline = LLM(str(folder), dtype="float32", enable_prefix_caching=False).embed(
        [{"prompt_token_ids": p} for p in ps], use_tqdm=False
    )

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            return await asyncio.gather(*(client.post("/v1/embeddings", json={"input": p}) for p in ps))

    responses = asyncio.run(main())
    for r, o in zip(responses, offline):
        assert r.status_code == 200, r.text
        assert torch.allclose(torch.tensor(r.json()["data"][0]["embedding"]), o.outputs.data, atol=1e-5)
    # a decoder takes windows too (vLLM's chunked processing); an input within max_model_len is one window
    short = server.post("/v1/embeddings", json={"input": ps[0], "long_input": "window"})
    assert short.status_code == 200, short.text
    got = torch.tensor(short.json()["data"][0]["embedding"])
    assert torch.allclose(got, offline[0].outputs.data, atol=1e-5)
    assert server.get("/health").status_code == 200


def test_chunked_processing_from_the_pooler_config_is_logged_as_windows(long_doc):
    """vLLM's long-text example serves with --pooler-config enable_chunked_processing: the inputs were windowed
    but the start-up line said "long input truncate" (the flag's value, not the engine's)."""
    s = Server(MINILM, "--pooler-config", '{"enable_chunked_processing": true}', "--log-level", "info")
    try:
        r = s.post("/v1/embeddings", {"input": long_doc})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] > 256, r.text
        log = s.log.read_text()
        assert "long input window [pooler_config]" in log
        tasks = "tasks: embed, token_embed; embed pooling MEAN [modules.json Pooling]; embed dim 384; token dim 384"
        assert tasks in log, log
    finally:
        s.stop()
