"""bf16 projections of small batches on AMX (layers/csrc/amx_linear.cpp, layers/linear.py) against oneDNN's
prepacked matmul and a float32 reference; the model path that uses them (short queries in bf16)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from polyvec import LLM
from polyvec.layers import kernels, linear
from polyvec.layers.linear import AMX_MAX_ROWS, PackedLinear, pack_amx_weight
from tests.helpers import cosine_rows

needs_amx = pytest.mark.skipif(
    not (torch.backends.mkldnn.is_available() and kernels.amx_linear_available()),
    reason="needs a CPU with AMX-BF16 (Sapphire Rapids on) and the native kernels",
)
SHAPES = [(384, 1152, None), (384, 1536, "gelu"), (1536, 384, None), (768, 3072, "gelu_new"), (64, 96, None)]


def _layer(k: int, n: int, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    lin = nn.Linear(k, n)
    nn.init.normal_(lin.weight, std=k**-0.5)
    nn.init.normal_(lin.bias, std=0.5)
    return lin.bfloat16()


def test_packed_layout_is_the_b_tile_layout():
    """packed[nb, kb, r, 2c + e] = W[16 nb + c, 32 kb + 2 r + e]: 16 input pairs x 16 outputs per tile."""
    w = torch.arange(64 * 96, dtype=torch.float32).view(64, 96)
    p = pack_amx_weight(w)
    assert p.shape == (4, 3, 16, 32)
    for nb, kb, r, c, e in [(0, 0, 0, 0, 0), (0, 0, 0, 0, 1), (1, 2, 5, 7, 1), (3, 1, 15, 15, 0), (2, 0, 3, 9, 1)]:
        assert p[nb, kb, r, 2 * c + e] == w[16 * nb + c, 32 * kb + 2 * r + e]


@needs_amx
@pytest.mark.parametrize("k,n,act", SHAPES)
@pytest.mark.parametrize("rows", [1, 10, 16, 17, 33, 64])
def test_matches_onednn_and_float32(k, n, act, rows):
    lin = _layer(k, n, rows)
    amx, onednn = PackedLinear(lin, act, amx=True), PackedLinear(lin, act)
    assert amx.amx_weight is not None and onednn.amx_weight is None
    x = (torch.randn(rows, k) * 2).bfloat16()
    y = amx(x)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, n)
    exact = x.float() @ lin.weight.float().T + lin.bias.float()
    if act:
        exact = torch.nn.functional.gelu(exact, approximate="none" if act == "gelu" else "tanh")
    # Products of bf16 values are exact and summed in float32: one rounding to bf16 from float32's result.
    assert ((y.float() - exact).abs() <= exact.abs() * 2**-8 + 1e-4).all()
    # oneDNN's AMX kernel does the same sums: the same bits nearly everywhere (its own K-split for some shapes
    # may move a last bit); the two GELU approximations round to neighbouring bf16 values at most.
    other = onednn(x)
    if act is None:
        assert (y == other).float().mean() >= 0.999
    assert ((y.float() - other.float()).abs() <= other.float().abs() * 2**-7 + 1e-4).all()


@needs_amx
@pytest.mark.parametrize("k,n", [(384, 384), (1536, 384)])
def test_residual_add(k, n):
    lin = _layer(k, n)
    amx, onednn = PackedLinear(lin, amx=True), PackedLinear(lin)
    x, res = torch.randn(10, k).bfloat16(), torch.randn(10, n).bfloat16()
    y = amx.forward_add(x, res)
    exact = x.float() @ lin.weight.float().T + lin.bias.float() + res.float()
    assert ((y.float() - exact).abs() <= exact.abs() * 2**-8 + 1e-4).all()
    assert (y == onednn.forward_add(x, res)).float().mean() >= 0.999


@needs_amx
def test_a_row_does_not_depend_on_the_others():
    lin = _layer(384, 1536)
    amx = PackedLinear(lin, "gelu", amx=True)
    x = torch.randn(AMX_MAX_ROWS, 384).bfloat16()
    whole = amx(x)
    for i in (0, 15, 16, 31, 40, AMX_MAX_ROWS - 1):
        assert torch.equal(amx(x[i : i + 1]), whole[i : i + 1])


@needs_amx
def test_empty_and_strided_inputs():
    lin = _layer(384, 384)
    amx = PackedLinear(lin, amx=True)
    assert amx(torch.empty(0, 384, dtype=torch.bfloat16)).shape == (0, 384)
    x = torch.randn(10, 768).bfloat16()[:, ::2]  # a strided view: copied to contiguous rows first
    assert torch.equal(amx(x), amx(x.contiguous()))


@needs_amx
def test_large_batches_go_to_onednn(monkeypatch):
    amx = PackedLinear(_layer(384, 384), amx=True)
    amx.amx_weight = torch.zeros_like(amx.amx_weight)  # a wrong weight shows which path ran
    x = torch.randn(AMX_MAX_ROWS + 1, 384).bfloat16()
    assert amx(x).abs().max() > 1  # oneDNN, the real weight
    assert amx(x[:AMX_MAX_ROWS]).float().sub(amx.bias.float()).abs().max() == 0  # AMX: bias only
    monkeypatch.setattr(linear, "AMX_MAX_ROWS", 0)
    assert amx(x[:1]).abs().max() > 1


@needs_amx
def test_rejects_bad_inputs():
    amx = PackedLinear(_layer(384, 384), amx=True)
    with pytest.raises(RuntimeError, match="bfloat16"):
        torch.ops.polyvec.amx_linear(torch.randn(4, 384), amx.amx_weight, amx.amx_bias, None, 0)
    with pytest.raises(RuntimeError, match="features"):
        torch.ops.polyvec.amx_linear(torch.randn(4, 352).bfloat16(), amx.amx_weight, amx.amx_bias, None, 0)
    with pytest.raises(RuntimeError, match="residual"):
        torch.ops.polyvec.amx_linear(
            torch.randn(4, 384).bfloat16(), amx.amx_weight, amx.amx_bias, torch.randn(3, 384).bfloat16(), 0
        )


def test_ineligible_layers_keep_one_copy():
    """float32, shapes the tiles do not take, activations the epilogue does not apply: oneDNN alone."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("needs oneDNN")
    assert PackedLinear(nn.Linear(384, 384), amx=True).amx_weight is None  # float32
    assert PackedLinear(_layer(384, 100), amx=True).amx_weight is None  # outputs not a multiple of 32
    assert PackedLinear(_layer(384, 384), "relu", amx=True).amx_weight is None


@pytest.fixture(scope="module")
def minilm_bf16(minilm_path):
    return LLM(str(minilm_path), dtype="bfloat16")


def test_bf16_engine_enables_it_where_there_is_amx(minilm_bf16, minilm_llm):
    layers = [m for m in minilm_bf16.engine.runner.model.modules() if isinstance(m, PackedLinear)]
    assert len(layers) == 24
    assert all((m.amx_weight is not None) is kernels.amx_linear_available() for m in layers)
    assert not any(
        m.amx_weight is not None for m in minilm_llm.engine.runner.model.modules() if isinstance(m, PackedLinear)
    )  # float32


def test_short_queries_alone_and_in_a_batch(minilm_bf16, minilm_llm, cranfield_texts, monkeypatch):
    """A query alone (the AMX path where there is one) vs inside a batch of documents (oneDNN) vs float32:
    the same vector to bf16 rounding."""
    queries = ["boundary layer transition", "what is the heat transfer of a blunt body at hypersonic speed"]
    alone = torch.stack([minilm_bf16.embed(q, use_tqdm=False)[0].outputs.data for q in queries])
    batch = torch.stack([o.outputs.data for o in minilm_bf16.embed(queries + cranfield_texts, use_tqdm=False)][:2])
    ref = torch.stack([o.outputs.data for o in minilm_llm.embed(queries, use_tqdm=False)])
    monkeypatch.setattr(linear, "AMX_MAX_ROWS", 0)
    onednn = torch.stack([minilm_bf16.embed(q, use_tqdm=False)[0].outputs.data for q in queries])
    assert cosine_rows(alone, batch).min() >= 0.9999
    assert cosine_rows(alone, onednn).min() >= 0.9999
    assert cosine_rows(alone, ref).min() >= 0.999
    tokens = minilm_bf16.token_embed(queries[1], use_tqdm=False)[0].outputs.data
    tokens_in_batch = minilm_bf16.token_embed([queries[1]] + cranfield_texts, use_tqdm=False)[0].outputs.data
    assert cosine_rows(tokens, tokens_in_batch).min() >= 0.999


def test_bf16_decoder_in_small_chunks(tmp_path, minilm_path):
    """A decoder's projections (q / k / v of different widths, gate / up / down) on the small-batch path:
    16-token chunks, against transformers in float32."""
    import torch.nn.functional as F

    from tests.models.test_decoder_parity import prompts, reference_hidden, save_decoder

    model = save_decoder("qwen3", "ForCausalLM", tmp_path, minilm_path)
    llm = LLM(str(tmp_path), dtype="bfloat16", max_num_batched_tokens=16, enable_prefix_caching=False)
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, PackedLinear)]
    assert layers and all((m.amx_weight is not None) is kernels.amx_linear_available() for m in layers)
    ps = prompts()
    for p, out in zip(ps, llm.token_embed([{"prompt_token_ids": p} for p in ps], use_tqdm=False)):
        ref = F.normalize(reference_hidden(model, p), dim=-1)
        assert cosine_rows(out.outputs.data, ref).min() >= 0.999
