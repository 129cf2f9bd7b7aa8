"""LayerNorm (Ba et al., https://arxiv.org/abs/1607.06450) that can run polyvec's native CPU kernel.

`nn.LayerNorm` with the same parameters (so checkpoints load unchanged); once `native` is set (the model
runner sets it on CPU where the kernels are built, see layers/kernels.py), 2-D float32 / bfloat16 input goes
to `torch.ops.polyvec.layer_norm` (csrc/layer_norm.cpp), which reads each row once. Arithmetic is float32 in
both dtypes, as in PyTorch's.
"""

from __future__ import annotations

import torch
from torch import nn


class LayerNorm(nn.LayerNorm):
    native = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            self.native
            and x.dim() == 2
            and x.dtype in (torch.float32, torch.bfloat16)
            and self.weight is not None
            and self.bias is not None
        ):
            return torch.ops.polyvec.layer_norm(x, self.weight, self.bias, self.eps)
        return super().forward(x)
