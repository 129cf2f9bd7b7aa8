"""Qwen2-VL's vision tower against transformers' Qwen2VisionTransformerPretrainedModel, on a small seeded
configuration and real image patches (multimodal/image.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("PIL", reason="Pillow is the vision extra")
from PIL import Image  # noqa: E402

from polyvec.layers import kernels  # noqa: E402
from polyvec.layers.activation import identity  # noqa: E402
from polyvec.layers.linear import PackedLinear, onednn_available  # noqa: E402
from polyvec.models.qwen2_vl_vision import VisionArgs, VisionTower  # noqa: E402
from polyvec.multimodal.image import qwen2_vl_patches  # noqa: E402
from polyvec.platforms.cpu import Projections  # noqa: E402
from tests.helpers import cosine_rows  # noqa: E402


def _reference(version: str = "2"):
    """Qwen2-VL's tower, or Qwen2.5-VL's: 3 blocks, windows of 2 x 2 merge groups, block 1 over whole images."""
    torch.manual_seed(0)
    if version == "2":
        from transformers import Qwen2VLVisionConfig
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

        config = Qwen2VLVisionConfig(depth=2, embed_dim=64, num_heads=4, hidden_size=96, mlp_ratio=2)
        model = Qwen2VisionTransformerPretrainedModel(config).eval()
    else:
        from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

        config = Qwen2_5_VLVisionConfig(
            depth=3, hidden_size=64, num_heads=4, intermediate_size=96, out_hidden_size=96, window_size=56,
            fullatt_block_indexes=[1],
        )  # fmt: skip
        model = Qwen2_5_VisionTransformerPretrainedModel(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_q" in name:
                p.add_(torch.randn_like(p) * 0.2)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
    return config, model


def _images():
    rng = np.random.default_rng(0)
    sizes = [(84, 56), (150, 97), (56, 56)]
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in sizes]
    return [qwen2_vl_patches(im, min_pixels=28 * 28, max_pixels=28 * 28 * 64) for im in images]


@pytest.mark.parametrize("version", ["2", "2.5"], ids=["qwen2-vl", "qwen2.5-vl"])
@pytest.mark.parametrize(
    "native,onednn", [(True, True), (True, False), (False, False)], ids=["cpu-platform", "packed-kernel", "sdpa"]
)
def test_vision_tower_matches_transformers(native, onednn, version):
    config, ref = _reference(version)
    pix = _images()
    patches = torch.cat([p.patches for p in pix])
    grids = [p.grid_thw for p in pix]
    with torch.no_grad():
        want = ref(patches, grid_thw=torch.tensor(grids)).pooler_output  # [N / 4, 96]
    tower = VisionTower(VisionArgs.from_hf(config.to_dict())).eval()
    tower.load_weights(ref.state_dict())
    if native:
        assert kernels.load()
        tower.prepare(torch.device("cpu"), torch.float32)
        assert tower.packed_attention
        for block in tower.blocks:
            block.native = True
    if onednn:  # the CPU platform's projections; quick-GELU folded into fc1's fused SiLU
        if not onednn_available(torch.device("cpu"), torch.float32):
            pytest.skip("PyTorch without oneDNN")
        for block in tower.blocks:
            block.replace_projections(Projections(int8=False, amx=False))
            first = block.gate_proj if version == "2.5" else block.fc1  # SiLU (quick-GELU folded) fused
            assert isinstance(first, PackedLinear) and first.attr == "swish" and block.act is identity
    with torch.inference_mode():
        got = tower(patches, grids)
        assert got.shape == want.shape == (patches.shape[0] // 4, 96)
        assert cosine_rows(got, want).min() >= 0.9999 and (got - want).abs().max() < 1e-4
        # an image's tokens do not depend on the others in the batch
        alone = tower(pix[1].patches, [pix[1].grid_thw])
        first = pix[0].patches.shape[0] // 4
        assert (alone - got[first : first + alone.shape[0]]).abs().max() <= 1e-5
