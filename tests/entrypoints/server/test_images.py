"""Images over HTTP for an image model (ColQwen2): base64 data: URLs in `input`, `messages` image_url parts,
Cohere `images` and `inputs`, and as documents of /score and /rerank; against the offline results."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch

pytest.importorskip("PIL", reason="Pillow is the vision extra")
from PIL import Image  # noqa: E402

from polyvec import LLM, PoolingParams  # noqa: E402
from tests.entrypoints.server.conftest import Server  # noqa: E402
from tests.helpers import save_colqwen2  # noqa: E402


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
    s = Server(str(folder), "--dtype", "float32")
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


def test_score_and_rerank_text_against_images(served):
    s, llm, images = served
    want = [o.outputs.score for o in llm.score("what is flutter?", images, use_tqdm=False)]
    body = s.post("/score", {"text_1": "what is flutter?", "text_2": [_url(im) for im in images]}).json()
    assert [d["score"] for d in body["data"]] == pytest.approx(want, rel=1e-5)
    ranked = s.post("/rerank", {"query": "what is flutter?", "documents": [_url(im) for im in images]}).json()
    by_index = {r["index"]: r["relevance_score"] for r in ranked["results"]}
    assert [by_index[i] for i in range(2)] == pytest.approx(want, rel=1e-5)


_MIXED = {
    "content": [{"type": "text", "text": "x"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,"}}]
}
BAD = [
    ("/pooling", {"input": ["ok", "data:image/png;base64,aGVsbG8="], "task": "token_embed"}, "input",
     "prompt 1: image 0: not a readable image"),
    ("/v2/embed", {"images": ["http://example.com/a.png"]}, "images", "remote URLs are not fetched"),
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


def test_text_models_still_refuse_images(server):
    r = server.post("/v2/embed", {"images": ["data:image/png;base64,aGVsbG8="]})
    assert r.status_code == 400 and "images are not supported" in r.json()["error"]["message"]
