"""Checkpoint folders as the hub and users' own save_pretrained leave them: sharded pickles, older configs, a
tokenizer's length, and tensors of the wrong shape."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from polyvec import LLM
from polyvec.models.weights import read_state_dict


def _copy(minilm_path, folder, skip=()):
    folder.mkdir()
    for entry in minilm_path.iterdir():
        if entry.name not in skip:
            (folder / entry.name).symlink_to(entry.resolve())
    return folder


def _embed(llm, texts=("wing flutter at supersonic speed", "heat transfer")) -> torch.Tensor:
    return torch.stack([o.outputs.data for o in llm.embed(list(texts), use_tqdm=False)])


def test_sharded_pytorch_bin(minilm_path, minilm_llm, tmp_path):
    """pytorch_model-0000N-of-0000M.bin with its index (older save_pretrained, and hub repos that polyvec's
    download fetches so): 'no model.safetensors or pytorch_model.bin' after the download."""
    folder = _copy(minilm_path, tmp_path / "sharded-bin", skip=("model.safetensors", "pytorch_model.bin"))
    state = read_state_dict(minilm_path)
    names = sorted(state)
    halves = {"pytorch_model-00001-of-00002.bin": names[: len(names) // 2],
              "pytorch_model-00002-of-00002.bin": names[len(names) // 2 :]}  # fmt: skip
    for shard, keys in halves.items():
        torch.save({k: state[k] for k in keys}, folder / shard)
    weight_map = {k: shard for shard, keys in halves.items() for k in keys}
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert torch.equal(_embed(LLM(str(folder), dtype="float32")), _embed(minilm_llm))


def test_config_without_architectures_and_a_tokenizers_length(minilm_path, minilm_llm, tmp_path):
    """An older config.json without `architectures` is read by its model_type (as vLLM and transformers' auto
    classes do; it was refused); without modules.json the tokenizer's model_max_length caps the length, as in
    vLLM and sentence-transformers (it was max_position_embeddings)."""
    folder = _copy(minilm_path, tmp_path / "old", skip=("config.json", "tokenizer_config.json"))
    config = json.loads((minilm_path / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "architectures"}))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({**json.loads((minilm_path / "tokenizer_config.json").read_text()), "model_max_length": 64})
    )
    llm = LLM(str(folder), dtype="float32")
    assert llm.model_config.architecture == "BertModel"
    assert torch.allclose(_embed(llm), _embed(minilm_llm), atol=1e-6)  # modules.json's max_seq_length: 256 >= all
    bare = _copy(folder, tmp_path / "bare", skip=("modules.json", "sentence_bert_config.json", "1_Pooling"))
    llm = LLM(str(bare), dtype="float32")
    assert llm.model_config.max_model_len == 64
    assert llm.model_config.sources["max_model_len"] == "tokenizer_config.json model_max_length"
    # only for absolute positions, as vLLM reads it (a decoder's rotary positions keep max_position_embeddings)
    rotary = json.loads((bare / "config.json").read_text())
    (bare / "config.json").unlink()
    (bare / "config.json").write_text(json.dumps({k: v for k, v in rotary.items() if k != "position_embedding_type"}))
    assert LLM(str(bare), dtype="float32").model_config.max_model_len == 512
    (bare / "config.json").unlink()
    (bare / "config.json").write_text(json.dumps({"model_type": "t5"}))
    with pytest.raises(ValueError, match='names no architectures .*hf_overrides=.*"architectures"'):
        LLM(str(bare), dtype="float32")


def test_a_fused_projections_part_of_the_wrong_shape_is_named(minilm_path, tmp_path):
    """q, k and v fill one fused parameter: a query of half its rows loaded with no error (half the slice left
    uninitialised) and one of half its columns was a bare size-mismatch RuntimeError."""
    from safetensors.torch import save_file

    state = read_state_dict(minilm_path)
    key = "encoder.layer.0.attention.self.query.weight"
    for name, bad in (("rows", state[key][:192]), ("columns", state[key][:, :192])):
        folder = _copy(minilm_path, tmp_path / name, skip=("model.safetensors", "pytorch_model.bin"))
        save_file(
            {**{k: v.contiguous() for k, v in state.items()}, key: bad.contiguous()}, folder / "model.safetensors"
        )
        with pytest.raises(ValueError, match=rf"checkpoint tensor {key} has shape .*, the model expects \(384, 384\)"):
            LLM(str(folder), dtype="float32")
    shutil.rmtree(tmp_path / "rows")
