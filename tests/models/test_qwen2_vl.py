"""Qwen2-VL's language side with images: polyvec's vision tower + Qwen2 decoder with multimodal rotary
positions against transformers' Qwen2VLModel (the forward colpali-engine's ColQwen2 runs) on a small seeded
configuration."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("PIL", reason="Pillow is the vision extra")
from PIL import Image  # noqa: E402

from polyvec.layers.attention import AttentionMetadata  # noqa: E402
from polyvec.models.args import DecoderArgs  # noqa: E402
from polyvec.models.decoder import DECODER_RULES, Qwen2Model  # noqa: E402
from polyvec.models.qwen2_vl import mrope_positions  # noqa: E402
from polyvec.models.qwen2_vl_vision import VisionArgs, VisionTower  # noqa: E402
from polyvec.models.weights import load_mapped  # noqa: E402
from polyvec.multimodal.image import qwen2_vl_patches  # noqa: E402
from tests.helpers import cosine_rows  # noqa: E402

IMAGE, START, END = 250, 251, 252


def _reference():
    from transformers import Qwen2VLConfig, Qwen2VLModel

    torch.manual_seed(0)
    config = Qwen2VLConfig(
        text_config=dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, rope_parameters={
                             "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=2, embed_dim=32, num_heads=2, hidden_size=64, mlp_ratio=2),
        image_token_id=IMAGE, vision_start_token_id=START, vision_end_token_id=END,
    )  # fmt: skip
    model = Qwen2VLModel(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_q" in name:
                p.add_(torch.randn_like(p) * 0.2)
    return config, model


def test_positions_of_text_and_images():
    ids = [1, 2, START, IMAGE, IMAGE, IMAGE, IMAGE, IMAGE, IMAGE, END, 3]
    pos = mrope_positions(ids, IMAGE, [(1, 4, 6)], 2)  # a 2 x 3 merged grid
    assert pos[:, :3].tolist() == [[0, 1, 2]] * 3
    assert pos[:, 3:9].tolist() == [[3] * 6, [3, 3, 3, 4, 4, 4], [3, 4, 5, 3, 4, 5]]
    assert pos[:, 9:].tolist() == [[6, 7]] * 3  # resumes at start + max(rows, columns)
    with pytest.raises(ValueError, match="1 images given, 0 placeholders"):
        mrope_positions([1, 2], IMAGE, [(1, 4, 6)], 2)
    with pytest.raises(ValueError, match="has 6 tokens but the prompt holds 2"):
        mrope_positions([IMAGE, IMAGE, 1], IMAGE, [(1, 4, 6)], 2)


def test_image_prompt_hidden_states_match_transformers():
    config, ref = _reference()
    rng = np.random.default_rng(1)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in ((84, 56), (56, 112))]
    pix = [qwen2_vl_patches(im, min_pixels=28 * 28, max_pixels=28 * 28 * 16) for im in images]
    ids = [5, 6, 7]
    for p in pix:
        ids += [START] + [IMAGE] * (p.patches.shape[0] // 4) + [END, 8, 9]
    patches = torch.cat([p.patches for p in pix])
    grids = [p.grid_thw for p in pix]
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        want = ref(
            input_ids=input_ids,
            pixel_values=patches,
            image_grid_thw=torch.tensor(grids),
            mm_token_type_ids=(input_ids == IMAGE).int(),
        ).last_hidden_state[0]

    state = ref.state_dict()
    tower = VisionTower(VisionArgs.from_hf(config.vision_config.to_dict())).eval()
    tower.load_weights(state, prefix="visual.")
    text_args = DecoderArgs.from_hf(config.text_config.to_dict())
    assert text_args.mrope_section == (2, 3, 3)
    with torch.device("meta"):
        decoder = Qwen2Model(text_args)
    decoder = decoder.to_empty(device="cpu").eval()

    class Holder(torch.nn.Module):  # the names load_mapped's decoder rules write to
        def __init__(self):
            super().__init__()
            self.encoder = decoder

    load_mapped(Holder(), state, DECODER_RULES, strip_prefixes=("language_model.",))
    with torch.inference_mode():
        embeds = decoder.embed_tokens(input_ids[0]).clone()
        embeds[input_ids[0] == IMAGE] = tower(patches, grids)
        meta = AttentionMetadata.build_causal([len(ids)], [0], [None], torch.device("cpu"))
        positions = mrope_positions(ids, IMAGE, grids, 2)
        got = decoder(None, None, meta, embeds=embeds, rope_positions=positions)
        assert cosine_rows(got, want).min() >= 0.9999 and (got - want).abs().max() < 1e-4
        # 1-D positions (what a text-only forward would use) give different hidden states after the images
        flat = decoder(None, None, meta, embeds=embeds)
        assert (flat - want).abs().max() > 1e-3
