"""PEFT LoRA adapters on a base checkpoint (colpali-engine's ColQwen releases: an adapter naming its base),
merged at load time, against PEFT's own merge_and_unload on the same weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from polyvec import LLM
from tests.helpers import cosine_rows, save_colpali, save_colqwen2

peft = pytest.importorskip("peft")


def _adapter(model, folder: Path, base: Path, **config):
    """A LoRA adapter on `model` with random A and B (PEFT starts B at zero, a merge that changes nothing),
    saved as PEFT saves it, naming `base` as its base model."""
    torch.manual_seed(7)
    wrapped = peft.get_peft_model(model, peft.LoraConfig(init_lora_weights="gaussian", **config))
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.05)
            elif p.requires_grad:  # trained whole (modules_to_save, biases): the adapter's copy differs
                p.add_(torch.randn_like(p) * 0.1)
    wrapped.save_pretrained(folder)
    cfg = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**cfg, "base_model_name_or_path": str(base)}))
    return wrapped.merge_and_unload()


def _vision_adapter(tmp_path, save, check, images, **config):
    """colpali-engine's release layout: an adapter (with the tokenizer and processor config) naming a full base;
    the merged model checked against PEFT's merge by `check`, and the merge shown to move the vectors."""
    base = tmp_path / "base"
    model, ids = save(base)
    base_docs = LLM(str(base), dtype="float32").token_embed(images, use_tqdm=False)
    adapter = tmp_path / "adapter"
    merged = _adapter(model, adapter, base, r=4, lora_alpha=8, **config)
    for name in ("tokenizer.json", "preprocessor_config.json"):
        shutil.copy(base / name, adapter)
    llm = LLM(str(adapter), dtype="float32")
    assert llm.engine.model_config.lora is not None and llm.engine.model_config.path == base.resolve()
    docs, _ = check(llm, merged, base, ids)  # per-token cosine >= 0.9999 to the merged reference
    changed = min(cosine_rows(d.outputs.data, b.outputs.data).min().item() for d, b in zip(docs, base_docs))
    assert changed < 0.99  # the adapter moved the vectors: the merge is not a no-op


LANGUAGE_MODEL = r".*(language_model).*(down_proj|gate_proj|up_proj|k_proj|q_proj|v_proj|o_proj).*$"


def test_colqwen2_adapter_on_base(tmp_path, minilm_path):
    """vidore/colqwen2-v1.0: LoRA on the language model's projections, the token projection (its own alpha)
    and the vision tower's qkv."""
    from tests.models.test_colqwen2 import _check_layout, _images

    _vision_adapter(
        tmp_path,
        lambda folder: save_colqwen2(folder, minilm_path),
        _check_layout,
        _images(),
        target_modules=rf"({LANGUAGE_MODEL}|.*(embedding_proj_layer).*$|.*visual.*qkv$)",
        alpha_pattern={"embedding_proj_layer": 2},
    )


def test_colpali_adapter_on_base(tmp_path, minilm_path):
    """vidore/colpali-v1.3: LoRA on Gemma's projections and the token projection."""
    from tests.models.test_colpali import _check, _images

    _vision_adapter(
        tmp_path,
        lambda folder: save_colpali(folder, minilm_path),
        _check,
        _images(),
        target_modules=rf"({LANGUAGE_MODEL}|.*(embedding_proj_layer).*$)",
    )


def _minilm_embeddings(model, path, texts):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    with torch.no_grad():
        batch = tok(texts, padding=True, return_tensors="pt")
        hidden = model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).float()
        return torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)


def test_text_adapter_rslora_and_modules_to_save(tmp_path, minilm_path):
    """A sentence-transformers base (MiniLM), rsLoRA scaling (alpha / √r), a module saved whole
    (`modules_to_save`), the tokenizer from the base; embeddings as transformers computes them from PEFT's merge."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(minilm_path).eval()
    merged = _adapter(
        model,
        tmp_path / "adapter",
        minilm_path,
        r=8,
        lora_alpha=16,
        use_rslora=True,
        target_modules=["query", "value", "dense"],
        modules_to_save=["embeddings.LayerNorm"],
    )
    original = AutoModel.from_pretrained(minilm_path).embeddings.LayerNorm.weight
    assert not torch.equal(merged.embeddings.LayerNorm.weight, original)
    texts = ["a lift coefficient", "flutter of wings at high speed"]
    want = _minilm_embeddings(merged, minilm_path, texts)
    got = torch.tensor([o.outputs.embedding for o in LLM(str(tmp_path / "adapter"), dtype="float32").embed(texts)])
    assert cosine_rows(got, want).min() >= 0.9999
    plain = torch.tensor([o.outputs.embedding for o in LLM(str(minilm_path), dtype="float32").embed(texts)])
    assert cosine_rows(got, plain).min() < 0.999


def test_an_adapter_beside_a_whole_model_is_merged_into_it(tmp_path, minilm_path):
    """PEFT's save_pretrained into a model's own folder (config.json and weights beside adapter_config.json):
    transformers and sentence-transformers load the local weights, then the adapter; polyvec loaded the weights
    alone (other vectors, silently). The adapter's base_model_name_or_path is not read."""
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel

    folder = tmp_path / "model"
    shutil.copytree(minilm_path, folder)
    _adapter(AutoModel.from_pretrained(minilm_path).eval(), folder, minilm_path, r=8, lora_alpha=8,
             use_rslora=True, target_modules=["query", "value"])  # fmt: skip
    texts = ["a lift coefficient", "flutter of wings at high speed"]
    want = SentenceTransformer(str(folder), device="cpu").encode(texts, convert_to_tensor=True)
    cfg = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**cfg, "base_model_name_or_path": "not/read"}))
    llm = LLM(str(folder), dtype="float32")
    assert llm.model_config.lora is not None and llm.model_config.path == folder.resolve()
    got = torch.stack([o.outputs.data for o in llm.embed(texts, use_tqdm=False)])
    assert cosine_rows(got, want).min() >= 0.9999
    plain = torch.stack([o.outputs.data for o in LLM(str(minilm_path), dtype="float32").embed(texts, use_tqdm=False)])
    assert cosine_rows(got, plain).min() < 0.999


@pytest.mark.parametrize("bias", ["all", "lora_only"])
def test_text_adapter_with_trained_biases(tmp_path, minilm_path, bias):
    """bias="all" / "lora_only": PEFT saves an adapted layer's bias as `<layer>.base_layer.bias` (and, for "all",
    the other layers' as `<layer>.bias`); each replaces the base's, as in PEFT's merge."""
    from transformers import AutoModel

    merged = _adapter(
        AutoModel.from_pretrained(minilm_path).eval(),
        tmp_path / "adapter",
        minilm_path,
        r=4,
        lora_alpha=8,
        target_modules=["query", "value"],
        bias=bias,
    )
    from safetensors.torch import load_file

    keys = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert any(".base_layer.bias" in k for k in keys)
    texts = ["a lift coefficient", "flutter of wings at high speed"]
    want = _minilm_embeddings(merged, minilm_path, texts)
    got = torch.tensor([o.outputs.embedding for o in LLM(str(tmp_path / "adapter"), dtype="float32").embed(texts)])
    assert cosine_rows(got, want).min() >= 0.9999


def test_adapters_polyvec_cannot_merge_are_refused(tmp_path, minilm_path):
    folder = tmp_path / "adapter"
    folder.mkdir()
    cfg = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["query"]}
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="names no base_model_name_or_path"):
        LLM(str(folder))
    refused = [("use_dora", True), ("peft_type", "IA3"), ("trainable_token_indices", [5, 6])]
    refused += [("alora_invocation_tokens", [2023, 2003]), ("arrow_config", {"top_k": 2})]  # merged everywhere before
    for key, value in refused:
        (folder / "adapter_config.json").write_text(
            json.dumps({**cfg, key: value, "base_model_name_or_path": str(minilm_path)})
        )
        with pytest.raises(ValueError, match=key):
            LLM(str(folder))
    (folder / "adapter_config.json").write_text(json.dumps({**cfg, "base_model_name_or_path": str(minilm_path)}))
    from safetensors.torch import save_file

    save_file(
        {
            "base_model.model.encoder.layer.0.nope.lora_A.weight": torch.zeros(4, 384),
            "base_model.model.encoder.layer.0.nope.lora_B.weight": torch.zeros(384, 4),
        },
        str(folder / "adapter_model.safetensors"),
    )
    with pytest.raises(ValueError, match="encoder.layer.0.nope.weight"):
        LLM(str(folder))
