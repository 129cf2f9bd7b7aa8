"""ColPali against transformers' ColPaliForRetrieval (PaliGemma: SigLIP + Gemma, bidirectional over the prompt,
as ColPaliProcessor's token_type_ids ask) on a small seeded configuration, in both checkpoint layouts
(transformers'; colpali-engine's ColPali)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("PIL", reason="Pillow is the vision extra")
from PIL import Image  # noqa: E402

from polyvec import LLM, PoolingParams  # noqa: E402
from tests.helpers import as_rgb, cosine_rows, save_colpali  # noqa: E402

DOC_PROMPT = "<image><bos>Describe the image.\n"
QUERIES = ["what is the lift coefficient?", "flutter"]


@pytest.fixture(scope="module")
def colpali(tmp_path_factory, minilm_path):
    folder = tmp_path_factory.mktemp("colpali")
    model, ids = save_colpali(folder, minilm_path)
    return model, folder, ids


def _images():
    rng = np.random.default_rng(4)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in ((200, 150), (90, 300))]


def _pixels(images) -> torch.Tensor:
    from transformers import SiglipImageProcessor

    processor = SiglipImageProcessor(size={"height": 56, "width": 56}, resample=3, image_mean=[0.5] * 3,
                                     image_std=[0.5] * 3)  # fmt: skip
    return processor(images, return_tensors="pt").pixel_values


def _reference(model, ids: list[int], image=None) -> torch.Tensor:
    """ColPaliForRetrieval.forward as ColPaliProcessor calls it: token_type_ids all 0 (the whole prompt is
    PaliGemma's prefix, so attention is bidirectional)."""
    input_ids = torch.tensor([ids])
    kwargs = {"token_type_ids": torch.zeros_like(input_ids)}
    if image is not None:
        kwargs["pixel_values"] = _pixels([image])
    with torch.no_grad():
        return model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), **kwargs).embeddings[0]


def _expected_ids(folder, text: str, image_token: int) -> list[int]:
    """The processor's rule: 16 image tokens (56² pixels in 14² patches), then the text, nothing added."""
    from tokenizers import Tokenizer

    out = []
    for t in Tokenizer.from_file(str(folder / "tokenizer.json")).encode(text, add_special_tokens=False).ids:
        out += [t] * 16 if t == image_token else [t]
    return out


def _check(llm, model, folder, ids, layout: str = "transformers"):
    image_token = ids["<image>"]
    assert llm.engine.is_late_interaction and llm.supported_tasks == ("token_embed",)
    images = _images()
    docs = llm.token_embed(images, use_tqdm=False)
    for image, o in zip(images, docs):
        want = _expected_ids(folder, DOC_PROMPT, image_token)
        assert o.prompt_token_ids == want and o.input_type == "document"
        ref = _reference(model, want, image)
        assert o.outputs.data.shape == ref.shape == (len(want), 16)
        assert cosine_rows(o.outputs.data, ref).min() >= 0.9999
        # bidirectional: the first image token sees the prompt's last words (causal attention would not)
        other = llm.token_embed({"prompt": "<image><bos>Describe the page.\n", "multi_modal_data": {"image": image}},
                                use_tqdm=False)[0].outputs.data  # fmt: skip
        assert (other[0] - o.outputs.data[0]).abs().max() > 1e-3
    queries = llm.token_embed(QUERIES, PoolingParams(input_type="query"), use_tqdm=False)
    for q, o in zip(QUERIES, queries):
        want = _expected_ids(folder, "<bos>Question: " + q + "<pad>" * 10 + "\n", image_token)
        assert o.prompt_token_ids == want and want[0] == ids["<bos>"] and want.count(ids["<pad>"]) == 10
        assert cosine_rows(o.outputs.data, _reference(model, want)).min() >= 0.9999
    page = Image.fromarray(np.random.default_rng(3).integers(0, 256, (100, 120, 4), dtype=np.uint8), "RGBA")
    out = llm.token_embed(page, use_tqdm=False)[0].outputs.data
    ref = _reference(model, _expected_ids(folder, DOC_PROMPT, image_token), as_rgb(page, layout))
    assert cosine_rows(out, ref).min() >= 0.9999
    return docs, queries


def test_colpali_matches_transformers(colpali):
    model, folder, ids = colpali
    llm = LLM(str(folder), dtype="float32")
    docs, queries = _check(llm, model, folder, ids)
    # MaxSim in float32 against the reference's vectors
    scores = llm.score(QUERIES[0], _images(), use_tqdm=False)
    q = _reference(model, queries[0].prompt_token_ids)
    for o, image, d in zip(scores, _images(), docs):
        want = (q @ _reference(model, d.prompt_token_ids, image).T).max(dim=1).values.sum().item()
        assert o.outputs.score == pytest.approx(want, rel=1e-5)
    # a page alone and among others
    alone = llm.token_embed(_images()[1], use_tqdm=False)[0].outputs.data
    mixed = llm.token_embed([_images()[0], "flutter", _images()[1]], use_tqdm=False)[2].outputs.data
    assert (alone - mixed).abs().max() <= 1e-5


def test_colpali_engine_layout(tmp_path, minilm_path):
    model, ids = save_colpali(tmp_path, minilm_path, layout="colpali-engine")
    llm = LLM(str(tmp_path), dtype="float32")
    assert "ColPali" in llm.model_config.sources["architecture"]
    _check(llm, model, tmp_path, ids, "colpali-engine")


def test_colpali_bfloat16_stays_close(colpali):
    model, folder, ids = colpali
    out = LLM(str(folder), dtype="bfloat16").token_embed(_images()[0], use_tqdm=False)[0]
    ref = _reference(model, out.prompt_token_ids, _images()[0])
    assert cosine_rows(out.outputs.data.float(), ref).min() >= 0.99
    with pytest.raises(ValueError, match="ColPali resizes every image to one square size"):
        LLM(str(folder), dtype="float32", mm_processor_kwargs={"max_pixels": 1000})
