"""The CUDA platform's choices (no prepacking, SDPA over a padded grid, no buckets, vLLM's auto dtype, no int8),
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
    with pytest.raises(ValueError, match="quantization='int8' runs on CPU only"):
        LLM(str(minilm_path), dtype="float32", quantization="int8")


@pytest.mark.parametrize(
    "capability,checkpoint,model_type,expected",
    [
        ((8, 0), "float32", "bert", torch.float16),  # vLLM's pooling rule: float32 checkpoints in float16
        ((8, 0), None, "bert", torch.float16),
        ((8, 0), "bfloat16", "qwen3", torch.bfloat16),
        ((7, 5), "bfloat16", "qwen3", torch.float16),  # a T4 has no bfloat16
        ((8, 0), "float16", "bert", torch.float16),
        ((8, 0), "float32", "gemma3", torch.bfloat16),  # unstable in float16
        ((7, 0), "bfloat16", "gemma2", torch.float32),
    ],
)
def test_cuda_auto_dtype_is_vllms(monkeypatch, capability, checkpoint, model_type, expected):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert CudaPlatform(torch.device("cuda")).default_dtype(checkpoint, model_type) == expected


def test_cuda_auto_dtype_reads_the_checkpoint(cuda_platform_on_cpu, monkeypatch, minilm_path):
    """The factory passes config.json's dtype to the platform (MiniLM's is float32: float16 on CUDA)."""
    from polyvec.engine import factory

    monkeypatch.setattr(factory, "get_platform", lambda device, kernels=None: CudaPlatform(device))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert LLM(str(minilm_path)).model_config.dtype == torch.float16
    llm = LLM(str(minilm_path), hf_overrides={"torch_dtype": "bfloat16"})
    assert llm.model_config.dtype == torch.bfloat16


def test_int8_on_cuda_refused_before_the_model_is_read(monkeypatch, tmp_path):
    from polyvec.engine import factory

    monkeypatch.setattr(factory, "get_platform", lambda device, kernels=None: CudaPlatform(device))
    with pytest.raises(ValueError, match="quantization='int8' runs on CPU only"):
        LLM(str(tmp_path / "no-such-model"), quantization="int8")  # refused before the path is looked at


def test_pooler_keeps_tensors_on_the_device():
    """Fake CUDA tensors (the device checks a GPU makes, without one): bge-m3's sparse weights with skipped
    ids and a subset of the batch, and the head of merged long-input windows, which come back on the CPU."""
    import dataclasses

    from torch._subclasses.fake_tensor import FakeTensorMode

    from polyvec.layers.attention import AttentionMetadata
    from polyvec.layers.pooler import Pooler, PoolingSpec

    meta = AttentionMetadata.build([3, 2], torch.device("cpu"))
    with FakeTensorMode(allow_non_fake_inputs=True):
        dev = torch.device("cuda:0")
        meta = dataclasses.replace(
            meta, cu_seqlens=meta.cu_seqlens.to(dev), positions=meta.positions.to(dev), seq_ids=meta.seq_ids.to(dev)
        )
        hidden, ids = torch.randn(5, 8, device=dev), torch.tensor([0, 5, 2, 0, 7]).to(dev)

        def linear(inp: int, out: int) -> nn.Module:  # nn.Linear's init cannot run on a fake CUDA tensor
            weight = torch.randn(out, inp, device=dev)
            return _Lambda(lambda x: x @ weight.T)

        sparse = linear(8, 1)
        pooler = Pooler(sparse_head=sparse, sparse_skip_ids=(0, 2), vocab_size=50, device=dev)
        spec = PoolingSpec(task="embed_sparse", pooling=())
        assert pooler._token_weights(spec, hidden, meta, [1], ids).device == dev
        heads = Pooler(embed_projection=linear(8, 4), sequence_head=linear(8, 2), device=dev)
        window_mean = torch.randn(8, device="cpu")
        for task in ("embed", "classify"):
            out = heads.apply_head(PoolingSpec(task=task, pooling=("MEAN",)), window_mean)
            assert out.device == dev and out.shape == ((4,) if task == "embed" else (2,))


class _Lambda(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def test_a_device_torch_cannot_give_is_a_value_error(monkeypatch):
    """A GPU index past the machine's (a bare AssertionError from torch, a traceback from the CLI) or a device
    string torch cannot read (a RuntimeError) is a ValueError naming the device, as the CLI reports them."""
    from polyvec.config import EngineConfig

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert EngineConfig(device="cuda:0").resolve_device() == torch.device("cuda:0")
    assert EngineConfig(device="cuda").resolve_device() == torch.device("cuda")
    with pytest.raises(ValueError, match=r"device='cuda:1': torch sees 1 CUDA device\(s\)"):
        EngineConfig(device="cuda:1").resolve_device()
    for bad in ("gpu", "cuda:x", "mps"):
        with pytest.raises(ValueError, match=f"device must be auto, cpu, cuda or cuda:N, got '{bad}'"):
            EngineConfig(device=bad).resolve_device()
