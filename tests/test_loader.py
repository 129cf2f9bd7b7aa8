"""Configuration reading, including real-checkpoint layouts and quirks (resolution: test_resolve.py)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from polyvec import LLM
from polyvec.loader import _st_pooling_modes, load_model_config
from tests.helpers import TINY, cosine_rows, save_tiny_model


def test_st_pooling_mode_formats():
    assert _st_pooling_modes({"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": True}) == ("CLS", "MEAN")
    assert _st_pooling_modes({"pooling_mode": "lasttoken"}) == ("LAST",)
    assert _st_pooling_modes({"pooling_mode": ["weightedmean", "mean_sqrt_len_tokens"]}) == (
        "WEIGHTED_MEAN",
        "MEAN_SQRT_LEN",
    )
    with pytest.raises(ValueError, match="unknown sentence-transformers pooling mode"):
        _st_pooling_modes({"pooling_mode": "median"})
    with pytest.raises(ValueError, match="selects no pooling mode"):
        _st_pooling_modes({"pooling_mode_mean_tokens": False})


def test_minilm_config(minilm_path):
    cfg = load_model_config(minilm_path, dtype=torch.float32)
    assert cfg.architecture == "BertModel" and cfg.st_pooling == ("MEAN",)
    assert cfg.max_model_len == 256 and cfg.sources["max_model_len"].startswith("sentence_bert_config")
    assert cfg.max_position_len == 512 and cfg.embed_dim == 384
    cfg = load_model_config(minilm_path, dtype=torch.float32, max_model_len=512)
    assert cfg.max_model_len == 512 and cfg.sources["max_model_len"] == "argument"
    with pytest.raises(ValueError, match=r"max_model_len=600 is out of range; this model allows 1..512"):
        load_model_config(minilm_path, dtype=torch.float32, max_model_len=600)


def test_position_limit_of_fairseq_models(tmp_path, minilm_path):
    folder = save_tiny_model(
        "XLMRobertaModel",
        "XLMRobertaConfig",
        tmp_path,
        minilm_path,
        **dict(TINY, pad_token_id=1, type_vocab_size=1, max_position_embeddings=130),
    )
    cfg = load_model_config(folder, dtype=torch.float32)
    assert cfg.max_model_len == 128 and cfg.sources["max_model_len"].startswith("config.json")


def test_classifier_activation_rules(tmp_path, minilm_path):
    def cfg_for(**extra):
        folder = tmp_path / str(len(list(tmp_path.iterdir())))
        save_tiny_model("BertForSequenceClassification", "BertConfig", folder, minilm_path, **TINY, **extra)
        return load_model_config(folder, dtype=torch.float32)

    assert cfg_for(num_labels=3).classifier_activation == "softmax"
    assert cfg_for(num_labels=1).classifier_activation == "sigmoid"
    assert cfg_for(num_labels=3, problem_type="multi_label_classification").classifier_activation == "sigmoid"
    ce = cfg_for(num_labels=1, sentence_transformers={"activation_fn": "torch.nn.modules.linear.Identity"})
    assert ce.classifier_activation == "identity"


def test_legacy_sentence_transformers_subfolder_layout(tmp_path, minilm_path, minilm_llm):
    """Old ST layouts keep the transformer in 0_Transformer/ with its own config and weights."""
    root = tmp_path / "legacy"
    shutil.copytree(minilm_path, root / "0_Transformer", ignore=shutil.ignore_patterns("1_Pooling", "modules.json"))
    shutil.copytree(minilm_path / "1_Pooling", root / "1_Pooling")
    (root / "modules.json").write_text(
        json.dumps(
            [
                {"idx": 0, "name": "0", "path": "0_Transformer", "type": "sentence_transformers.models.Transformer"},
                {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            ]
        )
    )
    llm = LLM(str(root), dtype="float32")
    assert llm.model_config.transformer_dir == root / "0_Transformer"
    a = llm.embed("legacy layout", use_tqdm=False)[0].outputs.data
    b = minilm_llm.embed("legacy layout", use_tqdm=False)[0].outputs.data
    assert torch.allclose(a, b, atol=1e-6)


def test_pytorch_bin_weights_and_missing_prefix(tmp_path, minilm_path, minilm_llm):
    """A .bin checkpoint whose keys carry the task prefix ("bert.") loads like the safetensors one."""
    from safetensors.torch import load_file

    folder = tmp_path / "bin"
    shutil.copytree(minilm_path, folder, ignore=shutil.ignore_patterns("model.safetensors"))
    state = {f"bert.{k}": v for k, v in load_file(minilm_path / "model.safetensors").items()}
    torch.save(state, folder / "pytorch_model.bin")
    llm = LLM(str(folder), dtype="float32")
    a = llm.embed("weights from a pickle", use_tqdm=False)[0].outputs.data
    b = minilm_llm.embed("weights from a pickle", use_tqdm=False)[0].outputs.data
    assert cosine_rows(a[None], b[None]).item() >= 0.999999


def test_missing_weights_are_reported(tmp_path, minilm_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "broken"
    shutil.copytree(minilm_path, folder)
    state = load_file(folder / "model.safetensors")
    del state["encoder.layer.3.output.dense.weight"]
    save_file(state, folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"no weights for: encoder\.layers\.3\.ffn_down\.weight"):
        LLM(str(folder))


def test_unsupported_architecture(tmp_path, minilm_path):
    folder = tmp_path / "gpt"
    shutil.copytree(minilm_path, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (folder / "modules.json").unlink()
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="architecture 'GPT2LMHeadModel' is not supported; supported: BertModel"):
        LLM(str(folder))
