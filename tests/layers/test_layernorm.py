"""polyvec's LayerNorm kernel (layers/csrc/layer_norm.cpp) against PyTorch's, and its use in the encoders."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from polyvec.layers import kernels
from polyvec.layers.layernorm import LayerNorm

pytestmark = pytest.mark.skipif(not kernels.load(), reason="the native kernels are not built here")


@pytest.mark.parametrize("hidden", [384, 768, 100, 7])  # whole vectors, and a scalar tail
def test_float32_matches_pytorch(hidden):
    torch.manual_seed(hidden)
    x = torch.randn(37, hidden) * 4 + 2
    w, b = torch.randn(hidden), torch.randn(hidden)
    out = torch.ops.polyvec.layer_norm(x, w, b, 1e-12)
    torch.testing.assert_close(out, F.layer_norm(x, (hidden,), w, b, 1e-12), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("hidden", [384, 100])
def test_bfloat16_is_float32_rounded_once(hidden):
    """bf16 rows are normalized in float32 and rounded once: within one bf16 step of the float32 result."""
    torch.manual_seed(0)
    x = (torch.randn(64, hidden) * 3).bfloat16()
    w, b = torch.randn(hidden).bfloat16(), torch.randn(hidden).bfloat16()
    out = torch.ops.polyvec.layer_norm(x, w, b, 1e-12)
    assert out.dtype == torch.bfloat16
    exact = F.layer_norm(x.float(), (hidden,), w.float(), b.float(), 1e-12)
    assert ((out.float() - exact).abs() <= exact.abs() * 2**-8 + 1e-6).all()
    torch.testing.assert_close(out.float(), F.layer_norm(x, (hidden,), w, b, 1e-12).float(), atol=0.02, rtol=0.01)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_does_not_depend_on_the_others(dtype):
    """Rows are normalized 16 at a time (their reductions share instructions): any row, alone or in any
    place of a block, gets the same bits."""
    torch.manual_seed(1)
    x, w, b = (torch.randn(100, 384) * 3).to(dtype), torch.randn(384).to(dtype), torch.randn(384).to(dtype)
    whole = torch.ops.polyvec.layer_norm(x, w, b, 1e-5)
    for i in (0, 40, 47, 99):
        assert torch.equal(whole[i : i + 1], torch.ops.polyvec.layer_norm(x[i : i + 1], w, b, 1e-5))
        assert torch.equal(whole[i : i + 3], torch.ops.polyvec.layer_norm(x[i : i + 3], w, b, 1e-5))


def test_module_uses_the_kernel_only_when_told():
    norm = LayerNorm(384, eps=1e-12)
    torch.nn.init.normal_(norm.weight)
    x = torch.randn(5, 384)
    ref = norm(x)
    norm.native = True
    torch.testing.assert_close(norm(x), ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(norm(x.view(1, 5, 384))[0], ref)  # not 2-D: PyTorch's


def test_encoders_use_the_kernel_on_cpu(minilm_llm):
    norms = [m for m in minilm_llm.engine.runner.model.modules() if isinstance(m, LayerNorm)]
    assert len(norms) == 13 and all(m.native for m in norms)  # embeddings + 2 per layer


def test_rejects_other_dtypes():
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        torch.ops.polyvec.layer_norm(torch.randn(2, 8, dtype=torch.float64), torch.ones(8), torch.zeros(8), 1e-5)
