"""Helpers shared by the tests (fixtures live in conftest.py)."""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path
from typing import Any

import torch


def cosine_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1)


def save_tiny_model(
    model_cls_name: str, config_cls_name: str, folder: Path, tokenizer_from: Path, seed: int = 0, **config_kwargs
) -> Path:
    """A randomly initialised transformers model (fixed seed), saved with MiniLM's tokenizer."""
    import transformers

    torch.manual_seed(seed)
    cfg = getattr(transformers, config_cls_name)(**config_kwargs)
    model = getattr(transformers, model_cls_name)(cfg).eval()
    # Random init leaves LayerNorm at identity; perturb it so a mis-loaded norm cannot pass.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "LayerNorm" in name or "layer_norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif "relative_attention_bias" in name or "token_type_embeddings" in name:
                # std 0.02 would make the relative bias and the segment embeddings invisible
                p.normal_(0.0, 1.0)
    model.save_pretrained(folder, safe_serialization=True)
    shutil.copy(tokenizer_from / "tokenizer.json", folder / "tokenizer.json")
    return folder


TINY = dict(
    vocab_size=30522,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    max_position_embeddings=128,
)


def save_inference_free_splade(splade_path: Path, folder: Path, seed: int = 0) -> Path:
    """Inference-free SPLADE as sentence-transformers saves it: a Router whose query route is a
    SparseStaticEmbedding (seeded weights: ~20% of the vocabulary zero, the rest in (0, 5)) and whose document
    route is SPLADE-tiny (MLMTransformer + SpladePooling max)."""
    from sentence_transformers import SparseEncoder
    from sentence_transformers.base.modules.router import Router
    from sentence_transformers.sparse_encoder.modules import MLMTransformer, SparseStaticEmbedding, SpladePooling

    doc = MLMTransformer(str(splade_path))
    gen = torch.Generator().manual_seed(seed)
    vocab = doc.tokenizer.vocab_size
    weight = torch.rand(vocab, generator=gen) * 5 * (torch.rand(vocab, generator=gen) > 0.2)
    query = SparseStaticEmbedding(tokenizer=doc.tokenizer, weight=weight, frozen=True)
    pool = SpladePooling("max", word_embedding_dimension=vocab)
    router = Router.for_query_document(query_modules=[query], document_modules=[doc, pool])
    SparseEncoder(modules=[router], similarity_fn_name="dot", device="cpu").save(str(folder))
    return folder


def save_pylate(bare: Path, out: Path, hidden: int, dim: int, query_length: int, document_length: int, **recipe: Any):
    """A PyLate ColBERT on the transformer in `bare` with a seeded Dense (hidden → dim, no bias), written to `out` in
    PyLate's layout; returns (the PyLate model in memory, out). `recipe`: more of models.ColBERT's options."""
    import importlib

    from pylate import models
    from sentence_transformers.base.modules.transformer import Transformer

    dense_mod = importlib.import_module("pylate.models.Dense")
    models.ColBERT._text_length = lambda self, t: len(t) if isinstance(t, str) else sum(map(len, t))
    torch.manual_seed(0)
    transformer = Transformer(str(bare))
    dense = dense_mod.Dense(in_features=hidden, out_features=dim, bias=False)
    model = models.ColBERT(
        modules=[transformer, dense],
        device="cpu",
        query_length=query_length,
        document_length=document_length,
        **recipe,
    )
    write_pylate(model, out)
    return model, out


def write_pylate(model, out: Path) -> Path:
    """A PyLate ColBERT of a Transformer and a Dense (no bias) written to `out` in PyLate's layout: the transformer
    at the top, the projection in 1_Dense, the query/document recipe in config_sentence_transformers.json."""
    import json

    from safetensors.torch import save_file

    transformer, dense = model[0], model[1]
    transformer.save(str(out))
    (out / "1_Dense").mkdir(exist_ok=True)
    save_file({k: v.contiguous() for k, v in dense.state_dict().items()}, out / "1_Dense" / "model.safetensors")
    dense_config = {
        "in_features": dense.in_features,
        "out_features": dense.out_features,
        "bias": False,
        "activation_function": "torch.nn.modules.linear.Identity",
    }
    (out / "1_Dense" / "config.json").write_text(json.dumps(dense_config))
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Dense", "type": "pylate.models.Dense.Dense"},
    ]
    (out / "modules.json").write_text(json.dumps(modules))
    keys = ("query_prefix", "document_prefix", "query_length", "document_length", "attend_to_expansion_tokens",
            "skiplist_words", "do_query_expansion")  # fmt: skip
    (out / "config_sentence_transformers.json").write_text(json.dumps({k: getattr(model, k) for k in keys}))
    return out


def save_special_tokenizer(folder: Path, minilm_path: Path, special: list[str]) -> dict[str, int]:
    """MiniLM's vocabulary plus a vision-language model's special tokens, nothing added around texts (as Qwen's
    and ColPaliProcessor's tokenization), saved in `folder`; returns the special tokens' ids."""
    from tokenizers import Tokenizer, processors

    tok = Tokenizer.from_file(str(minilm_path / "tokenizer.json"))
    tok.no_padding()
    tok.no_truncation()
    tok.add_special_tokens(special)
    tok.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1", special_tokens=[])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return {t: tok.token_to_id(t) for t in special}


def as_rgb(image, layout: str):
    """The layout's processor's RGB: colpali-engine's image.convert("RGB") keeps the colours under transparent
    pixels, transformers' convert_to_rgb puts them on white."""
    from PIL import Image

    if layout == "colpali-engine":
        return image.convert("RGB")
    return Image.alpha_composite(Image.new("RGBA", image.size, (255, 255, 255, 255)), image).convert("RGB")


COLQWEN2_SPECIAL = [
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "\n",  # a token of Qwen's vocabulary (BERT's drops it): transformers' ColQwen2 queries end with it
]


def save_colqwen2(folder: Path, minilm_path: Path, version: str = "2"):
    """A seeded transformers ColQwen2ForRetrieval (2 + 2 layers, 16-d vectors) with MiniLM's vocabulary plus
    Qwen2-VL's special tokens (no [CLS]/[SEP] around texts, as Qwen's tokenizer), a pixel budget of 4 to 64
    merged tokens per image; returns (the model, the special tokens' ids). `version` "2.5": on Qwen2.5-VL
    (ColQwen2.5), its vision tower of 3 blocks with windows of 2 x 2 merge groups, block 1 over whole images."""
    import json

    from transformers import ColQwen2Config, ColQwen2ForRetrieval, Qwen2_5_VLConfig, Qwen2VLConfig

    ids = save_special_tokenizer(folder, minilm_path, COLQWEN2_SPECIAL)
    vision = (
        dict(depth=3, hidden_size=32, num_heads=2, intermediate_size=48, out_hidden_size=64, window_size=56,
             fullatt_block_indexes=[1])
        if version == "2.5"
        else dict(depth=2, embed_dim=32, num_heads=2, hidden_size=64, mlp_ratio=2)
    )  # fmt: skip
    vlm = (Qwen2_5_VLConfig if version == "2.5" else Qwen2VLConfig)(
        text_config=dict(vocab_size=30529, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}),
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )  # fmt: skip
    torch.manual_seed(0)
    model = ColQwen2ForRetrieval(ColQwen2Config(vlm_config=vlm, embedding_dim=16)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_q" in name:
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(folder)
    budget = {"min_pixels": 28 * 28 * 4, "max_pixels": 28 * 28 * 64}
    (folder / "preprocessor_config.json").write_text(json.dumps(budget))
    return model, ids


COLPALI_SPECIAL = ["<image>", "<bos>", "<pad>"]


def save_colpali(folder: Path, minilm_path: Path, layout: str = "transformers"):
    """A seeded transformers ColPaliForRetrieval (PaliGemma: a SigLIP tower of 2 blocks over 56 x 56 images, 16
    patches each; Gemma of 2 layers with one key/value head; 16-d vectors) with MiniLM's vocabulary plus
    PaliGemma's special tokens and no added tokens around texts (ColPaliProcessor writes <bos> itself); returns
    (the model, the special tokens' ids). `layout` "colpali-engine": its ColPali class's names and config."""
    import json

    from safetensors.torch import save_file
    from transformers import ColPaliConfig, ColPaliForRetrieval, GemmaConfig, PaliGemmaConfig, SiglipVisionConfig

    ids = save_special_tokenizer(folder, minilm_path, COLPALI_SPECIAL)
    text = GemmaConfig(vocab_size=30528, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=1, head_dim=16, max_position_embeddings=512,
                       pad_token_id=ids["<pad>"], bos_token_id=ids["<bos>"])  # fmt: skip
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                image_size=56, patch_size=14)  # fmt: skip
    vlm = PaliGemmaConfig(text_config=text, vision_config=vision, image_token_id=ids["<image>"], projection_dim=64)
    torch.manual_seed(0)
    model = ColPaliForRetrieval(ColPaliConfig(vlm_config=vlm, embedding_dim=16)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # Gemma's RMSNorm weights start at 0 (it scales by 1 + w)
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(folder)
    processor = {"image_seq_length": 16, "size": {"height": 56, "width": 56}, "image_mean": [0.5] * 3,
                 "image_std": [0.5] * 3, "resample": 3}  # fmt: skip
    (folder / "preprocessor_config.json").write_text(json.dumps(processor))
    if layout == "colpali-engine":  # ColPali(PaliGemmaPreTrainedModel): `model.` = PaliGemmaForConditionalGeneration
        state = {}
        for key, value in model.state_dict().items():
            key = key.replace("embedding_proj_layer.", "custom_text_proj.")
            key = key.replace("vlm.language_model.", "model.language_model.model.")
            key = key.replace("vlm.vision_tower.", "model.vision_tower.vision_model.").replace("vlm.", "model.")
            state[key] = value.contiguous()
        for f in folder.glob("model*.safetensors"):
            f.unlink()
        save_file(state, str(folder / "model.safetensors"))
        config = {**vlm.to_dict(), "architectures": ["ColPali"], "model_type": "paligemma"}
        (folder / "config.json").write_text(json.dumps(config))
    return model, ids


@contextlib.contextmanager
def serve_folder(folder: Path):
    """A real HTTP file server on loopback over `folder` (remote image URLs); yields its base URL. Two paths of
    its own: `/redirect?to=URL` answers 302 to URL, `/slow` sends a byte every 0.2 s for 10 s."""
    import functools
    import threading
    import time
    import urllib.parse
    from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, format, *args):  # noqa: A002 (the base class's name)
            pass

        def do_GET(self):
            path, _, query = self.path.partition("?")
            if path == "/redirect":
                self.send_response(302)
                self.send_header("Location", urllib.parse.parse_qs(query)["to"][0])
                self.end_headers()
            elif path == "/slow":
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.end_headers()
                try:
                    for _ in range(50):
                        self.wfile.write(b"x")
                        self.wfile.flush()
                        time.sleep(0.2)
                except OSError:  # the client gave up
                    pass
            else:
                super().do_GET()

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(folder)))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def save_tiny_m3(folder: Path, minilm_path: Path) -> Path:
    """A tiny random XLM-RoBERTa in bge-m3's layout (colbert_linear.pt, sparse_linear.pt, seeded): token vectors and
    sparse vectors from one pass. The sparse head's bias is +1 so that most tokens get a positive weight."""
    import json

    save_tiny_model("XLMRobertaModel", "XLMRobertaConfig", folder, minilm_path,
                    **dict(TINY, pad_token_id=1, type_vocab_size=1, max_position_embeddings=130))  # fmt: skip
    special = {"cls_token": "[CLS]", "sep_token": "[SEP]", "eos_token": "[SEP]", "pad_token": "[PAD]"}
    special |= {"unk_token": "[UNK]", "mask_token": "[MASK]", "tokenizer_class": "PreTrainedTokenizerFast"}
    (folder / "tokenizer_config.json").write_text(json.dumps(special))
    torch.manual_seed(1)
    torch.save(torch.nn.Linear(32, 32).state_dict(), folder / "colbert_linear.pt")
    sparse_head = torch.nn.Linear(32, 1)
    sparse_head.bias.data.fill_(1.0)
    torch.save(sparse_head.state_dict(), folder / "sparse_linear.pt")
    return folder
