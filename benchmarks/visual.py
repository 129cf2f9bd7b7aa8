"""Page images: polyvec's ColQwen2 against colpali-engine's computation (transformers' Qwen2VLModel with input
ids and pixels, then the projection and L2 norm), on the same weights and images, interleaved in one process;
`--model colpali`: polyvec's ColPali against transformers' ColPaliForRetrieval (SigLIP-So400m and Gemma-2B
widths: 1,024 image tokens per page).

    python benchmarks/visual.py [--model colqwen2|colpali] [--pages 8] [--vision-layers 4] [--text-layers 4]
                                [--repeats 2] [--dtypes float32 bfloat16]

No ColQwen2 weights can be had here: the model has ColQwen2 (Qwen2-VL-2B)'s widths (vision 1280 x 16 heads,
language model 1536 x 12 heads / 2 KV heads, intermediate 8960, 128-d vectors) with fewer layers and seeded
weights, MiniLM's vocabulary plus Qwen2-VL's special tokens. The pages are Cranfield passages rendered as
page images with Pillow (black text on white, 850 x 1100 pixels), within ColQwen2's budget of 768 merged
tokens per image. Reported: pages/s (batches of 4, as colpali-engine's processor pads them) and the latency of
one query, and the per-token cosine between the two systems' vectors.
"""

from __future__ import annotations

import argparse
import atexit
import shutil
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from common import hardware, load_passages  # noqa: E402


def render_pages(texts: list[str], size: tuple[int, int] = (850, 1100)) -> list:
    from PIL import Image, ImageDraw

    pages = []
    for text in texts:
        page = Image.new("RGB", size, "white")
        draw = ImageDraw.Draw(page)
        y = 40
        for line in textwrap.wrap(text, 90)[:60]:
            draw.text((40, y), line, fill="black")
            y += 16
        pages.append(page)
    return pages


def build(folder: Path, vision_layers: int, text_layers: int) -> None:
    import json

    import torch
    from transformers import ColQwen2Config, ColQwen2ForRetrieval, Qwen2VLConfig

    from polyvec.resolve import resolve_model_path
    from tests.helpers import COLQWEN2_SPECIAL, save_special_tokenizer

    ids = save_special_tokenizer(folder, resolve_model_path("sentence-transformers/all-MiniLM-L6-v2"), COLQWEN2_SPECIAL)
    vlm = Qwen2VLConfig(
        text_config=dict(vocab_size=30529, hidden_size=1536, intermediate_size=8960, num_hidden_layers=text_layers,
                         num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}),
        vision_config=dict(depth=vision_layers, embed_dim=1280, num_heads=16, hidden_size=1536, mlp_ratio=4),
        image_token_id=ids["<|image_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )  # fmt: skip
    torch.manual_seed(0)
    ColQwen2ForRetrieval(ColQwen2Config(vlm_config=vlm, embedding_dim=128)).eval().save_pretrained(folder)
    budget = {"min_pixels": 4 * 28 * 28, "max_pixels": 768 * 28 * 28}
    (folder / "preprocessor_config.json").write_text(json.dumps(budget))


def reference_encoder(folder: Path, dtype):
    """colpali-engine's ColQwen2.forward on batches padded as its processor pads them (right, with attention
    masks), on transformers' modules."""
    import torch
    from tokenizers import Tokenizer
    from transformers import ColQwen2ForRetrieval

    from polyvec.config import ColQwen2Spec
    from polyvec.multimodal.image import qwen2_vl_patches

    model = ColQwen2ForRetrieval.from_pretrained(str(folder), dtype=dtype).eval()
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    spec = ColQwen2Spec(vision_config={}, image_token_id=0)
    pad_id = tok.token_to_id("<|image_pad|>")

    def run(prompts: list[list[int]], pixels: list) -> list:
        width = max(len(p) for p in prompts)
        ids = torch.tensor([p + [0] * (width - len(p)) for p in prompts])
        mask = torch.tensor([[1] * len(p) + [0] * (width - len(p)) for p in prompts])
        kwargs = {}
        if pixels:
            kwargs = {
                "pixel_values": torch.cat([p.patches for p in pixels]),
                "image_grid_thw": torch.tensor([p.grid_thw for p in pixels]),
                "mm_token_type_ids": (ids == pad_id).int(),
            }
        with torch.inference_mode():
            hidden = model.vlm(input_ids=ids, attention_mask=mask, **kwargs).last_hidden_state
            out = model.embedding_proj_layer(hidden)
            out = out / out.norm(dim=-1, keepdim=True)
        return [out[i, : len(p)].float() for i, p in enumerate(prompts)]

    def pages(images: list) -> list:
        pixels = [qwen2_vl_patches(im, 4 * 28 * 28, 768 * 28 * 28) for im in images]
        prompts = []
        for p in pixels:
            ids = tok.encode(spec.visual_prompt).ids
            k = ids.index(pad_id)
            prompts.append(ids[:k] + [pad_id] * (p.patches.shape[0] // 4) + ids[k + 1 :])
        return run(prompts, pixels)

    def queries(texts: list[str]) -> list:
        return run([tok.encode(spec.query_prefix + t + spec.query_suffix).ids for t in texts], [])

    return pages, queries


def build_colpali(folder: Path, vision_layers: int, text_layers: int) -> None:
    import torch
    from transformers import ColPaliConfig, ColPaliForRetrieval, GemmaConfig, PaliGemmaConfig, SiglipVisionConfig

    from polyvec.resolve import resolve_model_path
    from tests.helpers import COLPALI_SPECIAL, save_special_tokenizer

    ids = save_special_tokenizer(folder, resolve_model_path("sentence-transformers/all-MiniLM-L6-v2"), COLPALI_SPECIAL)
    text = GemmaConfig(vocab_size=30528, hidden_size=2048, intermediate_size=16384, num_hidden_layers=text_layers,
                       num_attention_heads=8, num_key_value_heads=1, head_dim=256, max_position_embeddings=8192,
                       pad_token_id=ids["<pad>"], bos_token_id=ids["<bos>"])  # fmt: skip
    vision = SiglipVisionConfig(hidden_size=1152, intermediate_size=4304, num_hidden_layers=vision_layers,
                                num_attention_heads=16, image_size=448, patch_size=14,
                                vision_use_head=False)  # fmt: skip
    vlm = PaliGemmaConfig(text_config=text, vision_config=vision, image_token_id=ids["<image>"], projection_dim=2048)
    torch.manual_seed(0)
    ColPaliForRetrieval(ColPaliConfig(vlm_config=vlm, embedding_dim=128)).eval().save_pretrained(folder)


def reference_colpali(folder: Path, dtype):
    """transformers' ColPaliForRetrieval as ColPaliProcessor feeds it: right-padded batches with attention masks
    and all-zero token types (the whole prompt is PaliGemma's prefix)."""
    import torch
    from tokenizers import Tokenizer
    from transformers import ColPaliForRetrieval
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    model = ColPaliForRetrieval.from_pretrained(str(folder), dtype=dtype).eval()
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    processor = SiglipImageProcessorPil(size={"height": 448, "width": 448}, resample=3, image_mean=[0.5] * 3,
                                        image_std=[0.5] * 3)  # fmt: skip

    def run(prompts: list[list[int]], images: list | None) -> list:
        width = max(len(p) for p in prompts)
        ids = torch.tensor([p + [0] * (width - len(p)) for p in prompts])
        mask = torch.tensor([[1] * len(p) + [0] * (width - len(p)) for p in prompts])
        kwargs = {"token_type_ids": torch.zeros_like(ids)}
        if images:
            kwargs["pixel_values"] = processor(images, return_tensors="pt").pixel_values.to(dtype)
        with torch.inference_mode():
            out = model(input_ids=ids, attention_mask=mask, **kwargs).embeddings
        return [out[i, : len(p)].float() for i, p in enumerate(prompts)]

    def pages(images: list) -> list:
        doc = tok.encode("<image><bos>Describe the image.\n", add_special_tokens=False).ids
        k = doc.index(tok.token_to_id("<image>"))
        prompt = doc[:k] + doc[k : k + 1] * 1024 + doc[k + 1 :]
        return run([prompt] * len(images), images)

    def queries(texts: list[str]) -> list:
        return run([tok.encode("<bos>Question: " + t + "<pad>" * 10 + "\n", add_special_tokens=False).ids
                    for t in texts], None)  # fmt: skip

    return pages, queries


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["colqwen2", "colpali"], default="colqwen2")
    ap.add_argument("--pages", type=int, default=8)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--vision-layers", type=int, default=4)
    ap.add_argument("--text-layers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    args = ap.parse_args()
    import torch

    from polyvec import LLM, PoolingParams

    texts = load_passages(("cranfield",), args.pages)
    images = render_pages(texts)
    queries = ["what is the lift of a wing at supersonic speed?", "heat transfer in boundary layers"]
    folder = Path(tempfile.mkdtemp(prefix=f"{args.model}-bench-"))
    atexit.register(shutil.rmtree, folder, True)  # gigabytes of outputs and models
    (build_colpali if args.model == "colpali" else build)(folder, args.vision_layers, args.text_layers)
    shape = "ColPali" if args.model == "colpali" else "ColQwen2"
    print(f"## {shape}-shaped ({args.vision_layers} vision + {args.text_layers} language layers), {len(images)} "
          f"rendered pages, batches of {args.batch}\n{time.strftime('%Y-%m-%d')}, {hardware()}\n")  # fmt: skip
    print("| dtype | system | pages/s per repeat | query ms per repeat (median of 10) |")
    print("|---|---|---|---|")
    for dtype in args.dtypes:
        torch_dtype = getattr(torch, dtype)
        llm = LLM(str(folder), dtype=dtype)
        enc_pages = llm.token_embed  # bound now: the lambdas below must not see the next dtype's engine
        reference = reference_colpali if args.model == "colpali" else reference_encoder
        ref_pages, ref_queries = reference(folder, torch_dtype)
        systems = {
            "polyvec": (
                lambda batch: [o.outputs.data for o in enc_pages(batch, use_tqdm=False)],
                lambda q: enc_pages(q, PoolingParams(input_type="query"), use_tqdm=False),
            ),
            "colpali-engine (transformers)": (ref_pages, lambda q: ref_queries([q])),
        }
        rates: dict[str, list[float]] = {k: [] for k in systems}
        lat: dict[str, list[float]] = {k: [] for k in systems}
        outs: dict[str, list] = {}
        for enc, _ in systems.values():  # warm-up
            enc(images[:1])
        for r in range(args.repeats):
            for name in list(systems)[:: 1 if r % 2 == 0 else -1]:
                enc, query = systems[name]
                t0 = time.perf_counter()
                got = []
                for b in range(0, len(images), args.batch):
                    got += enc(images[b : b + args.batch])
                rates[name].append(len(images) / (time.perf_counter() - t0))
                outs[name] = got
                times = []
                for k in range(10):
                    t0 = time.perf_counter()
                    query(queries[k % 2])
                    times.append((time.perf_counter() - t0) * 1e3)
                lat[name].append(statistics.median(times))
        for name in systems:
            print(f"| {dtype} | {name} | {', '.join(f'{x:.2f}' for x in rates[name])} | "
                  f"{', '.join(f'{x:.1f}' for x in lat[name])} |")  # fmt: skip
        a, b = outs["polyvec"], outs["colpali-engine (transformers)"]
        cos = min(
            torch.nn.functional.cosine_similarity(x.float(), y.float(), dim=-1).min().item() for x, y in zip(a, b)
        )
        ratio = [x / y for x, y in zip(rates["polyvec"], rates["colpali-engine (transformers)"])]
        qratio = [y / x for x, y in zip(lat["polyvec"], lat["colpali-engine (transformers)"])]
        print(f"| {dtype} | polyvec / reference | pages/s {', '.join(f'{x:.2f}x' for x in ratio)} | "
              f"query {', '.join(f'{x:.2f}x' for x in qratio)}; min per-token cosine {cos:.5f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
