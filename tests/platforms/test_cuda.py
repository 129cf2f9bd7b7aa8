"""The CUDA platform's choices (no prepacking, SDPA over a padded grid, no buckets, bf16 default, no int8),
run here on a CPU device: the same code a GPU runs, less the device."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from polyvec import LLM
from polyvec.engine import model_runner
from polyvec.platforms.cuda import CudaPlatform
from tests.helpers import cosine_rows


@pytest.fixture
def cuda_platform_on_cpu(monkeypatch):
    monkeypatch.setattr(model_runner, "get_platform", lambda device, kernels=None: CudaPlatform(device))


def test_cuda_platform_matches_sentence_transformers(cuda_platform_on_cpu, minilm_path, st_minilm, cranfield_texts):
    llm = LLM(str(minilm_path), dtype="float32")
    runner = llm.engine.runner
    assert isinstance(runner.platform, CudaPlatform)
    assert runner.packed_attention is False and runner.pad_to_bucket is False
    assert type(runner.model.encoder.layers[0].qkv) is nn.Linear
    texts = cranfield_texts[:20] + ["", "x"]
    got = torch.stack([o.outputs.data for o in llm.embed(texts, use_tqdm=False)])
    ref = torch.from_numpy(st_minilm.encode(texts, normalize_embeddings=True))
    assert cosine_rows(got, ref).min() >= 0.9999
    alone = llm.embed(texts[3], use_tqdm=False)[0].outputs.data
    assert torch.allclose(alone, got[3], atol=1e-5)  # the padded grid does not leak between sequences


def test_cuda_platform_defaults(cuda_platform_on_cpu, minilm_path):
    platform = CudaPlatform(torch.device("cpu"))
    assert platform.default_dtype(None) == torch.bfloat16 and platform.default_dtype("float16") == torch.float16
    with pytest.raises(ValueError, match="quantization='int8' runs on CPU only"):
        LLM(str(minilm_path), dtype="float32", quantization="int8")
