"""Token, position and bias tables."""

from __future__ import annotations

from torch import nn


class Embedding(nn.Embedding):
    """`nn.Embedding` without its random initialisation: every table is loaded from the checkpoint, and on the
    meta device (where models are built) `normal_` imports torch._dynamo, which a start does not need."""

    def reset_parameters(self) -> None:
        pass
