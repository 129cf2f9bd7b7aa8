"""ColQwen2 / ColQwen2.5 end to end on real page images: the repository's README rendered with Pillow into pages of
different sizes (portrait and landscape), encoded as PNG files, embedded as documents beside queries taken from
their text, on the seeded models of test_colqwen2.py. The reference reads the same PNGs with transformers'
Qwen2-VL image processor (not polyvec's) and runs transformers' Qwen2VLModel / Qwen2_5_VLModel with
colpali-engine's recipe; token counts, grids, per-token vectors, MaxSim scores and rankings must agree."""

from __future__ import annotations

import io
import math
import re
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("PIL", reason="Pillow is the vision extra")
from PIL import Image, ImageDraw, ImageFont  # noqa: E402

from polyvec import LLM, PoolingParams  # noqa: E402
from tests.helpers import cosine_rows, save_colqwen2  # noqa: E402
from tests.models.test_colqwen2 import SPEC, _reference, _reference_query_ids  # noqa: E402

README = Path(__file__).resolve().parents[2] / "README.md"
PAGE_SIZES = [(300, 400), (420, 300), (340, 440), (460, 260)]  # (width, height): each resized to its own grid
LINES_PER_PAGE = 14
BUDGET = {"min_pixels": 28 * 28 * 4, "max_pixels": 28 * 28 * 64}  # the seeded checkpoint's preprocessor_config


def _pages() -> tuple[list[bytes], list[str]]:
    """The README's first 4 x 14 lines, one chunk a page (wrapped to the page width, clipped at its foot), as PNG
    bytes; and each chunk's plain text."""
    lines = README.read_text(encoding="utf-8").splitlines()
    font = ImageFont.load_default(size=10)
    pages, texts = [], []
    for k, (width, height) in enumerate(PAGE_SIZES):
        chunk = lines[k * LINES_PER_PAGE : (k + 1) * LINES_PER_PAGE]
        page = Image.new("RGB", (width, height), "white")
        draw = ImageDraw.Draw(page)
        columns = max(20, int((width - 16) / font.getlength("n")))
        y = 8
        for line in chunk:
            for row in textwrap.wrap(line, columns) or [""]:
                if y + 12 > height - 8:
                    break
                draw.text((8, y), row, fill="black", font=font)
                y += 12
        buf = io.BytesIO()
        page.save(buf, format="PNG")
        pages.append(buf.getvalue())
        texts.append("\n".join(chunk))
    return pages, texts


def _queries(texts: list[str]) -> list[str]:
    """A phrase of each page: the first 6 words of its first line of prose (markup stripped)."""
    out = []
    for text in texts:
        prose = [re.sub(r"[#*`>\-\[\]()]", " ", s).split() for s in text.splitlines() if not s.startswith("```")]
        words = next(w for w in prose if len(w) >= 5)
        out.append(" ".join(words[:6]))
    return out


def _reference_page(model, folder: Path, png: bytes, pad: int):
    """(ids, grid, vectors) of one page as colpali-engine's ColQwen2Processor + ColQwen2 make them: transformers'
    Qwen2-VL image processor on the decoded PNG, the prompt's <|image_pad|> repeated grid / merge² times."""
    from tokenizers import Tokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    image = Image.open(io.BytesIO(png)).convert("RGB")
    pix = Qwen2VLImageProcessorPil(**BUDGET)(images=[image], return_tensors="pt")
    grid = pix["image_grid_thw"][0].tolist()
    ids = []
    for t in Tokenizer.from_file(str(folder / "tokenizer.json")).encode(SPEC.visual_prompt).ids:
        ids += [pad] * (math.prod(grid) // 4) if t == pad else [t]
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        hidden = model.vlm(
            input_ids=input_ids,
            pixel_values=pix["pixel_values"].float(),
            image_grid_thw=pix["image_grid_thw"],
            mm_token_type_ids=(input_ids == pad).int(),
        ).last_hidden_state[0]
        out = model.embedding_proj_layer(hidden)
    return ids, grid, out / out.norm(dim=-1, keepdim=True)


def _maxsim(q: torch.Tensor, d: torch.Tensor) -> float:
    return (q.float() @ d.float().T).amax(1).sum().item()


@pytest.fixture(scope="module", params=["2", "2.5"], ids=["colqwen2", "colqwen2_5"])
def seeded(request, tmp_path_factory, minilm_path):
    folder = tmp_path_factory.mktemp("colqwen" + request.param.replace(".", "_"))
    model, ids = save_colqwen2(folder, minilm_path, version=request.param)
    return model, folder, ids


def test_readme_pages_match_reference(seeded):
    model, folder, ids = seeded
    pad = ids["<|image_pad|>"]
    pages, texts = _pages()
    queries = _queries(texts)
    assert len(set(queries)) == len(queries)

    llm = LLM(str(folder), dtype="float32")
    files = [{"multi_modal_data": {"image": png}} for png in pages]  # the PNG files' bytes, the model's image prompt
    docs = llm.token_embed(files, use_tqdm=False)
    qouts = llm.token_embed(queries, PoolingParams(input_type="query"), use_tqdm=False)

    refs, grids, worst = [], [], 1.0
    for png, o in zip(pages, docs):
        want_ids, grid, ref = _reference_page(model, folder, png, pad)
        grids.append(tuple(grid))
        prompt = len(want_ids) - want_ids.count(pad)
        assert o.input_type == "document" and o.prompt_token_ids == want_ids
        assert o.prompt_token_ids.count(pad) == math.prod(grid) // 4 and 4 <= math.prod(grid) // 4 <= 64
        assert o.outputs.data.shape == ref.shape == (math.prod(grid) // 4 + prompt, 16)
        worst = min(worst, cosine_rows(o.outputs.data, ref).min().item())
        refs.append(ref)
    assert len(set(grids)) == len(PAGE_SIZES), grids  # each page resized to its own grid

    qrefs = []
    for q, o in zip(queries, qouts):
        want_ids = _reference_query_ids(folder, q, "transformers", pad)  # the checkpoint is transformers' layout
        assert o.prompt_token_ids == want_ids
        ref = _reference(model, want_ids, None, pad)
        worst = min(worst, cosine_rows(o.outputs.data, ref).min().item())
        qrefs.append(ref)
    assert worst >= 0.9999

    got = torch.tensor([[_maxsim(q.outputs.data, d.outputs.data) for d in docs] for q in qouts])
    want = torch.tensor([[_maxsim(q, d) for d in refs] for q in qrefs])
    # relative to each query's scores: an elementwise ratio blows up where one score is near 0
    rel = ((got - want).abs().amax(1) / want.abs().amax(1)).max().item()
    assert rel <= 1e-4, (rel, got, want)
    for g, w in zip(got, want):
        assert g.argsort(descending=True).tolist() == w.argsort(descending=True).tolist(), (got, want)
        gaps = w.sort(descending=True).values.diff().abs()
        assert gaps.min() > 2e-4 * w.abs().max()  # the reference's ranking is not decided by rounding

    for k, q in enumerate(queries):  # the score API: MaxSim of the query against the pages
        scores = [s.outputs.score for s in llm.score(q, files, use_tqdm=False)]
        assert scores == pytest.approx(got[k].tolist(), rel=1e-5)
    ranks = want.argsort(1, descending=True).tolist()
    print(f"\n{folder.name}: grids {grids}, min cosine 1 - {1 - worst:.1e}, max rel MaxSim {rel:.1e}, rankings {ranks}")
