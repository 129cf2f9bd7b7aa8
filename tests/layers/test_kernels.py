"""polyvec's native packed attention kernel (layers/csrc/varlen_attention.cpp) against SDPA per sequence.

The kernel builds with the compiler PyTorch's extension loader uses; where one is present (as on every
machine this project tests on) it must build, so the model tests exercise it and not only the SDPA fallback.
"""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from polyvec.layers import kernels
from polyvec.layers.attention import AttentionMetadata, varlen_attention

HAVE_COMPILER = shutil.which("c++") is not None and shutil.which("ninja") is not None
needs_kernel = pytest.mark.skipif(
    kernels._capability() not in kernels.VECTOR_WIDTH, reason="the kernel is built for AVX2/AVX-512 CPUs only"
)


def _reference(qkv, lens, heads, key_lens=None, bias=None, window=None):
    """SDPA in float32, one sequence at a time."""
    dim = qkv.shape[1] // (3 * heads)
    outs, start = [], 0
    for i, n in enumerate(lens):
        k_n = n if key_lens is None else key_lens[i]
        q, k, v = qkv[start : start + n].float().view(n, 3, heads, dim).permute(1, 2, 0, 3)
        mask = None if bias is None else bias.reshape(heads, -1, bias.shape[-1])[:, :n, :k_n].float()
        if window is not None:
            pos = torch.arange(n)
            mask = (pos[:, None] - pos[None, :k_n]).abs() <= window
        o = F.scaled_dot_product_attention(q, k[:, :k_n], v[:, :k_n], attn_mask=mask)
        outs.append(o.transpose(0, 1).reshape(n, heads * dim))
        start += n
    return torch.cat(outs)


@needs_kernel
def test_kernel_builds_where_a_compiler_is_present():
    assert kernels.load() is HAVE_COMPILER


@needs_kernel
@pytest.mark.parametrize("heads,dim", [(12, 32), (4, 64), (2, 16)])
@pytest.mark.parametrize("lens", [[1], [5, 16, 17, 33], [300, 2, 31, 64, 9]])
def test_kernel_equals_sdpa_per_sequence_float32(heads, dim, lens):
    if not kernels.load():
        pytest.fail("the kernel did not build")
    torch.manual_seed(0)
    qkv = torch.randn(sum(lens), 3 * heads * dim)
    cu = AttentionMetadata.build(lens, torch.device("cpu"), packed=True).cu_seqlens
    out = kernels.varlen_attention(qkv, cu, heads)
    ref = _reference(qkv, lens, heads)
    assert out.shape == ref.shape
    assert (out - ref).abs().max() < 2e-6


@needs_kernel
def test_kernel_key_lengths_and_bias():
    """Queries see only their sequence's first key_lens keys (ColBERT's unattended [MASK]s), plus an additive
    [1, heads, L, L] bias by position (MPNet's relative positions)."""
    assert kernels.load()
    torch.manual_seed(1)
    heads, dim, lens, key_lens = 4, 32, [20, 7, 45], [12, 7, 1]
    qkv = torch.randn(sum(lens), 3 * heads * dim)
    bias = torch.randn(1, heads, 45, 45)
    meta = AttentionMetadata.build(lens, torch.device("cpu"), key_lens, packed=True)
    assert meta.key_lens.tolist() == key_lens and meta.scatter_index is None and meta.key_mask is None
    out = varlen_attention(qkv, meta, heads, meta.attn_mask(bias))
    assert (out - _reference(qkv, lens, heads, key_lens, bias)).abs().max() < 2e-6
    # The SDPA grid path (CUDA, or no compiler) gives the same numbers.
    grid = AttentionMetadata.build(lens, torch.device("cpu"), key_lens)
    assert (varlen_attention(qkv, grid, heads, grid.attn_mask(bias)) - out).abs().max() < 2e-6


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "heads,dim,lens,key_lens,with_bias",
    [
        (12, 32, [70, 3, 128, 1, 33], None, False),
        (4, 64, [20, 7, 45], [12, 7, 1], True),  # key lengths (odd ones too) and a bias
        (2, 16, [9, 40], None, False),  # head_dim 16: the float32 path even where bf16 dot products exist
    ],
)
def test_kernel_half_precision_storage(dtype, heads, dim, lens, key_lens, with_bias):
    """bf16/fp16 in and out: as close to float32 attention on the same inputs as the output's rounding allows
    (bf16 with AVX512-BF16 and head_dim % 32 == 0 uses bf16 dot products, float32 elsewhere)."""
    assert kernels.load()
    torch.manual_seed(2)
    qkv = torch.randn(sum(lens), 3 * heads * dim).to(dtype)
    bias = torch.randn(1, heads, max(lens), max(lens)) if with_bias else None
    meta = AttentionMetadata.build(lens, torch.device("cpu"), key_lens, packed=True)
    out = kernels.varlen_attention(qkv, meta.cu_seqlens, heads, meta.key_lens, bias)
    assert out.dtype == dtype
    ref = _reference(qkv, lens, heads, key_lens, bias)  # on the same (rounded) inputs
    assert (out.float() - ref).abs().max() < 1e-2
    assert F.cosine_similarity(out.float(), ref, dim=-1).min() > 0.9999


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_output_of_a_sequence_does_not_depend_on_the_batch(dtype):
    """Alone (work split by head) or among 40 others (work split by sequence): bit-identical."""
    assert kernels.load()
    torch.manual_seed(3)
    heads, dim = 12, 32
    lens = [int(x) for x in torch.randint(1, 120, (40,))]
    qkv = torch.randn(sum(lens), 3 * heads * dim).to(dtype)
    out = kernels.varlen_attention(
        qkv, AttentionMetadata.build(lens, torch.device("cpu"), packed=True).cu_seqlens, heads
    )
    start = 0
    for n in lens[:5]:
        alone = kernels.varlen_attention(qkv[start : start + n].contiguous(), torch.tensor([0, n]), heads)
        assert torch.equal(alone, out[start : start + n])
        start += n


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("amx", [True, False])
@pytest.mark.parametrize("heads,dim", [(12, 64), (4, 32), (2, 16)])
def test_kernel_sliding_window(dtype, amx, heads, dim):
    """A bidirectional window (ModernBERT's local layers): keys at most `window` positions from the query; a
    sequence the window spans whole, one it cuts, and one much longer; equal to SDPA with the window's mask."""
    assert kernels.load()
    if not amx and not hasattr(torch.ops.polyvec, "set_amx_enabled"):
        pytest.skip("no AMX switch in this build")
    torch.manual_seed(5)
    lens, window = [9, 17, 300, 1, 40], 8
    qkv = torch.randn(sum(lens), 3 * heads * dim).to(dtype)
    cu = AttentionMetadata.build(lens, torch.device("cpu"), packed=True).cu_seqlens
    torch.ops.polyvec.set_amx_enabled(amx)
    try:
        out = kernels.varlen_attention(qkv, cu, heads, window=window)
    finally:
        torch.ops.polyvec.set_amx_enabled(True)
    ref = _reference(qkv, lens, heads, window=window)
    full = _reference(qkv, lens, heads)
    tol = 2e-6 if dtype == torch.float32 else 1e-2
    assert (out.float() - ref).abs().max() < tol
    assert (out.float() - full)[9:].abs().max() > 0.1  # the window changed the longer sequences
    assert torch.equal(out[:9], kernels.varlen_attention(qkv[:9].contiguous(), torch.tensor([0, 9]), heads))
    # the SDPA fallback (a padded grid) applies the same window
    meta = AttentionMetadata.build(lens, torch.device("cpu"), packed=False)
    grid = varlen_attention(qkv.float(), meta, heads, meta.attn_mask(), window=window)
    assert (grid - _reference(qkv.float(), lens, heads, window=window)).abs().max() < 2e-6


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rope_in_place_equals_rotate_halves(dtype):
    """torch.ops.polyvec.rope_ rotates q and k of a fused qkv in place, v untouched: as apply_rope computes it
    in float32, rounded once to the storage dtype."""
    from polyvec.models.decoder import apply_rope

    assert kernels.load()
    torch.manual_seed(6)
    rows, heads, dim = 37, 3, 64
    qkv = torch.randn(rows, 3 * heads * dim)
    angles = torch.rand(rows, dim // 2) * 50
    cos, sin = angles.cos(), angles.sin()
    full = [torch.cat((t, t), -1).unsqueeze(1) for t in (cos, sin)]
    parts = qkv.view(rows, 3, heads, dim)
    want = torch.cat([apply_rope(parts[:, 0], *full), apply_rope(parts[:, 1], *full), parts[:, 2]], 1)
    got = qkv.to(dtype)
    torch.ops.polyvec.rope_(got, cos, sin, heads)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert (got.float().view(rows, 3 * heads, dim) - want.view(rows, 3 * heads, dim)).abs().max() < tol * 4
    assert torch.equal(got.view(rows, 3, heads, dim)[:, 2], qkv.to(dtype).view(rows, 3, heads, dim)[:, 2])


@needs_kernel
def test_kernel_rejects_bad_shapes():
    assert kernels.load()
    with pytest.raises(RuntimeError, match="head_dim"):
        kernels.varlen_attention(torch.randn(4, 3 * 2 * 12), torch.tensor([0, 4]), 2)
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        kernels.varlen_attention(torch.randn(4, 3 * 2 * 16, dtype=torch.float64), torch.tensor([0, 4]), 2)


@needs_kernel
def test_models_use_the_kernel_on_cpu(minilm_llm):
    """The parity tests of the encoders run through the kernel (else they would test only the fallback)."""
    assert minilm_llm.engine.runner.packed_attention is HAVE_COMPILER


@needs_kernel
def test_bf16_paths_agree(tmp_path):
    """The bf16 paths chosen by CPU features (AMX tiles, AVX512-BF16 dot products, float32 vectors) give the
    same attention to bf16 rounding: this process uses the best one here, a child the next one down."""
    import subprocess
    import sys

    assert kernels.load()
    script = (
        "import sys, torch\n"
        "from polyvec.layers import kernels\n"
        "assert kernels.load()\n"
        "torch.ops.polyvec.set_amx_enabled(sys.argv[2] == 'amx')\n"
        "torch.manual_seed(4)\n"
        "lens = [70, 3, 128, 33]\n"
        "qkv = torch.randn(sum(lens), 3 * 12 * 32).bfloat16()\n"
        "cu = torch.tensor([0, 70, 73, 201, 234])\n"
        "torch.save((qkv, kernels.varlen_attention(qkv, cu, 12)), sys.argv[1])\n"
    )
    here, child = tmp_path / "here.pt", tmp_path / "child.pt"
    subprocess.run([sys.executable, "-c", script, str(child), "no-amx"], check=True)
    subprocess.run([sys.executable, "-c", script, str(here), "amx"], check=True)
    qkv, a = torch.load(here)
    _, b = torch.load(child)
    ref = _reference(qkv, [70, 3, 128, 33], 12)
    for out in (a, b):
        assert (out.float() - ref).abs().max() < 1e-2
    assert (a.float() - b.float()).abs().max() < 1e-2


def test_every_kernel_source_is_package_data():
    """A non-editable install compiles the kernels from the installed package: every file under csrc/ (the
    shared header included) must ship in it."""
    import fnmatch
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["polyvec"]
    csrc = Path(kernels.__file__).parent / "csrc"
    names = [p.name for p in csrc.iterdir() if p.is_file()]
    assert "cpu_common.h" in names
    for name in names:
        assert any(fnmatch.fnmatch(f"layers/csrc/{name}", pat) for pat in patterns), name


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_any_scale_sign(dtype):
    """The bf16 softmax takes its maximum over the raw scores when they order as the logits do (scale > 0);
    a negative scale must still give softmax(scale * q kᵀ) v."""
    assert kernels.load()
    torch.manual_seed(5)
    lens = [70, 3, 33]
    qkv = torch.randn(sum(lens), 3 * 12 * 32).to(dtype)
    cu = AttentionMetadata.build(lens, torch.device("cpu"), packed=True).cu_seqlens
    for scale in (32**-0.5, -(32**-0.5)):
        out = torch.ops.polyvec.varlen_attention(qkv, cu, None, None, 12, scale).float()
        ref, start = [], 0
        for n in lens:
            q, k, v = qkv[start : start + n].float().view(n, 3, 12, 32).permute(1, 2, 0, 3)
            o = F.scaled_dot_product_attention(q, k, v, scale=scale)
            ref.append(o.transpose(0, 1).reshape(n, 12 * 32))
            start += n
        assert (out - torch.cat(ref)).abs().max() < (1e-5 if dtype == torch.float32 else 2e-2)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dim", [32, 80])
def test_kernel_long_sequences(dtype, dim):
    """Sequences past the flash crossover (2048 tokens in float32, 1024 or 128 in half precision) go to PyTorch's
    flash kernel one at a time, the rest through polyvec's: both as float32 SDPA on the same inputs, key lengths
    kept, and a sequence's output bit-identical alone and among the others."""
    assert kernels.load()
    torch.manual_seed(5)
    heads, lens, key_lens = 2, [2100, 5, 1030, 130, 40], [2000, 5, 1030, 100, 40]
    qkv = torch.randn(sum(lens), 3 * heads * dim).to(dtype)
    meta = AttentionMetadata.build(lens, torch.device("cpu"), key_lens, packed=True)
    out = kernels.varlen_attention(qkv, meta.cu_seqlens, heads, meta.key_lens)
    ref = _reference(qkv, lens, heads, key_lens)
    tol = 2e-6 if dtype == torch.float32 else 1e-2
    assert (out.float() - ref).abs().max() < tol
    assert F.cosine_similarity(out.float(), ref, dim=-1).min() > 0.9999
    start = 0
    for n, k in zip(lens, key_lens):
        alone = kernels.varlen_attention(
            qkv[start : start + n].contiguous(), torch.tensor([0, n]), heads, torch.tensor([k])
        )
        assert torch.equal(alone, out[start : start + n])
        start += n
