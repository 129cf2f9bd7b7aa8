"""Images over HTTP for an image model (ColQwen2): base64 data: URLs in `input`, `messages` image_url parts,
Cohere `images` and `inputs`, and as documents of /score and /rerank; against the offline results."""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import pytest
import torch

pytest.importorskip("PIL", reason="Pillow is the vision extra")
from PIL import Image  # noqa: E402

from polyvec import LLM, PoolingParams  # noqa: E402
from tests.entrypoints.server.conftest import Server  # noqa: E402
from tests.helpers import save_colpali, save_colqwen2, serve_folder  # noqa: E402


def _url(image: Image.Image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def served(tmp_path_factory, minilm_path):
    folder = tmp_path_factory.mktemp("colqwen2")
    save_colqwen2(folder, minilm_path)
    rng = np.random.default_rng(3)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in ((120, 90), (60, 150))]
    llm = LLM(str(folder), dtype="float32")
    # two test images (19,800 decoded pixels) fit the request budget, three do not
    s = Server(str(folder), "--dtype", "float32", "--allowed-media-domains", "127.0.0.1", "--max-request-image-pixels",
               "25000")  # fmt: skip
    yield s, llm, images
    s.stop()


def _close(got, want: torch.Tensor) -> None:
    got = torch.tensor(got)
    assert got.shape == want.shape and (got - want).abs().max() < 1e-5


def test_pooling_and_embeddings_take_data_urls(served):
    s, llm, images = served
    want = [o.outputs.data for o in llm.token_embed(images, use_tqdm=False)]
    body = s.post("/pooling", {"input": [_url(im) for im in images], "task": "token_embed"}).json()
    for item, w in zip(body["data"], want):
        _close(item["data"], w)
    emb = s.post("/v1/embeddings", {"input": _url(images[0])}).json()["data"][0]
    _close(emb["embedding"], want[0])
    assert emb["input_type"] == "document"
    chat = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _url(images[1])}}]}]}
    _close(s.post("/v1/embeddings", chat).json()["data"][0]["embedding"], want[1])
    # Infinity's modality "image": the input strings are images (its clients send data: or http(s) URLs)
    infinity = s.post("/embeddings", {"input": [_url(im) for im in images], "modality": "image", "dimensions": 0})
    for item, w in zip(infinity.json()["data"], want):
        _close(item["embedding"], w)
    not_image = s.post("/embeddings", {"input": ["a page"], "modality": "image"})
    assert not_image.status_code == 400 and "'input' item 0: images must be base64 data: URLs" in not_image.text
    q = llm.token_embed("what is flutter?", PoolingParams(input_type="query"), use_tqdm=False)[0].outputs.data
    body = s.post("/v1/embeddings", {"input": "what is flutter?", "input_type": "query"}).json()["data"][0]
    _close(body["embedding"], q)


def test_cohere_images_and_inputs(served):
    s, llm, images = served
    want = [o.outputs.data for o in llm.token_embed(images, use_tqdm=False)]
    body = s.post("/v2/embed", {"images": [_url(im) for im in images], "input_type": "image"}).json()
    for e, w in zip(body["embeddings"]["float"], want):
        _close(e, w)
    inputs = [{"content": [{"type": "image_url", "image_url": {"url": _url(images[1])}}]}]
    body = s.post("/v2/embed", {"inputs": inputs, "input_type": "search_document"}).json()
    _close(body["embeddings"]["float"][0], want[1])
    # vLLM's billing: a request with images bills its tokens as image_tokens, one of text as input_tokens
    tokens = sum(len(o.prompt_token_ids) for o in llm.token_embed(images, use_tqdm=False))
    with_text = [*inputs, {"content": [{"type": "text", "text": "flutter"}]}]
    billed = s.post("/v2/embed", {"inputs": with_text, "input_type": "search_document"}).json()["meta"]["billed_units"]
    assert billed["input_tokens"] == 0 and billed["image_tokens"] > 0
    billed = s.post("/v2/embed", {"images": [_url(im) for im in images]}).json()["meta"]["billed_units"]
    assert billed == {"input_tokens": 0, "image_tokens": tokens}
    text = s.post("/v2/embed", {"texts": ["flutter"], "input_type": "search_query"}).json()["meta"]["billed_units"]
    assert text["input_tokens"] > 0 and text["image_tokens"] == 0


def test_score_and_rerank_text_against_images(served):
    s, llm, images = served
    want = [o.outputs.score for o in llm.score("what is flutter?", images, use_tqdm=False)]
    body = s.post("/score", {"text_1": "what is flutter?", "text_2": [_url(im) for im in images]}).json()
    assert [d["score"] for d in body["data"]] == pytest.approx(want, rel=1e-5)
    ranked = s.post("/rerank", {"query": "what is flutter?", "documents": [_url(im) for im in images]}).json()
    by_index = {r["index"]: r["relevance_score"] for r in ranked["results"]}
    assert [by_index[i] for i in range(2)] == pytest.approx(want, rel=1e-5)


def test_score_items_in_vllms_content_form(served):
    """vLLM 0.34's documented bodies for visual scoring: items `{"content": [part]}` on either side."""
    s, llm, images = served
    want = [o.outputs.score for o in llm.score("what is flutter?", images, use_tqdm=False)]

    def page(im):
        return {"content": [{"type": "image_url", "image_url": {"url": _url(im)}}]}

    query = {"content": [{"type": "text", "text": "what is flutter?"}]}
    for body in ({"data_1": query, "data_2": [page(im) for im in images]},
                 {"queries": "what is flutter?", "documents": [page(images[0]), _url(images[1])]}):  # fmt: skip
        r = s.post("/score", body)
        assert r.status_code == 200, r.text
        assert [d["score"] for d in r.json()["data"]] == pytest.approx(want, rel=1e-5)
    pages = [page(images[0]), _url(images[1])]
    ranked = s.post("/rerank", {"query": query, "documents": pages}).json()
    by_index = {r["index"]: r["relevance_score"] for r in ranked["results"]}
    assert [by_index[i] for i in range(2)] == pytest.approx(want, rel=1e-5)
    # each document comes back as vLLM returns it: a content item's parts as multi_modal, a string as text
    documents = {r["index"]: r["document"] for r in ranked["results"]}
    assert documents == {0: {"multi_modal": pages[0]["content"]}, 1: {"text": pages[1]}}
    remote = {"content": [{"type": "image_url", "image_url": {"url": "http://example.com/p.png"}}]}
    for path, body, param in [
        ("/score", {"text_1": "q", "text_2": [_url(images[0]), _MIXED]}, "text_2"),
        ("/rerank", {"query": "q", "documents": [remote]}, "documents"),
    ]:
        r = s.post(path, body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert "takes one part, text or an image_url with a base64 data: URL" in r.json()["error"]["message"]


_MIXED = {
    "content": [{"type": "text", "text": "x"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,"}}]
}
BAD = [
    ("/pooling", {"input": ["ok", "data:image/png;base64,aGVsbG8="], "task": "token_embed"}, "input",
     "'input' item 1: image 0: not a readable image"),
    ("/v2/embed", {"images": ["http://example.com/a.png"]}, "images",
     "image 0: remote image URLs are fetched only from --allowed-media-domains (allowed: 127.0.0.1); 'example.com'"),
    ("/v2/embed", {"images": ["ftp://127.0.0.1/a.png"]}, "images", "'images' item 0: images must be base64 data: URLs"),
    ("/v2/embed", {"inputs": [_MIXED]}, "inputs", "an image is encoded alone"),
    ("/v1/embeddings", {"messages": [{"role": "user", "content": "hello"}]}, "messages", "images alone in messages"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "param", "message"), BAD)
def test_bad_images_are_400_naming_the_item(served, path, body, param, message):
    s, llm, images = served
    r = s.post(path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and message in err["message"]
    assert s.post("/pooling", {"input": _url(images[0]), "task": "token_embed"}).status_code == 200


def _image_messages(url: str) -> dict:
    return {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]}


def test_image_options_are_honoured_or_refused_never_ignored(served):
    """Every option on an image either applies or is a 400 naming it: errors in messages name the message part;
    chat-template options, a request's processor settings and truncation below an image's tokens are refused."""
    s, llm, images = served
    doc = _url(images[0])
    cases = [
        ("/v1/embeddings", _image_messages("data:image/png;base64,aGVsbG8="), "messages",
         "messages item 0 content part 0: image 0: not a readable image"),
        ("/v1/embeddings", {**_image_messages(doc), "chat_template": "{{ messages }}"}, "chat_template",
         "chat_template: this model encodes an image with its own prompt, not a chat template"),
        ("/pooling", {**_image_messages(doc), "add_generation_prompt": True}, "add_generation_prompt",
         "add_generation_prompt: this model encodes an image"),
        ("/v1/embeddings", {"input": doc, "mm_processor_kwargs": {"max_pixels": 3136}}, "mm_processor_kwargs",
         "the server's --mm-processor-kwargs apply"),
        ("/score", {"text_1": "q", "text_2": [doc], "mm_processor_kwargs": {"max_pixels": 3136}},
         "mm_processor_kwargs", "a request cannot change the image processor's settings"),
        ("/v1/embeddings", {"input": ["fine", doc], "truncate_prompt_tokens": 5}, "input",
         "'input' item 1 has 23 tokens with its images, more than the truncation limit of 5"),
        ("/v2/embed", {"images": [doc], "input_type": "image", "max_tokens": 5, "truncate": "END"}, "images",
         "'images' item 0 has 23 tokens with its images, more than the truncation limit of 5"),
    ]  # fmt: skip
    for path, body, param, message in cases:
        r = s.post(path, body)
        assert r.status_code == 400, (path, r.text)
        err = r.json()["error"]
        assert err["param"] == param and message in err["message"], (path, err)
    assert s.post("/pooling", {"input": doc, "task": "token_embed"}).status_code == 200
    # max_tokens_per_doc cuts texts, as vLLM's: an image document is scored whole
    capped = s.post("/score", {"text_1": "q", "text_2": [doc], "max_tokens_per_doc": 5}).json()["data"]
    assert capped == s.post("/score", {"text_1": "q", "text_2": [doc]}).json()["data"]
    # Cohere inputs mixing a text query and an image document: the kind of each item, not of the first alone
    inputs = [{"content": [{"type": "text", "text": "flutter"}]}, {"content": [{"type": "image_url", "image_url":
              {"url": doc}}]}]  # fmt: skip
    body = s.post("/v2/embed", {"inputs": inputs, "input_type": "search_query"}).json()
    assert body["input_types"] == ["query", "document"] and "input_type" not in body


def test_a_slow_image_host_holds_no_one_else(served, tmp_path):
    """Two requests whose image host trickles bytes (10 s) leave the server's tokenizer threads free: a text
    request meanwhile is answered at once; the slow ones end as a 400 of their own."""
    import concurrent.futures
    import time

    s, llm, images = served
    with serve_folder(tmp_path) as base, concurrent.futures.ThreadPoolExecutor(2) as pool:
        slow = [pool.submit(s.post, "/v2/embed", {"images": [f"{base}/slow"], "input_type": "image"}) for _ in "ab"]
        time.sleep(1.0)  # both are downloading
        t0 = time.monotonic()
        assert httpx.post(s.url + "/v1/embeddings", json={"input": "a plain text query"}, timeout=5).status_code == 200
        assert time.monotonic() - t0 < 5 and not any(f.done() for f in slow)
        for f in slow:
            r = f.result()
            assert r.status_code == 400 and r.json()["error"]["param"] == "images"


def test_text_models_refuse_images_in_every_form(server):
    """A data:image URL is an image, never base64 text to embed; an image part in messages is named as one."""
    png = "data:image/png;base64,aGVsbG8="
    for path, body, message in [
        (
            "/v1/embeddings",
            {"input": ["text", png]},
            "'input' item 1 is an image (a data:image URL); this model reads text",
        ),
        ("/rerank", {"query": "q", "documents": ["x", png]}, "'documents' item 1 is an image"),
        ("/v1/embeddings", _image_messages(png), "messages item 0 content part 0 is an image; this model reads text"),
    ]:
        r = server.post(path, body)
        assert r.status_code == 400, r.text
        assert message in r.json()["error"]["message"]


def test_text_models_still_refuse_images(server):
    r = server.post("/v2/embed", {"images": ["data:image/png;base64,aGVsbG8="]})
    assert r.status_code == 400 and "images are not supported" in r.json()["error"]["message"]


def test_remote_images_from_an_allowed_host(served, tmp_path):
    s, llm, images = served
    want = [o.outputs.data for o in llm.token_embed(images, use_tqdm=False)]
    for k, image in enumerate(images):
        image.save(tmp_path / f"page{k}.png")
    with serve_folder(tmp_path) as base:
        body = s.post("/v2/embed", {"images": [f"{base}/page{k}.png" for k in range(2)], "input_type": "image"})
        for e, w in zip(body.json()["embeddings"]["float"], want):
            _close(e, w)
        part = {"type": "image_url", "image_url": {"url": f"{base}/page1.png"}}
        chat = s.post("/v1/embeddings", {"messages": [{"role": "user", "content": [part]}]}).json()
        _close(chat["data"][0]["embedding"], want[1])
        # the scheme in any case, as offline and in vLLM (a 400 before)
        upper = {"type": "image_url", "image_url": {"url": "HTTP" + f"{base}/page1.png"[4:]}}
        chat = s.post("/v1/embeddings", {"messages": [{"role": "user", "content": [upper]}]})
        assert chat.status_code == 200, chat.text
        _close(chat.json()["data"][0]["embedding"], want[1])
        r = s.post("/v2/embed", {"images": [f"{base}/page0.png", f"{base}/missing.png"], "input_type": "image"})
        assert r.status_code == 400 and "'images' item 1: image 0: fetching" in r.json()["error"]["message"]


def test_request_image_pixel_budget(served):
    s, llm, images = served
    r = s.post("/pooling", {"input": [_url(im) for im in images + images[:1]], "task": "token_embed"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "input"
    assert (
        "'input' item 2: image 0: the request's images reach 30600 pixels, more than the limit of 25000"
        in err["message"]
    )
    assert s.post("/pooling", {"input": [_url(im) for im in images], "task": "token_embed"}).status_code == 200


def test_colpali_over_http(tmp_path, minilm_path):
    save_colpali(tmp_path, minilm_path)
    rng = np.random.default_rng(5)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in ((120, 90), (60, 150))]
    llm = LLM(str(tmp_path), dtype="float32")
    s = Server(str(tmp_path), "--dtype", "float32")
    try:
        want = [o.outputs.data for o in llm.token_embed(images, use_tqdm=False)]
        body = s.post("/pooling", {"input": [_url(im) for im in images], "task": "token_embed"}).json()
        for item, w in zip(body["data"], want):
            _close(item["data"], w)
        q = llm.token_embed("flutter", PoolingParams(input_type="query"), use_tqdm=False)[0].outputs.data
        _close(s.post("/v1/embeddings", {"input": "flutter", "input_type": "query"}).json()["data"][0]["embedding"], q)
        scores = [o.outputs.score for o in llm.score("flutter", images, use_tqdm=False)]
        ranked = s.post("/rerank", {"query": "flutter", "documents": [_url(im) for im in images]}).json()
        assert sorted(r["relevance_score"] for r in ranked["results"]) == pytest.approx(sorted(scores), rel=1e-5)
    finally:
        s.stop()


def test_tokenize_image_messages_gives_the_ids_the_engine_encodes(served):
    """/tokenize of an image model's messages: the model's image prompt with the image's tokens, as encoded (it
    said the model 'reads text only'); a bad image or a chat option is a 400 naming it."""
    s, llm, images = served
    (want,) = llm.engine.process([images[1]], None, "token_embed")
    body = s.post("/tokenize", {**_image_messages(_url(images[1])), "return_token_strs": True}).json()
    assert body["tokens"] == list(want.prompt_token_ids) and body["count"] == len(want.prompt_token_ids)
    assert body["token_strs"].count("<|image_pad|>") > 1
    r = s.post("/tokenize", _image_messages("data:image/png;base64,aGVsbG8="))
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert "messages item 0 content part 0: image 0: not a readable image" in r.json()["error"]["message"]
    r = s.post("/tokenize", {**_image_messages(_url(images[0])), "chat_template_kwargs": {"a": 1}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
    text = s.post("/tokenize", {"prompt": "wing flutter"}).json()["tokens"]
    assert text == llm.get_tokenizer().encode("wing flutter")


def test_text_holding_the_image_placeholder_is_a_400(served):
    """A text or token ids with <|image_pad|> and no image: a 400 naming the item (a 500 at the model's vision
    positions before), and the server goes on."""
    s, llm, images = served
    pad = llm.get_tokenizer().convert_tokens_to_ids("<|image_pad|>")
    for path, body, param, where in [
        ("/v1/embeddings", {"input": ["fine", "what is <|image_pad|> here"], "input_type": "query"}, "input", "1"),
        ("/v1/embeddings", {"input": [[101, pad, 102]]}, "input", "0"),
        ("/rerank", {"query": "q", "documents": ["fine", "doc about <|image_pad|>"]}, "documents", "item 1"),
        ("/v2/embed", {"texts": ["<|image_pad|>"], "input_type": "search_document"}, "texts", "item 0"),
    ]:
        r = s.post(path, body)
        assert r.status_code == 400, (path, r.text)
        err = r.json()["error"]
        assert (
            err["param"] == param
            and f"{where} holds <|image_pad|>, the image placeholder, and no image" in (err["message"])
        ), err
    assert s.post("/pooling", {"input": "what is flutter?", "task": "token_embed"}).status_code == 200
    with pytest.raises(ValueError, match="prompt 0 holds <|image_pad|>"):
        llm.token_embed("<|image_pad|>", use_tqdm=False)
