"""SigLIP's vision tower against transformers' SiglipVisionModel (last_hidden_state), on a small seeded
configuration and real image patches (multimodal/image.py `siglip_patches`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("PIL", reason="Pillow is the vision extra")
from PIL import Image  # noqa: E402

from polyvec.layers import kernels  # noqa: E402
from polyvec.layers.activation import identity  # noqa: E402
from polyvec.layers.linear import PackedLinear, onednn_available  # noqa: E402
from polyvec.models.siglip import SiglipArgs, SiglipTower  # noqa: E402
from polyvec.multimodal.image import siglip_patches  # noqa: E402
from polyvec.platforms.cpu import Projections  # noqa: E402
from tests.helpers import cosine_rows  # noqa: E402

SIDE, PATCH = 56, 14
PER_IMAGE = (SIDE // PATCH) ** 2


def _reference():
    """4 heads of 16, 2 blocks, 16 patches per image; norms and biases perturbed so a swapped or dropped one
    shows; with the pooling head, whose weights the tower must skip."""
    from transformers import SiglipVisionConfig, SiglipVisionModel

    torch.manual_seed(0)
    config = SiglipVisionConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, image_size=SIDE,
        patch_size=PATCH, vision_use_head=True,
    )  # fmt: skip
    model = SiglipVisionModel(config).eval().float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
    return config, model


def _patches() -> list[torch.Tensor]:
    rng = np.random.default_rng(0)
    sizes = [(200, 150), (56, 56), (90, 300)]
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in sizes]
    return [siglip_patches(im, SIDE, PATCH) for im in images]


def test_args_from_hf():
    args = SiglipArgs.from_hf({"hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27,
                               "num_attention_heads": 16, "patch_size": 14, "num_image_tokens": 1024})  # fmt: skip
    assert args.image_size == 448 and args.num_patches == 1024 and args.hidden_act == "gelu_pytorch_tanh"
    assert args.layer_norm_eps == 1e-6 and args.num_channels == 3


@pytest.mark.parametrize(
    "native,onednn", [(True, True), (True, False), (False, False)], ids=["cpu-platform", "packed-kernel", "sdpa"]
)
def test_siglip_tower_matches_transformers(native, onednn):
    config, ref = _reference()
    # named as in SigLIP's and PaliGemma's checkpoints (transformers 5's SiglipVisionModel drops the prefix)
    state = {"vision_model." + k: v for k, v in ref.state_dict().items()}
    assert any(k.startswith("vision_model.head.") for k in state)
    pix = _patches()
    patches = torch.cat(pix)  # [3·16, 3·14·14]
    pixel_values = torch.stack(  # the same pixels as the reference's [3, 3, 56, 56]
        [p.view(4, 4, 3, PATCH, PATCH).permute(2, 0, 3, 1, 4).reshape(3, SIDE, SIDE) for p in pix]
    )
    with torch.no_grad():
        want = ref(pixel_values=pixel_values).last_hidden_state.reshape(-1, 64)  # [3·16, 64]
    tower = SiglipTower(SiglipArgs.from_hf(config.to_dict())).eval()
    tower.load_weights(state, "vision_model.")
    if native:
        assert kernels.load()
        tower.prepare(torch.device("cpu"), torch.float32)
        assert tower.packed_attention
        for module in tower.modules():  # as the CPU platform does: LayerNorm's kernel
            if hasattr(module, "native"):
                module.native = True
    if onednn:  # the CPU platform's projections; tanh-GELU fused into fc1
        if not onednn_available(torch.device("cpu"), torch.float32):
            pytest.skip("PyTorch without oneDNN")
        for block in tower.blocks:
            block.replace_projections(Projections(int8=False, amx=False))
            assert isinstance(block.qkv, PackedLinear) and isinstance(block.fc1, PackedLinear)
            assert block.fc1.attr == "gelu" and block.fc1.algorithm == "tanh" and block.act is identity
    with torch.inference_mode():
        got = tower(patches, len(pix))
        assert got.shape == want.shape == (3 * PER_IMAGE, 64)
        assert cosine_rows(got, want).min() >= 0.9999 and (got - want).abs().max() < 2e-5
        # an image's tokens do not depend on the others in the batch
        alone = tower(pix[1], 1)
        assert (alone - got[PER_IMAGE : 2 * PER_IMAGE]).abs().max() <= 1e-5


def test_load_refuses_a_checkpoint_without_a_tensor():
    config, ref = _reference()
    state = {k: v for k, v in ref.state_dict().items() if "layers.1.self_attn.k_proj" not in k}
    tower = SiglipTower(SiglipArgs.from_hf(config.to_dict()))
    with pytest.raises(ValueError, match=r"no weights for: blocks\.1\.qkv\.weight, blocks\.1\.qkv\.bias$"):
        tower.load_weights(state)
    with pytest.raises(ValueError, match="patches for 2 images"):
        tower(torch.zeros(PER_IMAGE, 3 * PATCH * PATCH), 2)
