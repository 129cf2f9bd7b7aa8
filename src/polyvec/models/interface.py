"""The interfaces between models and the rest of polyvec, written down.

A trunk maps a packed batch to hidden states; its layers accept the platform's forms of their projections
through `replace_projections`, which is all a model knows of the device it runs on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

if TYPE_CHECKING:
    from ..layers.attention import AttentionMetadata
    from .args import Args


class ProjectionPacker(Protocol):
    """Turns an `nn.Linear` (with an activation to fuse, if any) into the platform's form of it."""

    def fuses(self, activation: str) -> bool: ...

    def __call__(self, linear: nn.Linear, activation: str | None = None) -> nn.Module: ...


class Layer(Protocol):
    def replace_projections(self, pack: ProjectionPacker) -> None: ...


class Trunk(Protocol):
    """Packed `input_ids` [T] (+ segment ids, + attention metadata) → hidden states [T, H]."""

    @property
    def args(self) -> Args:
        """The model's typed config (`EncoderArgs` or `DecoderArgs`)."""
        ...

    layers: nn.ModuleList
    """Each a `Layer`."""
    causal: bool
    """Decoders also have `kv_shape()` → (layers, kv heads, head dim) for their KV caches; multimodal trunks
    have `towers`, the `Layer`s of their input encoders (a vision tower's blocks), packed apart from `layers`."""

    def __call__(
        self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None, meta: AttentionMetadata
    ) -> torch.Tensor: ...
