"""ColPali (Faysse et al., "ColPali", 2024, https://arxiv.org/abs/2407.01449): PaliGemma (Beyer et al., 2024,
https://arxiv.org/abs/2407.07726) reads a page image or a query, and every output token is projected to a small
vector (the pooler's token projection) for MaxSim.

PaliGemma is a SigLIP vision tower (models/siglip.py) whose patch features a linear projector maps to Gemma's
width, in place of the prompt's `<image>` placeholders (one per patch), then Gemma (Gemma Team, 2024,
https://arxiv.org/abs/2403.08295): the decoder block with RMSNorm scaled by (1 + w), a GeGLU MLP (tanh GELU),
embeddings scaled by √hidden, and here bidirectional attention over the whole prompt, as PaliGemma attends
within its prefix (all of a ColPali input is prefix). Positions count from 1, as PaliGemma's do.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..layers.attention import AttentionMetadata
from .args import DecoderArgs
from .colqwen2 import ImageBatch
from .decoder import DecoderModel, load_decoder_weights
from .siglip import SiglipArgs, SiglipTower


class GemmaModel(DecoderModel):
    """Gemma as PaliGemma runs a ColPali prompt: all prefix, attended both ways."""

    causal = False


class ColPaliTrunk(nn.Module):
    """Packed ids (+ the batch's images in `meta.images`) → hidden states [T, H]."""

    causal = False

    def __init__(self, text: Mapping[str, Any], vision: Mapping[str, Any], image_token_id: int):
        super().__init__()
        self.args = dataclasses.replace(DecoderArgs.from_hf(text), is_causal=False)
        self.decoder = GemmaModel(self.args)
        self.visual = SiglipTower(SiglipArgs.from_hf(vision))
        self.projector = nn.Linear(int(vision["hidden_size"]), self.args.hidden_size)
        self.image_token_id = image_token_id

    @property
    def layers(self) -> nn.ModuleList:  # the platform packs the language model's projections
        return self.decoder.layers

    @property
    def towers(self) -> nn.ModuleList:  # and the vision tower's, apart (models/interface.py)
        return self.visual.blocks

    def forward(
        self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None, meta: AttentionMetadata
    ) -> torch.Tensor:
        images: ImageBatch | None = meta.images
        is_image = input_ids == self.image_token_id
        # The placeholder may lie beyond the embedding table (PaliGemma maps it to 0 before the lookup).
        embeds = self.decoder.embed_tokens(input_ids.masked_fill(is_image, 0))  # [T, H]
        if images is not None and images.grids:
            features = self.projector(self.visual(images.patches, len(images.grids)))  # [images · P, H]
            embeds = embeds.masked_scatter(is_image.unsqueeze(-1), features.to(embeds.dtype))
        return self.decoder(None, None, meta, embeds=embeds, rope_positions=meta.positions + 1)

    def load_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        """transformers' ColPaliForRetrieval (`vlm.`, `vlm.model.`) or colpali-engine's ColPali (`model.`): each
        part found by its first tensor's name, whatever the prefix before it."""

        def prefix_of(suffix: str) -> str:
            found = next((k for k in state if k.endswith(suffix)), None)
            if found is None:
                raise ValueError(f"the checkpoint has no ...{suffix}: not a PaliGemma / ColPali checkpoint")
            return found[: -len(suffix)]

        vision = prefix_of("embeddings.patch_embedding.weight")
        self.visual.load_weights(state, prefix=vision)
        projector = prefix_of("multi_modal_projector.linear.weight") + "multi_modal_projector.linear."
        with torch.no_grad():
            self.projector.weight.copy_(state[projector + "weight"])
            self.projector.bias.copy_(state[projector + "bias"])
        text_prefix = prefix_of("layers.0.self_attn.q_proj.weight")
        text: dict[str, torch.Tensor] = {}
        for key, value in state.items():
            if not key.startswith(text_prefix) or key.startswith(vision):
                continue
            name = key[len(text_prefix) :]
            if name.startswith("lm_head.") or "rotary_emb" in name:
                continue
            if name.endswith("norm.weight"):  # Gemma's RMSNorm scales by (1 + w)
                value = value.float() + 1.0
            elif name == "embed_tokens.weight":  # Gemma scales its embeddings by √hidden (in float32 here)
                value = value.float() * math.sqrt(self.args.hidden_size)
            text[name] = value
        load_decoder_weights(self.decoder, text)
