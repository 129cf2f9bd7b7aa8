"""ColQwen2 against the computation colpali-engine's ColQwen2 runs (transformers' Qwen2VLModel with its
multimodal rotary positions, then the projection and L2 norm) on a small seeded configuration, in both
checkpoint layouts (transformers' ColQwen2ForRetrieval; colpali-engine's ColQwen2)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("PIL", reason="Pillow is the vision extra")
from PIL import Image  # noqa: E402

from polyvec import LLM, PoolingParams  # noqa: E402
from polyvec.config import ColQwen2Spec  # noqa: E402
from polyvec.multimodal.image import qwen2_vl_patches  # noqa: E402
from tests.helpers import as_rgb, cosine_rows, save_colqwen2, serve_folder  # noqa: E402

SPEC = ColQwen2Spec(vision_config={}, image_token_id=0)  # the default prompts and pixel budget
QUERIES = ["what is the lift coefficient?", "flutter"]


@pytest.fixture(scope="module")
def colqwen2(tmp_path_factory, minilm_path):
    folder = tmp_path_factory.mktemp("colqwen2")
    model, ids = save_colqwen2(folder, minilm_path)
    return model, folder, ids


@pytest.fixture(scope="module")
def colqwen2_5(tmp_path_factory, minilm_path):
    folder = tmp_path_factory.mktemp("colqwen2_5")
    model, ids = save_colqwen2(folder, minilm_path, version="2.5")
    return model, folder, ids


def _images():
    rng = np.random.default_rng(2)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in ((200, 150), (90, 300))]


def _transparent():
    """An RGBA page whose pixels are partly transparent, hiding colours under them."""
    rng = np.random.default_rng(3)
    rgba = rng.integers(0, 256, (100, 120, 4), dtype=np.uint8)
    return Image.fromarray(rgba, "RGBA")


def _reference(model, ids: list[int], images: list | None, image_token: int) -> torch.Tensor:
    """colpali-engine's ColQwen2.forward: Qwen2VLModel with input ids and pixels (so its multimodal rotary
    positions), then the projection and the L2 norm."""
    input_ids = torch.tensor([ids])
    kwargs = {}
    if images:
        pix = [qwen2_vl_patches(im, 28 * 28 * 4, 28 * 28 * 64) for im in images]
        kwargs = {
            "pixel_values": torch.cat([p.patches for p in pix]),
            "image_grid_thw": torch.tensor([p.grid_thw for p in pix]),
            "mm_token_type_ids": (input_ids == image_token).int(),
        }
    with torch.no_grad():
        hidden = model.vlm(input_ids=input_ids, **kwargs).last_hidden_state[0]
        out = model.embedding_proj_layer(hidden)
    return out / out.norm(dim=-1, keepdim=True)


def _expected_ids(folder: Path, text: str, images: list | None, pad: int) -> list[int]:
    """The processor's rule: the prompt tokenized, each <|image_pad|> repeated for the image's merged tokens."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    out, k = [], 0
    for t in tok.encode(text).ids:
        if t == pad:
            out += [pad] * (qwen2_vl_patches(images[k], 28 * 28 * 4, 28 * 28 * 64).patches.shape[0] // 4)
            k += 1
        else:
            out.append(t)
    return out


def _reference_query_ids(folder: Path, query: str, layout: str, pad: int) -> list[int]:
    """A query's ids as the layout's processor makes them: transformers' ColQwen2Processor ends it with a newline
    after the augmentation tokens, colpali-engine's (<= 0.3.10, whose prefix this is) does not."""
    from transformers import ColQwen2Processor, PreTrainedTokenizerFast
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    if layout == "colpali-engine":
        return _expected_ids(folder, "Query: " + query + "<|endoftext|>" * 10, None, pad)
    tok = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), pad_token="<|endoftext|>")
    processor = ColQwen2Processor(image_processor=Qwen2VLImageProcessorPil(), tokenizer=tok)
    return processor.process_queries([query])["input_ids"][0].tolist()


def _check_layout(llm, model, folder, ids, layout: str = "transformers"):
    pad = ids["<|image_pad|>"]
    assert llm.engine.is_late_interaction and llm.supported_tasks == ("token_embed",)
    images = _images()
    docs = llm.token_embed(images, use_tqdm=False)  # bare images: the model's image prompt
    for img, o in zip(images, docs):
        want_ids = _expected_ids(folder, SPEC.visual_prompt, [img], pad)
        assert o.prompt_token_ids == want_ids and o.input_type == "document"
        ref = _reference(model, want_ids, [img], pad)
        assert o.outputs.data.shape == ref.shape
        assert cosine_rows(o.outputs.data, ref).min() >= 0.9999
    queries = llm.token_embed(QUERIES, PoolingParams(input_type="query"), use_tqdm=False)
    for q, o in zip(QUERIES, queries):
        want_ids = _reference_query_ids(folder, q, layout, pad)
        assert o.prompt_token_ids == want_ids
        assert cosine_rows(o.outputs.data, _reference(model, want_ids, None, pad)).min() >= 0.9999
    page = _transparent()
    out = llm.token_embed(page, use_tqdm=False)[0].outputs.data
    rgb = as_rgb(page, layout)
    ref = _reference(model, _expected_ids(folder, SPEC.visual_prompt, [rgb], pad), [rgb], pad)
    assert out.shape == ref.shape and cosine_rows(out, ref).min() >= 0.9999
    return docs, queries


def test_transformers_layout_matches_reference(colqwen2):
    model, folder, ids = colqwen2
    llm = LLM(str(folder), dtype="float32")
    docs, queries = _check_layout(llm, model, folder, ids)
    # MaxSim of a text query against page images, in float32
    scores = llm.score(QUERIES[0], _images(), use_tqdm=False)
    for s, d in zip(scores, docs):
        want = (queries[0].outputs.data @ d.outputs.data.T).amax(1).sum().item()
        assert s.outputs.score == pytest.approx(want, rel=1e-5)
    # two images in one prompt, and vLLM's prompt + multi_modal_data form
    block = "<|vision_start|><|image_pad|><|vision_end|>"
    two = SPEC.visual_prompt.replace(block, block + block)
    got = llm.token_embed({"prompt": two, "multi_modal_data": {"image": _images()}}, use_tqdm=False)[0]
    want_ids = _expected_ids(folder, two, _images(), ids["<|image_pad|>"])
    assert got.prompt_token_ids == want_ids
    ref = _reference(model, want_ids, _images(), ids["<|image_pad|>"])
    assert cosine_rows(got.outputs.data, ref).min() >= 0.9999
    # an image alone equals it among others, bit for bit in float32 (the vision tower's patch embedding and
    # merger ran on MKL, whose rows depend on the batch's: 4.5e-7 apart)
    rng = np.random.default_rng(3)
    more = [Image.fromarray(rng.integers(0, 256, (80, 100 + 7 * i, 3), dtype=np.uint8)) for i in range(4)]
    mixed = llm.token_embed([_images()[1], "a text", _images()[0], *more], use_tqdm=False)
    alone = llm.token_embed([_images()[1]], use_tqdm=False)[0]
    assert torch.equal(mixed[0].outputs.data, alone.outputs.data)
    assert (mixed[0].outputs.data - docs[1].outputs.data).abs().max() <= 1e-5


def test_colqwen2_5_matches_reference(colqwen2_5):
    """ColQwen2.5 (Qwen2.5-VL: RMSNorm, SwiGLU and window attention in the vision tower), transformers' layout."""
    model, folder, ids = colqwen2_5
    llm = LLM(str(folder), dtype="float32")
    args = llm.engine.runner.model.encoder.visual.args
    assert args.qwen2_5 and args.window_size == 56 and args.fullatt_block_indexes == (1,)
    docs, queries = _check_layout(llm, model, folder, ids)
    scores = llm.score(QUERIES[1], _images(), use_tqdm=False)
    for s, d in zip(scores, docs):
        want = (queries[1].outputs.data @ d.outputs.data.T).amax(1).sum().item()
        assert s.outputs.score == pytest.approx(want, rel=1e-5)
    mixed = llm.token_embed([_images()[1], "a text", _images()[0]], use_tqdm=False)
    assert (mixed[0].outputs.data - docs[1].outputs.data).abs().max() <= 1e-5


@pytest.mark.parametrize("version", ["2", "2.5"])
def test_colpali_engine_layout(colqwen2, colqwen2_5, tmp_path, version):
    """colpali-engine's save: config.json is the Qwen2-VL (Qwen2.5-VL) config naming ColQwen2 (ColQwen2_5),
    weights `visual.`, `model.` and `custom_text_proj.`."""
    from safetensors.torch import load_file, save_file

    model, folder, ids = colqwen2_5 if version == "2.5" else colqwen2
    other = tmp_path / "colpali"
    other.mkdir()
    shutil.copy(folder / "tokenizer.json", other)
    shutil.copy(folder / "preprocessor_config.json", other)
    renames = (
        ("vlm.visual.", "visual."),
        ("vlm.language_model.", "model."),
        ("embedding_proj_layer.", "custom_text_proj."),
    )
    state = {}
    for k, v in load_file(str(folder / "model.safetensors")).items():
        for a, b in renames:
            if k.startswith(a):
                k = b + k[len(a) :]
        state[k] = v
    save_file(state, str(other / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())["vlm_config"]
    name = "ColQwen2_5" if version == "2.5" else "ColQwen2"
    (other / "config.json").write_text(json.dumps({**config, "architectures": [name]}))
    _check_layout(LLM(str(other), dtype="float32"), model, folder, ids, "colpali-engine")


def test_bad_images_and_text_models(colqwen2, minilm_llm):
    _, folder, _ = colqwen2
    llm = LLM(str(folder), dtype="float32")
    with pytest.raises(ValueError, match=r"prompt 1: image 0: not a readable image"):
        llm.token_embed(["fine", {"multi_modal_data": {"image": b"not an image"}}], use_tqdm=False)
    with pytest.raises(ValueError, match="takes 'image'"):
        llm.token_embed({"multi_modal_data": {"video": b"x"}}, use_tqdm=False)
    with pytest.raises(ValueError, match="2 <\\|image_pad\\|> placeholders for 1 images"):
        two = SPEC.visual_prompt.replace("<|image_pad|>", "<|image_pad|><|image_pad|>")
        llm.token_embed({"prompt": two, "multi_modal_data": {"image": _images()[0]}}, use_tqdm=False)
    with pytest.raises(ValueError, match="this model reads text only"):
        minilm_llm.embed({"prompt": "x", "multi_modal_data": {"image": _images()[0]}}, use_tqdm=False)


def test_every_image_form_is_an_image_and_never_text(colqwen2, minilm_llm):
    """Bytes, a data:image URL in any case and a single prompt dict are images for an image model (never token ids
    or text); a text model refuses each by name; image tokens are never silently left uncut."""
    import base64
    import io

    _, folder, _ = colqwen2
    llm = LLM(str(folder), dtype="float32")
    image = _images()[0]
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    png = buf.getvalue()
    want = llm.token_embed(image, use_tqdm=False)[0]
    upper = "DATA:image/png;base64," + base64.b64encode(png).decode()
    for form in (png, bytearray(png), upper, {"multi_modal_data": {"image": png}}):
        got = llm.token_embed(form, use_tqdm=False)
        assert len(got) == 1 and got[0].prompt_token_ids == want.prompt_token_ids
        assert torch.equal(got[0].outputs.data, want.outputs.data)
    query = "what is the lift coefficient?"
    one = llm.score(query, [image], use_tqdm=False)[0].outputs.score
    for doc in (image, png, {"multi_modal_data": {"image": image}}):  # one document, not its keys or pixels
        got = llm.score(query, doc, use_tqdm=False)
        assert len(got) == 1 and got[0].outputs.score == pytest.approx(one, rel=1e-6)
    with pytest.raises(ValueError, match=rf"prompt 0 has {len(want.prompt_token_ids)} tokens with its images, more "
                       "than the truncation limit of 5"):  # fmt: skip
        llm.token_embed(image, truncate_prompt_tokens=5, use_tqdm=False)
    for form, kind in ((png, "bytes"), (upper, "a data:image URL"), (image, "a PIL image")):
        with pytest.raises(ValueError, match=rf"prompt 1 is an image \({kind}\); this model reads text only"):
            minilm_llm.embed(["text", form], use_tqdm=False)


def test_image_limits_and_processor_kwargs(colqwen2, minilm_path):
    """vLLM's limit_mm_per_prompt and mm_processor_kwargs, the decoded-size limits, per image and per call."""
    from polyvec.engine.factory import create_engine

    _, folder, _ = colqwen2
    images = _images()  # 200x150 and 90x300 pixels
    llm = LLM(str(folder), dtype="float32", limit_mm_per_prompt={"image": 1}, max_image_pixels=29_000)
    two = SPEC.visual_prompt.replace("<|image_pad|>", "<|image_pad|><|image_pad|>")
    with pytest.raises(ValueError, match="prompt 0 has 2 images, more than the limit of 1 per prompt"):
        llm.token_embed({"prompt": two, "multi_modal_data": {"image": images}}, use_tqdm=False)
    with pytest.raises(ValueError, match="prompt 1: image 0: 200x150 pixels, more than the limit of 29000"):
        llm.token_embed([images[1], images[0]], use_tqdm=False)

    engine = create_engine(str(folder), dtype="float32", max_request_image_pixels=50_000)
    engine.process([images[0]], None, "token_embed")  # 30,000 decoded pixels: within
    with pytest.raises(ValueError, match="prompt 1: image 0: the request's images reach 57000 pixels, more than the"):
        engine.process([images[0], images[1]], None, "token_embed")  # 30,000 + 27,000

    default = LLM(str(folder), dtype="float32").token_embed(images[0], use_tqdm=False)[0].outputs.data
    small = LLM(str(folder), dtype="float32", mm_processor_kwargs={"max_pixels": 4 * 28 * 28, "min_pixels": 784})
    got = small.token_embed(images[0], use_tqdm=False)[0].outputs.data
    merged = [math.prod(qwen2_vl_patches(images[0], 784, most).grid_thw) // 4 for most in (64 * 784, 4 * 784)]
    assert merged == [35, 2] and got.shape[0] == default.shape[0] - merged[0] + merged[1]  # the prompt's text kept
    for bad, message in [
        ({"mm_processor_kwargs": {"size": 3}}, "size not supported; polyvec takes min_pixels, max_pixels"),
        ({"mm_processor_kwargs": {"max_pixels": 0}}, r"mm_processor_kwargs\['max_pixels'\] must be a positive"),
        ({"limit_mm_per_prompt": {"video": 1}}, "reads images only, not 'video'"),
        ({"limit_mm_per_prompt": {"image": -1}}, "must be an integer >= 0"),
    ]:
        with pytest.raises(ValueError, match=message):
            LLM(str(folder), dtype="float32", **bad)
    with pytest.raises(ValueError, match="mm_processor_kwargs apply to image models"):
        LLM(str(minilm_path), mm_processor_kwargs={"max_pixels": 1000})


def test_remote_images_only_from_allowed_domains(colqwen2, tmp_path):
    _, folder, _ = colqwen2
    images = _images()
    images[0].save(tmp_path / "page.png")
    want = LLM(str(folder), dtype="float32").token_embed(images[0], use_tqdm=False)[0].outputs.data
    with serve_folder(tmp_path) as base:
        url = {"multi_modal_data": {"image": base + "/page.png"}}
        got = LLM(str(folder), dtype="float32", allowed_media_domains=["127.0.0.1"]).token_embed(url, use_tqdm=False)
        assert torch.equal(got[0].outputs.data, want)
        closed = LLM(str(folder), dtype="float32")
        with pytest.raises(ValueError, match=r"image 0: remote image URLs are fetched only from --allowed-media-"):
            closed.token_embed(url, use_tqdm=False)
        allowed = LLM(str(folder), dtype="float32", allowed_media_domains=["example.com"])
        with pytest.raises(ValueError, match="'127.0.0.1' is not one of them"):
            allowed.token_embed(url, use_tqdm=False)
        with pytest.raises(ValueError, match=r"fetching .*/missing.png failed \(HTTPError"):
            LLM(str(folder), dtype="float32", allowed_media_domains=["127.0.0.1"]).token_embed(
                {"multi_modal_data": {"image": base + "/missing.png"}}, use_tqdm=False
            )


def test_processor_files_set_prompts_and_normalization(colqwen2, tmp_path):
    """processor_config.json's query_prefix and preprocessor_config.json's image_mean / image_std apply, as in
    transformers' processor (they were ignored: the prompts and CLIP's constants were fixed)."""
    from transformers import ColQwen2Processor, PreTrainedTokenizerFast
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    _, folder, ids = colqwen2
    other = tmp_path / "own-processor"
    shutil.copytree(folder, other)
    pre = {"min_pixels": 28 * 28 * 4, "max_pixels": 28 * 28 * 64, "image_mean": [0.5] * 3, "image_std": [0.25] * 3}
    (other / "preprocessor_config.json").write_text(json.dumps(pre))
    (other / "processor_config.json").write_text(json.dumps({"query_prefix": "Question: "}))
    llm = LLM(str(other), dtype="float32")
    tok = PreTrainedTokenizerFast(tokenizer_file=str(other / "tokenizer.json"), pad_token="<|endoftext|>")
    images = Qwen2VLImageProcessorPil(**pre)
    processor = ColQwen2Processor(image_processor=images, tokenizer=tok, query_prefix="Question: ")
    (query,) = llm.engine.process([QUERIES[0]], PoolingParams(input_type="query"), "token_embed")
    assert query.prompt_token_ids == processor.process_queries([QUERIES[0]])["input_ids"][0].tolist()
    (doc,) = llm.engine.process([_images()[0]], None, "token_embed")
    want = images(images=[_images()[0]], return_tensors="pt")["pixel_values"].float()
    assert (doc.images[0].patches - want).abs().max() <= 1e-6
