"""ColQwen2 (Faysse et al., "ColPali", 2024, https://arxiv.org/abs/2407.01449; the Qwen2-VL version): Qwen2-VL's
vision tower and language model read a page image (or a query's text), and every output token is projected to
a small vector (the pooler's token projection) for MaxSim.

The trunk runs the packed batch as the decoder does (causal attention per sequence); a batch's images go through
the vision tower together and their merged tokens replace the image placeholders' embeddings; every token gets
its three multimodal rotary positions (models/qwen2_vl.py). Image prompts run whole (never split across steps).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..layers.attention import AttentionMetadata
from .args import DecoderArgs
from .decoder import Qwen2Model, load_decoder_weights
from .qwen2_vl_vision import VisionArgs, VisionTower


@dataclass
class ImageBatch:
    """The images of a batch, in the order their placeholders appear in the packed ids, and every token's
    multimodal rotary positions."""

    patches: torch.Tensor  # [N, C·T·P·P]
    grids: list[tuple[int, int, int]]
    rope_positions: torch.Tensor | None  # [3, T] (Qwen2-VL); None: the metadata's (ColPali)


class ColQwen2Trunk(nn.Module):
    """Packed ids (+ the batch's images in `meta.images`) → hidden states [T, H]."""

    causal = True

    def __init__(self, text: Mapping[str, Any], vision: Mapping[str, Any], image_token_id: int):
        super().__init__()
        self.args = DecoderArgs.from_hf(text)
        self.decoder = Qwen2Model(self.args)
        self.visual = VisionTower(VisionArgs.from_hf(vision))
        self.image_token_id = image_token_id

    @property
    def layers(self) -> nn.ModuleList:  # the platform packs the language model's projections
        return self.decoder.layers

    @property
    def towers(self) -> nn.ModuleList:  # and the vision tower's, apart (models/interface.py)
        return self.visual.blocks

    def kv_shape(self) -> tuple[int, int, int]:
        return self.decoder.kv_shape()

    def forward(
        self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None, meta: AttentionMetadata
    ) -> torch.Tensor:
        images: ImageBatch | None = meta.images
        embeds = self.decoder.embed_tokens(input_ids)  # [T, H]
        positions = None
        if images is not None:
            if images.grids:
                features = self.visual(images.patches, images.grids)  # [image tokens, H]
                embeds = embeds.masked_scatter(
                    (input_ids == self.image_token_id).unsqueeze(-1), features.to(embeds.dtype)
                )
            positions = images.rope_positions
        return self.decoder(None, None, meta, embeds=embeds, rope_positions=positions)

    def load_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        """transformers' ColQwen2ForRetrieval (`vlm.visual.`, `vlm.language_model.`; `vlm.model.` before
        transformers 5) or colpali-engine's ColQwen2 (`visual.`, `model.`)."""
        vision = next(
            p
            for p in ("vlm.model.visual.", "vlm.visual.", "model.visual.", "visual.")
            if any(k.startswith(p) for k in state)
        )
        self.visual.load_weights(state, prefix=vision)
        text_prefixes = (
            "vlm.model.language_model.",
            "vlm.language_model.",
            "vlm.model.",
            "model.language_model.",
            "model.",
        )
        text = {k: v for k, v in state.items() if not k.startswith(vision)}
        load_decoder_weights(self.decoder, text, text_prefixes)


PROJECTION_KEYS = ("embedding_proj_layer.", "custom_text_proj.")
