"""int8 projections (`quantization="int8"`): the quantize / dequantize passes, the linear, the whole model.

References: the float formulas in torch, float32 polyvec (itself golden-tested against sentence-transformers).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from polyvec.layers import kernels
from polyvec.layers.linear import Int8Linear, int8_available, int8_dot_products

pytestmark = pytest.mark.skipif(
    not int8_available(torch.device("cpu")), reason="needs PyTorch with oneDNN and a C++ compiler for polyvec's kernels"
)
# int8 matmuls are exact only with VNNI or AMX; elsewhere quantization="int8" is refused (tested below).
needs_vnni = pytest.mark.skipif(not int8_dot_products(), reason="this CPU has no VNNI or AMX int8 dot products")


def _dequantize(q, scale, offset):
    return q.float() * scale + offset


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [384, 40, 1536])
def test_quantize_rows_error_is_half_a_level(dtype, k):
    torch.manual_seed(0)
    x = (torch.randn(37, k) * torch.rand(37, 1) * 10 + torch.randn(37, 1)).to(dtype)
    q, scale, offset = torch.ops.polyvec.quantize_rows(x)
    assert q.dtype == torch.uint8 and scale.shape == (37, 1) and offset.shape == (37, 1)
    err = (_dequantize(q, scale, offset) - x.float()).abs()
    assert (err <= scale * 0.5 * (1 + 1e-4) + 1e-7).all()
    # every row uses its whole grid: its minimum maps to level 0 and its maximum to 255
    assert (q.amin(1) == 0).all() and (q.amax(1) == 255).all()


def test_quantize_rows_is_per_row_and_handles_constant_rows():
    x = torch.randn(8, 64)
    x[3] = 2.5  # a constant row: no range, quantized exactly
    q, scale, offset = torch.ops.polyvec.quantize_rows(x)
    assert scale[3].item() == 0 and offset[3].item() == 2.5
    assert torch.equal(_dequantize(q, scale, offset)[3], x[3])
    q1, s1, o1 = torch.ops.polyvec.quantize_rows(x[5:6])
    assert torch.equal(q1, q[5:6]) and torch.equal(s1, scale[5:6]) and torch.equal(o1, offset[5:6])


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act,ref_act", [(0, lambda v: v), (1, F.gelu), (2, lambda v: F.gelu(v, approximate="tanh"))])
@pytest.mark.parametrize("n", [384, 24])
def test_dequantize_rows_matches_the_formula(out_dtype, act, ref_act, n):
    torch.manual_seed(1)
    y, scale, offset = torch.randn(19, n) * 50, torch.rand(19, 1) / 10, torch.randn(19, 1)
    colsum, bias = torch.randn(n), torch.randn(n)
    ref = ref_act(y * scale + offset * colsum + bias)
    out = torch.ops.polyvec.dequantize_rows(y, scale, offset, colsum, bias, None, act, out_dtype)
    assert out.dtype == out_dtype
    tol = 1e-5 if out_dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
    if act == 0:
        residual = torch.randn(19, n).to(out_dtype)
        out = torch.ops.polyvec.dequantize_rows(y, scale, offset, colsum, None, residual, 0, out_dtype)
        ref = y * scale + offset * colsum + residual.float()
        torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("act", [1, 2])
@pytest.mark.parametrize("n", [1536, 40])
def test_requantize_rows_is_dequantize_then_quantize(act, n):
    torch.manual_seed(3)
    y, scale, offset = torch.randn(21, n) * 40, torch.rand(21, 1) / 10, torch.randn(21, 1)
    colsum, bias = torch.randn(n), torch.randn(n)
    h = torch.ops.polyvec.dequantize_rows(y, scale, offset, colsum, bias, None, act, torch.float32)
    expected = torch.ops.polyvec.quantize_rows(h)
    for got, want in zip(torch.ops.polyvec.requantize_rows(y, scale, offset, colsum, bias, act), expected):
        assert torch.equal(got, want)


@needs_vnni
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", [None, "gelu"])
def test_int8_linear_close_to_float_and_batch_invariant(dtype, activation):
    torch.manual_seed(2)
    linear = torch.nn.Linear(384, 1536)
    x = torch.randn(300, 384).to(dtype)
    ref = linear(x.float())
    if activation:
        ref = F.gelu(ref)
    layer = Int8Linear(linear, activation)
    out = layer(x)
    assert out.dtype == dtype and out.shape == ref.shape
    assert F.cosine_similarity(out.float(), ref, dim=-1).min() > 0.999
    # integer products are exact and every scale is per row: a row's output is bit-identical alone
    for i in (0, 137, 299):
        assert torch.equal(layer(x[i : i + 1].contiguous())[0], out[i])
    if activation and dtype == torch.float32:  # straight to the next int8 layer's grid: as quantizing the output
        for got, want in zip(layer.forward_requantized(x), torch.ops.polyvec.quantize_rows(out)):
            assert torch.equal(got, want)
    residual = torch.randn(300, 1536).to(dtype)
    plain = Int8Linear(linear)
    torch.testing.assert_close(
        plain.forward_add(x, residual).float(),
        (plain(x) + residual).float(),
        atol=2e-2 if dtype == torch.bfloat16 else 1e-5,
        rtol=1e-2,
    )


@needs_vnni
def test_int8_model_cosine_against_float32(minilm_path, minilm_llm, cranfield_texts):
    """The promise of quantization="int8": every pooled and per-token vector at cosine ≥ 0.99 of float32."""
    from polyvec import LLM

    llm = LLM(str(minilm_path), dtype="float32", quantization="int8")
    assert kernels.load() and llm.engine.runner.int8
    ref = torch.stack([o.outputs.data for o in minilm_llm.embed(cranfield_texts, use_tqdm=False)])
    out = torch.stack([o.outputs.data for o in llm.embed(cranfield_texts, use_tqdm=False)])
    cos = F.cosine_similarity(out, ref, dim=-1)
    assert cos.min() >= 0.99 and cos.mean() >= 0.997, (cos.min(), cos.mean())
    assert not torch.equal(out, ref)  # the int8 path really ran
    texts = cranfield_texts[:12]
    ref_tok = [o.outputs.data for o in minilm_llm.token_embed(texts, use_tqdm=False)]
    out_tok = [o.outputs.data for o in llm.token_embed(texts, use_tqdm=False)]
    tok_cos = torch.cat([F.cosine_similarity(a, b, dim=-1) for a, b in zip(out_tok, ref_tok)])
    assert tok_cos.min() >= 0.99, tok_cos.min()
    # a text's vector does not depend on what else is in the batch
    alone = llm.embed(cranfield_texts[7], use_tqdm=False)[0].outputs.data
    assert torch.equal(alone, out[7])


@needs_vnni
def test_int8_bfloat16_activations(minilm_path, minilm_llm, cranfield_texts):
    from polyvec import LLM

    llm = LLM(str(minilm_path), dtype="bfloat16", quantization="int8")
    # the int8 matmuls write float32: the budget keeps that under glibc's mmap ceiling, as float32 does
    assert llm.engine.engine_config.max_num_batched_tokens == 4096
    texts = cranfield_texts[:20]
    ref = torch.stack([o.outputs.data for o in minilm_llm.embed(texts, use_tqdm=False)])
    out = torch.stack([o.outputs.data.float() for o in llm.embed(texts, use_tqdm=False)])
    assert F.cosine_similarity(out, ref, dim=-1).min() >= 0.99


def test_quantization_argument_is_validated(minilm_path):
    from polyvec import LLM

    with pytest.raises(ValueError, match="quantization"):
        LLM(str(minilm_path), dtype="float32", quantization="int4")
    from polyvec.platforms import KernelOptions

    for off in (KernelOptions(onednn=False), KernelOptions(native=False)):
        with pytest.raises(ValueError, match="quantization='int8' needs"):
            LLM(str(minilm_path), dtype="float32", quantization="int8", kernels=off)


_CAPPED = """
import torch
from torch import nn
from polyvec import LLM
from polyvec.layers.linear import Int8Linear
torch.manual_seed(0)
lin = nn.Linear(384, 1536).requires_grad_(False)
x = torch.randn(64, 384) * 3
print(float(torch.nn.functional.cosine_similarity(Int8Linear(lin)(x), lin(x), dim=-1).min()))
try:
    LLM({model!r}, dtype="float32", quantization="int8")
except ValueError as exc:
    print(exc)
"""


def test_int8_refused_where_onednn_has_no_int8_dot_products(minilm_path):
    """oneDNN capped below VNNI (as on a CPU without it): the int8 sums saturate, so int8 is refused."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX512_CORE")
    script = _CAPPED.format(model=str(minilm_path))
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    cosine, message = run.stdout.strip().split("\n", 1)
    assert float(cosine) < 0.99  # what the refusal spares the user (> 0.999 with VNNI: the linear test above)
    assert "quantization='int8' needs a CPU with int8 dot products (AVX512-VNNI, AVX-VNNI or AMX)" in message


@needs_vnni
def test_int8_decoder_chunked_prefill(tmp_path, minilm_path):
    """Decoders quantize the same seven projections; chunked prefill with int8 keys/values still agrees."""
    from polyvec import LLM
    from tests.models.test_decoder_parity import prompts, save_decoder

    save_decoder("qwen3", "ForCausalLM", tmp_path, minilm_path)
    token_prompts = [{"prompt_token_ids": p} for p in prompts()]
    ref = LLM(str(tmp_path), dtype="float32", enable_prefix_caching=False)
    ref_out = torch.stack([o.outputs.data for o in ref.embed(token_prompts, use_tqdm=False)])
    for budget in (None, 16):
        llm = LLM(
            str(tmp_path),
            dtype="float32",
            max_num_batched_tokens=budget,
            enable_prefix_caching=False,
            quantization="int8",
        )
        out = torch.stack([o.outputs.data for o in llm.embed(token_prompts, use_tqdm=False)])
        assert F.cosine_similarity(out, ref_out, dim=-1).min() >= 0.99
        assert not torch.equal(out, ref_out)
