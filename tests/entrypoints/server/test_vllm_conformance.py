"""vLLM 0.34's HTTP surface for pooling models, checked against a server started from a command line pasted
from vLLM's documentation: request ids, /ping, /invocations, the model's own task on /pooling, fp8 outputs,
per-side token caps on /score and /rerank, and vLLM's metric names."""

from __future__ import annotations

import base64
import json

import httpx
import numpy as np
import pytest
import torch

from polyvec.entrypoints.server.encoding import from_bytes
from tests.conftest import MINILM
from tests.entrypoints.server.conftest import Server
from tests.helpers import cosine_rows

TEXT = "what similarity laws must be obeyed when constructing aeroelastic models"
CHAT_TEMPLATE = (
    "{% if tools %}[tools] {{ tools | map(attribute='function') | map(attribute='name') | join(',') }}\n{% endif %}"
    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)
DOCS = ["flutter of a heated wing at supersonic speed " * 4, "laminar boundary layer"]


@pytest.fixture(scope="module")
def vllm_server():
    """`vllm serve MODEL --runner pooling ...` with `vllm` replaced by `polyvec`, nothing else changed."""
    s = Server(
        MINILM,
        *("--runner", "pooling", "--convert", "embed", "--dtype", "float", "--gpu-memory-utilization", "0.3"),
        *("--trust-remote-code", "--enforce-eager", "--served-model-name", "mini", "--max-model-len", "256"),
        *("--enable-request-id-headers", "--api-key", "k", "--disable-log-stats", "--seed", "0", "-tp", "1"),
        *("--chat-template", CHAT_TEMPLATE),
    )
    yield s
    s.stop()


AUTH = {"Authorization": "Bearer k"}


def post(server: Server, path: str, body, headers=None) -> httpx.Response:
    return server.post(path, body, headers={**AUTH, **(headers or {})})


def test_the_pasted_command_line_serves_and_warns_once(vllm_server):
    r = post(vllm_server, "/v1/embeddings", {"model": "mini", "input": TEXT})
    assert r.status_code == 200 and len(r.json()["data"][0]["embedding"]) == 384
    log = vllm_server.log.read_text()
    warnings = [line for line in log.splitlines() if "vLLM flags with no effect" in line]
    assert len(warnings) == 1 and "--gpu-memory-utilization" in warnings[0] and "--seed" in warnings[0]


def test_request_ids_come_from_x_request_id(vllm_server):
    r = post(vllm_server, "/v1/embeddings", {"input": TEXT}, {"X-Request-Id": "abc123"})
    assert r.json()["id"] == "embd-abc123" and r.headers["x-request-id"] == "abc123"
    r = post(vllm_server, "/pooling", {"input": TEXT})
    assert r.json()["id"].startswith("pooling-") and len(r.headers["x-request-id"]) == 32
    r = post(vllm_server, "/rerank", {"query": TEXT, "documents": DOCS}, {"X-Request-Id": "r1"})
    assert r.json()["id"] == "score-r1"
    r = post(vllm_server, "/classify", {"input": TEXT}, {"X-Request-Id": "e1"})
    assert r.status_code == 400 and r.headers["x-request-id"] == "e1"  # errors carry it too


def test_request_ids_from_the_body(vllm_server):
    """vLLM: the body's request_id names the response when no X-Request-Id header does."""
    for path, body, prefix in [
        ("/v1/embeddings", {"input": TEXT}, "embd"),
        ("/v1/embeddings", {"input": TEXT, "encoding_format": "base64"}, "embd"),
        ("/pooling", {"input": TEXT, "task": "token_embed"}, "pooling"),
        ("/score", {"text_1": TEXT, "text_2": DOCS}, "score"),
        ("/rerank", {"query": TEXT, "documents": DOCS}, "score"),
    ]:
        r = post(vllm_server, path, {**body, "request_id": "body-7"})
        assert r.status_code == 200 and r.json()["id"] == f"{prefix}-body-7", (path, r.text)
        r = post(vllm_server, path, {**body, "request_id": "body-7"}, {"X-Request-Id": "head-1"})
        assert r.json()["id"] == f"{prefix}-head-1", path  # the header first, as in vLLM
    r = post(vllm_server, "/v1/embeddings", {"input": TEXT, "request_id": "b", "encoding_format": "bytes"})
    assert json.loads(r.headers["metadata"])["id"] == "embd-b"


def test_ping_answers_like_health_without_the_key(vllm_server):
    for method in ("GET", "POST"):
        r = httpx.request(method, vllm_server.url + "/ping")
        assert r.status_code == 200 and r.content == b""


def test_pooling_without_task_is_the_models_own(vllm_server):
    default = post(vllm_server, "/pooling", {"input": TEXT}).json()["data"][0]
    embed = post(vllm_server, "/pooling", {"input": TEXT, "task": "embed"}).json()["data"][0]
    assert default["shape"] == [384] and default["data"] == embed["data"]


def test_invocations_routes_by_the_body(vllm_server):
    emb = post(vllm_server, "/invocations", {"input": TEXT}).json()
    assert set(emb) == set(post(vllm_server, "/v1/embeddings", {"input": TEXT}).json())
    assert emb["data"][0]["object"] == "embedding"
    ranked = post(vllm_server, "/invocations", {"query": TEXT, "documents": DOCS}).json()
    assert [r["index"] for r in ranked["results"]] == [0, 1]
    scored = post(vllm_server, "/invocations", {"text_1": TEXT, "text_2": DOCS}).json()
    assert [d["object"] for d in scored["data"]] == ["score", "score"]
    tokens = post(vllm_server, "/invocations", {"input": TEXT, "task": "token_embed"}).json()
    assert tokens["data"][0]["object"] == "pooling" and tokens["data"][0]["shape"][1] == 384
    bad = post(vllm_server, "/invocations", {"text": TEXT})
    assert bad.status_code == 400 and "Cannot find suitable handler for request" in bad.json()["error"]["message"]
    tei = post(vllm_server, "/invocations", {"inputs": TEXT})  # TEI's body: TEI's model route (POST /)
    assert tei.status_code == 200 and tei.json() == post(vllm_server, "/embed", {"inputs": TEXT}).json()
    broken = httpx.post(vllm_server.url + "/invocations", content=b"{", headers=AUTH)
    assert broken.status_code == 400


def test_invocations_take_the_sagemaker_adapter_header_as_the_model(vllm_server):
    """vLLM's /invocations puts X-Amzn-SageMaker-Adapter-Identifier in the body's `model`: a served name answers,
    another is a 404 naming the header (it was ignored: the base model answered for any adapter)."""
    header = "X-Amzn-SageMaker-Adapter-Identifier"
    named = post(vllm_server, "/invocations", {"input": TEXT, "model": "other"}, {header: "mini"})
    assert named.status_code == 200 and named.json()["model"] == "mini"
    missing = post(vllm_server, "/invocations", {"input": TEXT}, {header: "my-lora"})
    assert missing.status_code == 404, missing.text
    assert missing.json()["error"] == {
        "message": "the adapter 'my-lora' is not served; served: mini",
        "type": "NotFoundError",
        "param": header,
        "code": 404,
    }


@pytest.mark.parametrize("dtype", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("endianness", ["native", "big"])
def test_fp8_embed_dtype(vllm_server, minilm_llm, dtype, endianness):
    body = {"input": TEXT, "encoding_format": "base64", "embed_dtype": dtype, "endianness": endianness}
    data = base64.b64decode(post(vllm_server, "/v1/embeddings", body).json()["data"][0]["embedding"])
    assert len(data) == 384  # one byte per value
    got = from_bytes(data, [384], dtype, endianness)
    want = minilm_llm.embed(TEXT, use_tqdm=False)[0].outputs.data
    fp8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[dtype]
    assert torch.equal(got, want.to(fp8).float())
    assert cosine_rows(got[None], want[None]).item() >= 0.99


def first_tokens(llm, text: str, most: int) -> dict:
    """vLLM's max_tokens_per_query / _per_doc: the text's first `most` content tokens, then the special tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(llm.model_config.path)
    ids = tok.encode(text, add_special_tokens=False)[:most]
    return {"prompt_token_ids": [tok.cls_token_id, *ids, tok.sep_token_id]}


def test_per_side_token_caps_on_score_and_rerank(vllm_server, minilm_llm):
    """The caps count content tokens, as vLLM 0.34 cuts each text (`truncate_text_to_tokens`) before the model's
    special tokens are added: a cap of 3 kept one word piece ([CLS] and [SEP] counted)."""
    body = {"text_1": TEXT, "text_2": DOCS, "max_tokens_per_query": 6, "max_tokens_per_doc": 8}
    got = [d["score"] for d in post(vllm_server, "/score", body).json()["data"]]
    q = minilm_llm.embed(first_tokens(minilm_llm, TEXT, 6), use_tqdm=False)[0].outputs.data
    docs = minilm_llm.embed([first_tokens(minilm_llm, d, 8) for d in DOCS], use_tqdm=False)
    d = torch.stack([o.outputs.data for o in docs])
    assert np.allclose(got, torch.nn.functional.cosine_similarity(q[None], d).tolist(), atol=1e-5)
    usage = post(vllm_server, "/score", body).json()["usage"]["prompt_tokens"]
    assert usage == 8 + sum(len(o.prompt_token_ids) for o in docs) == 8 + 10 + 7  # the short document has 7
    ranked = post(vllm_server, "/rerank", {"query": TEXT, "documents": DOCS, "max_tokens_per_doc": 8}).json()
    assert ranked["usage"]["prompt_tokens"] == len(minilm_llm.embed(TEXT, use_tqdm=False)[0].prompt_token_ids) + 17
    for field in ("max_tokens_per_query", "max_tokens_per_doc"):  # vLLM: less than max_model_len
        r = post(vllm_server, "/score", {"text_1": TEXT, "text_2": DOCS, field: 256})
        assert r.status_code == 400 and r.json()["error"]["param"] == field
        assert r.json()["error"]["message"] == f"{field} (256) must be less than max_model_len (256)."
    r = post(vllm_server, "/rerank", {"query": TEXT, "documents": DOCS, "instruction": "find flutter"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "instruction"
    r = post(vllm_server, "/score", {"text_1": TEXT, "text_2": DOCS, "max_tokens_per_doc": -1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens_per_doc"


def test_padding_and_truncation_side(vllm_server, minilm_llm):
    """vLLM's test_padding: "max_length" fills the input with the pad token up to the maximum length, the pads
    attended (it was accepted and ignored); usage counts them; "do_not_pad" is the default."""
    ids = minilm_llm.embed(TEXT, use_tqdm=False)[0].prompt_token_ids
    plain = post(vllm_server, "/v1/embeddings", {"input": TEXT}).json()
    padded = post(vllm_server, "/v1/embeddings", {"input": TEXT, "padding": "max_length"}).json()
    assert plain["usage"]["prompt_tokens"] == len(ids) and padded["usage"]["prompt_tokens"] == 256
    want = minilm_llm.embed([ids + [0] * (256 - len(ids))], use_tqdm=False)[0].outputs.data
    assert torch.allclose(torch.tensor(padded["data"][0]["embedding"]), want, atol=1e-5)
    assert not torch.allclose(want, torch.tensor(plain["data"][0]["embedding"]), atol=1e-3)
    # truncated first, then padded up to max_model_len as vLLM pads (it stopped at the truncation length)
    cut = post(vllm_server, "/pooling", {"input": "wing " * 300, "padding": "max_length", "truncate_prompt_tokens": 40})
    assert cut.json()["usage"]["prompt_tokens"] == 256
    head = minilm_llm.embed("wing " * 300, truncate_prompt_tokens=40, use_tqdm=False)[0].prompt_token_ids
    want = minilm_llm.embed([head + [0] * (256 - 40)], use_tqdm=False)[0].outputs.data
    assert torch.allclose(torch.tensor(cut.json()["data"][0]["data"]), want, atol=1e-5)
    # an input that fits is padded in window mode too (it was left as it was)
    windowed = post(vllm_server, "/v1/embeddings", {"input": TEXT, "padding": "max_length", "long_input": "window"})
    assert windowed.json()["usage"]["prompt_tokens"] == 256
    unpadded = post(vllm_server, "/v1/embeddings", {"input": TEXT, "padding": "do_not_pad"}).json()
    assert unpadded["data"][0]["embedding"] == plain["data"][0]["embedding"]
    body = {"input": TEXT, "truncate_prompt_tokens": 5, "truncation_side": "left", "task": "token_embed"}
    left = post(vllm_server, "/pooling", body).json()["data"][0]
    # [CLS] and the last four tokens of the text ([SEP] included), as transformers' truncation_side="left"
    kept = [ids[0], *ids[-4:]]
    want = minilm_llm.token_embed([kept], use_tqdm=False)[0].outputs.data
    assert left["shape"] == [5, 384]
    assert cosine_rows(torch.tensor(left["data"]), want).min() >= 0.9999
    right = post(vllm_server, "/pooling", {**body, "truncation_side": "right"}).json()["data"][0]
    assert right["data"] != left["data"]
    bad = post(vllm_server, "/v1/embeddings", {"input": TEXT, "truncation_side": "middle"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "truncation_side"


def test_vllm_metric_names(vllm_server):
    post(vllm_server, "/v1/embeddings", {"input": [TEXT, "x"]})
    text = httpx.get(vllm_server.url + "/metrics", headers=AUTH).text
    for name in (
        'vllm:num_requests_waiting{engine="0",model_name="mini"}',
        'vllm:num_requests_running{engine="0",model_name="mini"}',
        'vllm:prompt_tokens_total{engine="0",model_name="mini"}',
        'vllm:request_success_total{engine="0",finished_reason="stop",model_name="mini"}',
        "vllm:e2e_request_latency_seconds_bucket",
        "vllm:request_prompt_tokens_bucket",
        "vllm:iteration_tokens_total_bucket",
    ):
        assert name in text, name
    success = next(line for line in text.splitlines() if line.startswith("vllm:request_success_total"))
    assert float(success.rsplit(" ", 1)[1]) >= 2


def test_chat_fields_as_vllm_merges_them(vllm_server, minilm_llm):
    """The request's own fields win over chat_template_kwargs of the same name (a 400 before); media_io_kwargs
    is one of vLLM's chat fields (an unknown field before)."""
    messages = [{"role": "user", "content": TEXT}]
    want = post(vllm_server, "/v1/embeddings", {"messages": messages}).json()["data"][0]["embedding"]
    for extra in ({"chat_template_kwargs": {"add_generation_prompt": True}}, {"media_io_kwargs": {"image": {}}}):
        r = post(vllm_server, "/v1/embeddings", {"messages": messages, **extra})
        assert r.status_code == 200 and r.json()["data"][0]["embedding"] == want, r.text


def test_chat_style_embeddings(vllm_server, minilm_llm):
    from polyvec.chat import render

    messages = [
        {"role": "system", "content": "aerodynamics"},
        {"role": "user", "content": [{"type": "text", "text": TEXT}]},
    ]
    r = post(vllm_server, "/v1/embeddings", {"messages": messages, "add_generation_prompt": True})
    assert r.status_code == 200, r.text
    text = render(CHAT_TEMPLATE, messages, add_generation_prompt=True)
    want = minilm_llm.embed(text, tokenization_kwargs={"add_special_tokens": False}, use_tqdm=False)[0]
    got = torch.tensor(r.json()["data"][0]["embedding"])
    assert r.json()["usage"]["prompt_tokens"] == len(want.prompt_token_ids)
    assert cosine_rows(got[None], want.outputs.data[None]).item() >= 0.9999
    with_special = post(vllm_server, "/pooling", {"messages": messages, "add_special_tokens": True}).json()
    assert with_special["usage"]["prompt_tokens"] == len(
        minilm_llm.embed(render(CHAT_TEMPLATE, messages), use_tqdm=False)[0].prompt_token_ids
    )
    for body, status, words, param in [
        ({"messages": messages, "add_generation_prompt": True, "continue_final_message": True}, 400,
         "Cannot set both `continue_final_message` and `add_generation_prompt` to True.", "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]}, 400,
         "messages item 0 content part 0 is an image", "messages"),
        ({"messages": messages, "chat_template": "{{ 1 }}"}, 400, "--trust-request-chat-template", "chat_template"),
        ({"messages": messages, "input": "x"}, 400, "either 'input' or 'messages'", "messages"),
        ({"messages": []}, 400, "messages", "messages"),
        ({}, 400, "field 'input' is required", "input"),
    ]:  # fmt: skip
        r = post(vllm_server, "/v1/embeddings", body)
        assert r.status_code == status and words in r.json()["error"]["message"], (body, r.text)
        assert r.json()["error"]["param"] == param, (body, r.text)


def test_batched_conversations(vllm_server):
    """vLLM 0.34 takes a list of conversations in `messages`, and one or several conversations in `input`: one
    output per conversation, each what the conversation alone gives."""
    a = [{"role": "user", "content": TEXT}]
    b = [{"role": "system", "content": "aerodynamics"}, {"role": "user", "content": "laminar flow"}]
    alone = [post(vllm_server, "/v1/embeddings", {"messages": m}).json()["data"][0]["embedding"] for m in (a, b)]
    for body in ({"messages": [a, b]}, {"input": [a, b]}):
        r = post(vllm_server, "/v1/embeddings", body)
        assert r.status_code == 200, (body, r.text)
        assert [d["embedding"] for d in r.json()["data"]] == alone
    r = post(vllm_server, "/v1/embeddings", {"input": b})
    assert r.status_code == 200 and r.json()["data"][0]["embedding"] == alone[1]
    for body, words in [
        ({"messages": [a, []]}, "'messages' item 1"),
        ({"messages": [a, [{"role": "user", "content": 5}]]}, "'messages' item 1 item 0.content"),
        ({"messages": [a, [{"content": "x"}]]}, "'messages' item 1 item 0.role"),
        ({"messages": [a, [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]]},
         "'messages' conversation 1: messages item 0 content part 0 is an image"),
        ({"messages": [{"role": "user", "content": "x"}, [{"role": "user", "content": "y"}]]}, "'messages' item 1"),
    ]:  # fmt: skip
        r = post(vllm_server, "/v1/embeddings", body)
        assert r.status_code == 400 and words in r.json()["error"]["message"], (body, r.text)
        assert r.json()["error"]["param"] == "messages", (body, r.text)


def test_chat_without_a_template_is_a_clear_400(server):
    r = server.post("/v1/embeddings", {"messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 400 and "has no chat template; start the server with --chat-template" in r.text


def test_tokenize_a_conversation(vllm_server, minilm_llm):
    from polyvec.chat import render

    messages = [{"role": "user", "content": TEXT}]
    body = post(vllm_server, "/tokenize", {"messages": messages}).json()
    text = render(CHAT_TEMPLATE, messages, add_generation_prompt=True)  # vLLM's default for /tokenize
    want = minilm_llm.embed(text, tokenization_kwargs={"add_special_tokens": False}, use_tqdm=False)[0]
    assert body["tokens"] == want.prompt_token_ids and body["count"] == len(want.prompt_token_ids)
    # the rest of vLLM 0.34's TokenizeChatRequest: tools reach the template, as in vLLM; the others change nothing
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
    extra = {"tools": tools, "response_format": None, "media_io_kwargs": {}, "mm_processor_kwargs": None}
    got = post(vllm_server, "/tokenize", {"messages": messages, "return_token_strs": None, **extra})
    text = render(CHAT_TEMPLATE, messages, add_generation_prompt=True, tools=tools)
    assert text.startswith("[tools] lookup\n")
    want = minilm_llm.embed(text, tokenization_kwargs={"add_special_tokens": False}, use_tqdm=False)[0]
    assert got.status_code == 200 and got.json()["tokens"] == want.prompt_token_ids, got.text
    assert got.json()["token_strs"] is None
    r = post(vllm_server, "/tokenize", {"messages": messages, "prompt": "x"})
    assert r.status_code == 400 and "either 'prompt' or 'messages'" in r.json()["error"]["message"]


@pytest.fixture(scope="module")
def token_server():
    """`--pooler-config.task token_embed`: vLLM 0.34 serves its token-embed route on /v1/embeddings then."""
    s = Server(MINILM, "--pooler-config.task", "token_embed")
    yield s
    s.stop()


LATE_TEXTS = ["passage: Berlin has museums. They display art.", "passage: 中文 😀 e\u0301", "   "]


def test_token_embed_server_answers_token_matrices(token_server):
    """vLLM's test_embeddings_without_chunking_match_pooling: /v1/embeddings gives /pooling's token matrices."""
    body = {"input": [TEXT, "Short."], "use_activation": False}
    want = token_server.post("/pooling", {**body, "task": "token_embed"}).json()
    got = token_server.post("/v1/embeddings", body).json()
    assert got["usage"] == want["usage"] and "late_chunking" not in got["data"][0]
    for a, b in zip(got["data"], want["data"]):
        assert a["embedding"] == b["data"]


@pytest.mark.parametrize("chunk_size,normalize", [(1, False), (5, True), (2**63 - 1, False)])
def test_late_chunking_over_http(token_server, minilm_path, chunk_size, normalize):
    """vLLM 0.34's test_late_chunking_vectors_and_source_ranges: chunk vectors are the means of the raw
    token vectors (then normalized), with each chunk's token range and characters; usage as /pooling's."""
    from tokenizers import Tokenizer

    raw = token_server.post("/pooling", {"input": LATE_TEXTS, "task": "token_embed", "use_activation": False}).json()
    body = {"input": LATE_TEXTS, "use_activation": normalize, "late_chunking_params": {"chunk_size": chunk_size}}
    r = token_server.post("/v1/embeddings", body)
    assert r.status_code == 200, r.text
    result = r.json()
    assert result["usage"] == raw["usage"]
    tokenizer = Tokenizer.from_file(str(minilm_path / "tokenizer.json"))
    tokenizer.no_padding()  # the file pads to 128, as sentence-transformers saved it
    for text, tokens, item in zip(LATE_TEXTS, raw["data"], result["data"]):
        want = torch.stack([part.mean(0) for part in torch.tensor(tokens["data"]).split(chunk_size)])
        want = torch.nn.functional.normalize(want, dim=-1) if normalize else want
        assert torch.allclose(torch.tensor(item["embedding"]), want, atol=1e-5)
        meta, enc = item["late_chunking"], tokenizer.encode(text)
        assert meta["strategy"] == "fixed_tokens" and meta["chunk_size"] == chunk_size
        assert meta["input_tokens"] == len(enc.ids) == len(tokens["data"])
        for k, chunk in enumerate(meta["chunks"]):
            start, end = k * chunk_size, min((k + 1) * chunk_size, len(enc.ids))
            spans = [(a, b) for a, b in enc.offsets[start:end] if a < b]
            assert chunk["token_range"] == [start, end]
            assert chunk["char_range"] == ([min(a for a, _ in spans), max(b for _, b in spans)] if spans else None)


def test_late_chunking_refusals(token_server):
    late = {"late_chunking_params": {"chunk_size": 4}}
    for body, status, words, param in [
        ({"input": "", **late}, 400, "nonempty plain-text", "input"),
        ({"input": [101, 102], **late}, 400, "plain-text input", "input"),
        ({"input": "x", "dimensions": 8, **late}, 400, "dimensions=8 is not allowed", "dimensions"),
        ({"input": "x", "truncate_prompt_tokens": 2, **late}, 400, "does not support", "truncate_prompt_tokens"),
        ({"input": "wing " * 300, **late}, 400, "302 tokens, more than max_model_len=256", "input"),
        ({"input": "x", "late_chunking_params": {"chunk_size": 0}}, 400, "chunk_size", "late_chunking_params"),
        ({"input": "x", "late_chunking_params": {"chunk_size": "4"}}, 400, "chunk_size", "late_chunking_params"),
    ]:
        r = token_server.post("/v1/embeddings", body)
        error = r.json()["error"]
        assert r.status_code == status and words in error["message"] and param in (error["param"] or ""), (body, r.text)
    # /pooling has no late chunking (vLLM's ignores the field): refused, not token vectors unchunked (nor a 500)
    r = token_server.post("/pooling", {"input": "x", "task": "token_embed", **late})
    assert r.status_code == 400 and r.json()["error"]["param"] == "late_chunking_params" and "/v1/embeddings" in r.text


def test_chat_template_content_format_reaches_the_template(minilm_llm):
    """A server started with --chat-template-content-format openai hands its template the parts list, which a
    template that prints the content writes as such (the flag was accepted and ignored: the joined text)."""
    from tests.entrypoints.server.conftest import in_process_server

    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}]}], "add_special_tokens": False}
    seen = {}
    for option in ("auto", "openai"):
        with in_process_server(minilm_llm.engine, chat_template=template, chat_template_content_format=option) as url:
            r = httpx.post(url + "/tokenize", json={**body, "return_token_strs": True}, timeout=30)
            assert r.status_code == 200, r.text
            seen[option] = r.json()["token_strs"]
    assert seen["auto"] == ["hello"]
    assert seen["openai"][:5] == ["[", "{", "'", "type", "'"] and "hello" in seen["openai"]
