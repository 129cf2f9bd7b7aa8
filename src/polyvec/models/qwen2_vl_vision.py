"""Qwen2-VL's vision tower over packed images (the encoder ColQwen2 reads page images with).

Wang et al., "Qwen2-VL" (2024), https://arxiv.org/abs/2409.12191. Each image arrives as its patches
(multimodal/image.py: 3 channels x 2 frames x 14 x 14 pixels each, in merge-group order) and its (t, h, w) grid.
A linear patch embedding (the checkpoint's Conv3d, whose kernel equals its stride), pre-norm blocks of full
bidirectional attention within each image (the packed batch: one sequence per image) with 2-D rotary positions
(the first half of each head's rotary frequencies turn with the patch's row, the second with its column), a
quick-GELU MLP, then the patch merger: LayerNorm, each merge x merge group of patches concatenated, an MLP to the
language model's width.

Qwen2.5-VL's tower (ColQwen2.5; Bai et al., "Qwen2.5-VL", https://arxiv.org/abs/2502.13923) differs in three
ways, read from its config (`out_hidden_size` present): RMSNorm for LayerNorm, a SwiGLU MLP with biases, and
window attention: the patches are reordered window by window (windows of `window_size` pixels, in merge
groups, row-major within each image), every block but `fullatt_block_indexes` attends within its window, the
others within the image, and the merged tokens are put back in image order after the merger.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from ..layers import kernels
from ..layers.activation import QUICK_GELU, get_act_fn, identity, quick_gelu
from ..layers.attention import AttentionMetadata, varlen_attention
from ..layers.layernorm import LayerNorm
from ..layers.linear import linear_add, linear_mul
from .decoder import RMSNorm, apply_rope
from .interface import ProjectionPacker
from .weights import Rule, load_mapped


@dataclass(frozen=True)
class VisionArgs:
    embed_dim: int
    depth: int
    num_heads: int
    hidden_size: int
    """The language model's width: what the merger projects to."""
    intermediate_size: int
    hidden_act: str = "quick_gelu"
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3
    rope_theta: float = 10000.0
    qwen2_5: bool = False
    """Qwen2.5-VL's tower: RMSNorm, SwiGLU MLP, window attention."""
    window_size: int = 0
    """Qwen2.5-VL: the attention window's side in pixels (0: none)."""
    fullatt_block_indexes: tuple[int, ...] = ()
    """Qwen2.5-VL: the blocks that attend over the whole image."""

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> VisionArgs:
        """Qwen2-VL's vision config (`embed_dim` the tower's width, `hidden_size` the language model's) or
        Qwen2.5-VL's (`hidden_size` the tower's, `out_hidden_size` the language model's)."""
        rope = config.get("rope_parameters") or {}
        common = dict(
            depth=int(config["depth"]),
            num_heads=int(config["num_heads"]),
            patch_size=int(config.get("patch_size", 14)),
            temporal_patch_size=int(config.get("temporal_patch_size", 2)),
            spatial_merge_size=int(config.get("spatial_merge_size", 2)),
            in_channels=int(config.get("in_channels", config.get("in_chans", 3))),
            rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
        )
        if "out_hidden_size" in config:
            return cls(
                embed_dim=int(config["hidden_size"]),
                hidden_size=int(config["out_hidden_size"]),
                intermediate_size=int(config["intermediate_size"]),
                hidden_act=str(config.get("hidden_act", "silu")),
                qwen2_5=True,
                window_size=int(config.get("window_size", 112)),
                fullatt_block_indexes=tuple(int(i) for i in config.get("fullatt_block_indexes", ())),
                **common,  # type: ignore[arg-type]
            )
        embed = int(config["embed_dim"])
        return cls(
            embed_dim=embed,
            hidden_size=int(config["hidden_size"]),
            intermediate_size=int(embed * float(config.get("mlp_ratio", 4))),
            hidden_act=str(config.get("hidden_act", "quick_gelu")),
            **common,  # type: ignore[arg-type]
        )


def _norm(args: VisionArgs, dim: int) -> nn.Module:
    return RMSNorm(dim, eps=1e-6) if args.qwen2_5 else LayerNorm(dim, eps=1e-6)


class VisionBlock(nn.Module):
    """norm → attention (2-D rotary, within each image or window) → add; norm → MLP → add, on a flat [N, D]
    tensor. The MLP is fc1 → act → fc2 (Qwen2-VL) or SwiGLU, down(act(gate(x)) · up(x)) (Qwen2.5-VL)."""

    native = False  # set by the CPU platform where polyvec's kernels are built: rotary positions in place

    def __init__(self, args: VisionArgs):
        super().__init__()
        dim, hidden = args.embed_dim, args.intermediate_size
        self.num_heads = args.num_heads
        self.head_dim = dim // args.num_heads
        self.norm1 = _norm(args, dim)
        self.qkv: nn.Module = nn.Linear(dim, 3 * dim)
        self.proj: nn.Module = nn.Linear(dim, dim)
        self.norm2 = _norm(args, dim)
        self.gated = args.qwen2_5
        if self.gated:
            self.gate_proj: nn.Module = nn.Linear(dim, hidden)
            self.up_proj: nn.Module = nn.Linear(dim, hidden)
            self.down_proj: nn.Module = nn.Linear(hidden, dim)
        else:
            self.fc1: nn.Module = nn.Linear(dim, hidden)
            self.fc2: nn.Module = nn.Linear(hidden, dim)
        self.act = get_act_fn(args.hidden_act)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor:
        qkv = self.qkv(self.norm1(x)).contiguous()  # [N, 3D]
        cos, sin = rope  # [N, d/2] float32
        if self.native and qkv.device.type == "cpu":
            torch.ops.polyvec.rope_(qkv, cos, sin, self.num_heads)
        else:
            parts = qkv.view(qkv.shape[0], 3, self.num_heads, self.head_dim)
            full = [torch.cat((t, t), -1).unsqueeze(1) for t in (cos, sin)]  # [N, 1, d], float32 as the reference
            parts[:, 0] = apply_rope(parts[:, 0].float(), *full).to(qkv.dtype)
            parts[:, 1] = apply_rope(parts[:, 1].float(), *full).to(qkv.dtype)
        x = linear_add(self.proj, varlen_attention(qkv, meta, self.num_heads, meta.attn_mask()), x)
        h = self.norm2(x)
        if self.gated:
            return linear_add(self.down_proj, linear_mul(self.up_proj, h, self.act(self.gate_proj(h))), x)
        return linear_add(self.fc2, self.act(self.fc1(h)), x)

    def replace_projections(self, pack: ProjectionPacker) -> None:
        """The platform's forms of the four projections. Quick-GELU, x·σ(1.702x), is SiLU of 1.702x over
        1.702: where the platform fuses SiLU, fc1's weights are scaled by 1.702 and fc2's by 1/1.702, so the
        activation runs in fc1's epilogue instead of three passes over the widest tensor."""
        self.qkv, self.proj = pack(cast(nn.Linear, self.qkv)), pack(cast(nn.Linear, self.proj))
        if self.gated:
            act = None
            if self.act is F.silu and pack.fuses("silu"):
                act, self.act = "silu", identity
            self.gate_proj = pack(cast(nn.Linear, self.gate_proj), act)
            self.up_proj, self.down_proj = pack(cast(nn.Linear, self.up_proj)), pack(cast(nn.Linear, self.down_proj))
            return
        fc1, fc2 = cast(nn.Linear, self.fc1), cast(nn.Linear, self.fc2)
        act = None
        if self.act is quick_gelu and pack.fuses("silu"):
            with torch.no_grad():
                fc1.weight.mul_(QUICK_GELU)
                fc1.bias.mul_(QUICK_GELU)
                fc2.weight.div_(QUICK_GELU)
            act, self.act = "silu", identity
        self.fc1, self.fc2 = pack(fc1, act), pack(fc2)


class VisionTower(nn.Module):
    """Patches of a batch of images [N, C·T·P·P] and their grids → merged tokens [N / merge², hidden_size]."""

    def __init__(self, args: VisionArgs):
        super().__init__()
        self.args = args
        patch_in = args.in_channels * args.temporal_patch_size * args.patch_size**2
        self.patch_embed = nn.Linear(patch_in, args.embed_dim, bias=False)
        self.blocks = nn.ModuleList(VisionBlock(args) for _ in range(args.depth))
        merged = args.embed_dim * args.spatial_merge_size**2
        self.merger_norm = _norm(args, args.embed_dim)
        self.merger_fc1 = nn.Linear(merged, merged)
        self.merger_fc2 = nn.Linear(merged, args.hidden_size)
        self.packed_attention = False  # set by `prepare`: the native kernel on the packed images

    @property
    def head_dim(self) -> int:
        return self.args.embed_dim // self.args.num_heads

    def prepare(self, device: torch.device, dtype: torch.dtype) -> None:
        self.packed_attention = kernels.packed_attention_available(device, dtype, self.head_dim)

    def rotary(self, grids: Sequence[tuple[int, int, int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [N, d/2] in float32: each patch's row and column angles, patches in merge-group order."""
        m, quarter = self.args.spatial_merge_size, self.head_dim // 4
        inv_freq = 1.0 / (self.args.rope_theta ** (torch.arange(0, 2 * quarter, 2, dtype=torch.float) / (2 * quarter)))
        rows, cols = [], []
        for t, h, w in grids:
            hh, ww = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
            shape = (h // m, m, w // m, m)
            rows.append(hh.reshape(shape).transpose(1, 2).flatten().repeat(t))
            cols.append(ww.reshape(shape).transpose(1, 2).flatten().repeat(t))
        angles = torch.cat(
            [torch.cat(rows)[:, None].float() * inv_freq, torch.cat(cols)[:, None].float() * inv_freq], dim=1
        )  # [N, d/2]
        return angles.cos().to(device), angles.sin().to(device)

    def windows(self, grids: Sequence[tuple[int, int, int]]) -> tuple[torch.Tensor, list[int]]:
        """Qwen2.5-VL's window order: the merge groups of each image listed window by window (windows of
        `window_size` pixels, row-major; the last row and column of windows cut at the image's edge), and the
        windows' lengths in patches."""
        m = self.args.spatial_merge_size
        side = self.args.window_size // m // self.args.patch_size  # merge groups per window side
        order, lens, offset = [], [], 0
        for t, h, w in grids:
            groups = torch.arange(t * (h // m) * (w // m)).view(t, h // m, w // m) + offset
            for frame in groups:
                for r in range(0, h // m, side):
                    for c in range(0, w // m, side):
                        window = frame[r : r + side, c : c + side].flatten()
                        order.append(window)
                        lens.append(window.numel() * m * m)
            offset += groups.numel()
        return torch.cat(order), lens

    def forward(self, patches: torch.Tensor, grids: Sequence[tuple[int, int, int]]) -> torch.Tensor:
        dtype = self.patch_embed.weight.dtype
        x = self.patch_embed(patches.to(dtype))  # [N, D]
        lens = [t * h * w for t, h, w in grids]
        meta = AttentionMetadata.build(lens, x.device, packed=self.packed_attention)
        cos, sin = self.rotary(grids, x.device)
        metas = [meta] * len(self.blocks)
        order = None
        if self.args.window_size:  # every tensor by patch in window order; images stay contiguous
            order, window_lens = self.windows(grids)
            unit = self.args.spatial_merge_size**2
            rows = (order.to(x.device)[:, None] * unit + torch.arange(unit, device=x.device)).flatten()  # [N]
            x, cos, sin = x[rows], cos[rows], sin[rows]
            windowed = AttentionMetadata.build(window_lens, x.device, packed=self.packed_attention)
            full = set(self.args.fullatt_block_indexes)
            metas = [meta if i in full else windowed for i in range(len(self.blocks))]
        for block, block_meta in zip(self.blocks, metas):
            x = block(x, (cos, sin), block_meta)
        merged = self.merger_norm(x).reshape(-1, self.merger_fc1.in_features)  # [N / m², D·m²]
        out = self.merger_fc2(F.gelu(self.merger_fc1(merged)))  # [N / m², hidden]
        if order is not None:  # back to image order
            out = out[torch.argsort(order.to(out.device))]
        return out

    def load_weights(self, state: Mapping[str, torch.Tensor], prefix: str = "") -> None:
        """transformers' names (Qwen2VisionTransformerPretrainedModel), after `prefix` ("visual.", ...)."""
        state = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
        conv = state.pop("patch_embed.proj.weight")  # Conv3d [D, C, T, P, P], kernel = stride: a linear map
        with torch.no_grad():
            self.patch_embed.weight.copy_(conv.reshape(conv.shape[0], -1))
        load_mapped(self, state, VISION_RULES, optional=("patch_embed.weight",))


_B = r"^blocks\.(\d+)\."
VISION_RULES: list[Rule] = [
    (_B + r"attn\.qkv\.", r"blocks.\1.qkv.", None),
    (_B + r"attn\.proj\.", r"blocks.\1.proj.", None),
    (_B + r"mlp\.fc1\.", r"blocks.\1.fc1.", None),
    (_B + r"mlp\.fc2\.", r"blocks.\1.fc2.", None),
    (_B + r"mlp\.(gate_proj|up_proj|down_proj)\.", r"blocks.\1.\2.", None),
    (r"^merger\.ln_q\.", "merger_norm.", None),
    (r"^merger\.mlp\.0\.", "merger_fc1.", None),
    (r"^merger\.mlp\.2\.", "merger_fc2.", None),
]
