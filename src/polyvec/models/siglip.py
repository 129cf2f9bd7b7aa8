"""SigLIP's vision tower over packed images (the encoder PaliGemma, and so ColPali, reads page images with).

Zhai et al., "Sigmoid Loss for Language Image Pre-Training" (2023), https://arxiv.org/abs/2303.15343: a ViT
trained against text with a pairwise sigmoid loss. Each image arrives resized to a fixed square and cut into
its patches (multimodal/image.py `siglip_patches`: 3 channels x patch x patch pixels each, row-major), so
every image has the same number of patches. A linear patch embedding (the checkpoint's Conv2d, whose kernel
equals its stride, with its bias), a learned position embedding per patch, pre-norm blocks of full
bidirectional attention within each image (the packed batch: one sequence per image) and a tanh-GELU MLP, then
a final LayerNorm. The attention-pooling head (`head.*`) is left out: PaliGemma reads every patch's features.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from ..layers import kernels
from ..layers.activation import get_act_fn, identity
from ..layers.attention import AttentionMetadata, varlen_attention
from ..layers.layernorm import LayerNorm
from ..layers.linear import linear_add
from .interface import ProjectionPacker
from .weights import Rule, load_mapped


def _side(value: Any) -> int:
    """A size that may be given as [h, w]: SigLIP's are square."""
    if isinstance(value, (list, tuple)):
        if len(set(value)) != 1:
            raise ValueError(f"SigLIP tower: non-square size {list(value)} is not supported")
        value = value[0]
    return int(value)


@dataclass(frozen=True)
class SiglipArgs:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int = 224
    patch_size: int = 16
    num_channels: int = 3
    layer_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"

    @property
    def num_patches(self) -> int:
        """Patches (and position embeddings) per image."""
        return (self.image_size // self.patch_size) ** 2

    @classmethod
    def from_hf(cls, vision_config: Mapping[str, Any]) -> SiglipArgs:
        """transformers' SiglipVisionConfig (PaliGemma's `vision_config`); missing fields take its defaults,
        except a missing `image_size`, which `num_image_tokens` gives where PaliGemma wrote it."""
        c = vision_config
        patch = _side(c.get("patch_size", 16))
        if "image_size" in c:
            image = _side(c["image_size"])
        elif "num_image_tokens" in c:
            image = round(int(c["num_image_tokens"]) ** 0.5) * patch
        else:
            image = 224
        return cls(
            hidden_size=int(c.get("hidden_size", 768)),
            intermediate_size=int(c.get("intermediate_size", 3072)),
            num_hidden_layers=int(c.get("num_hidden_layers", 12)),
            num_attention_heads=int(c.get("num_attention_heads", 12)),
            image_size=image,
            patch_size=patch,
            num_channels=int(c.get("num_channels", 3)),
            layer_norm_eps=float(c.get("layer_norm_eps", 1e-6)),
            hidden_act=str(c.get("hidden_act", "gelu_pytorch_tanh")),
        )


class SiglipBlock(nn.Module):
    """norm → attention (within each image) → add; norm → fc1 → act → fc2 → add, on a flat [N, D] tensor.
    q, k and v (each with a bias) are one `qkv` projection, fused at load time."""

    def __init__(self, args: SiglipArgs):
        super().__init__()
        dim, hidden = args.hidden_size, args.intermediate_size
        self.num_heads = args.num_attention_heads
        self.layer_norm1 = LayerNorm(dim, eps=args.layer_norm_eps)
        self.qkv: nn.Module = nn.Linear(dim, 3 * dim)
        self.out_proj: nn.Module = nn.Linear(dim, dim)
        self.layer_norm2 = LayerNorm(dim, eps=args.layer_norm_eps)
        self.fc1: nn.Module = nn.Linear(dim, hidden)
        self.fc2: nn.Module = nn.Linear(hidden, dim)
        self.act_name = args.hidden_act
        self.act = get_act_fn(args.hidden_act)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv(self.layer_norm1(x))  # [N, 3D]
        attn = varlen_attention(qkv, meta, self.num_heads, meta.attn_mask())  # [N, D], scale head_dim^-0.5
        x = linear_add(self.out_proj, attn, x)  # [N, D]
        return linear_add(self.fc2, self.act(self.fc1(self.layer_norm2(x))), x)  # [N, D]

    def replace_projections(self, pack: ProjectionPacker) -> None:
        """The platform's forms of the four projections, the activation fused into fc1 where it can be."""
        qkv, out_proj, fc1, fc2 = (cast(nn.Linear, m) for m in (self.qkv, self.out_proj, self.fc1, self.fc2))
        self.qkv, self.out_proj, self.fc2 = pack(qkv), pack(out_proj), pack(fc2)
        if pack.fuses(self.act_name):
            self.fc1, self.act = pack(fc1, self.act_name), identity
        else:
            self.fc1 = pack(fc1)


class SiglipTower(nn.Module):
    """Patches of a batch of images [N·P, C·p·p] (P patches per image, images one after another) → the last
    hidden states [N·P, D]."""

    def __init__(self, args: SiglipArgs):
        super().__init__()
        self.args = args
        dim = args.hidden_size
        self.patch_embed = nn.Linear(args.num_channels * args.patch_size**2, dim)
        self.position_embedding = nn.Parameter(torch.zeros(args.num_patches, dim))  # [P, D]
        self.blocks = nn.ModuleList(SiglipBlock(args) for _ in range(args.num_hidden_layers))
        self.post_layernorm = LayerNorm(dim, eps=args.layer_norm_eps)
        self.packed_attention = False  # set by `prepare`: the native kernel on the packed images

    @property
    def head_dim(self) -> int:
        return self.args.hidden_size // self.args.num_attention_heads

    def prepare(self, device: torch.device, dtype: torch.dtype) -> None:
        self.packed_attention = kernels.packed_attention_available(device, dtype, self.head_dim)

    def forward(self, patches: torch.Tensor, num_images: int) -> torch.Tensor:
        per_image, dim = self.args.num_patches, self.args.hidden_size
        if patches.shape[0] != num_images * per_image:
            raise ValueError(
                f"SigLIP tower: {patches.shape[0]} patches for {num_images} images of {per_image} patches each"
            )
        dtype = self.patch_embed.weight.dtype
        x = self.patch_embed(patches.to(dtype))  # [N·P, D]
        x = (x.view(num_images, per_image, dim) + self.position_embedding).view(-1, dim)  # [N·P, D]
        meta = AttentionMetadata.build([per_image] * num_images, x.device, packed=self.packed_attention)
        for block in self.blocks:
            x = block(x, meta)
        return self.post_layernorm(x)  # [N·P, D]

    def load_weights(self, state: Mapping[str, torch.Tensor], prefix: str = "") -> None:
        """transformers' names (SiglipVisionTransformer), after `prefix` ("vision_model.", ...); the pooling
        head's (`head.*`) are skipped."""
        state = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
        conv = state.get("embeddings.patch_embedding.weight")
        if conv is not None:  # Conv2d [D, C, p, p], kernel = stride: a linear map of the (c, row, col) patch
            state["embeddings.patch_embedding.weight"] = conv.reshape(conv.shape[0], -1)
        for i in range(self.args.num_hidden_layers):  # q, k, v → qkv, in that order
            attn = f"encoder.layers.{i}.self_attn."
            for kind in ("weight", "bias"):
                names = [f"{attn}{p}_proj.{kind}" for p in "qkv"]
                if all(n in state for n in names):
                    state[f"{attn}qkv.{kind}"] = torch.cat([state.pop(n) for n in names])
        load_mapped(self, state, SIGLIP_RULES)


_L = r"^encoder\.layers\.(\d+)\."
SIGLIP_RULES: list[Rule] = [
    (r"^embeddings\.patch_embedding\.", "patch_embed.", None),
    (r"^embeddings\.position_embedding\.weight$", "position_embedding", None),
    (_L + r"self_attn\.(qkv|out_proj)\.", r"blocks.\1.\2.", None),
    (_L + r"(layer_norm[12])\.", r"blocks.\1.\2.", None),
    (_L + r"mlp\.(fc[12])\.", r"blocks.\1.\2.", None),
]
