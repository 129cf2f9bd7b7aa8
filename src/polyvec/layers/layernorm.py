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
    _zero_bias: torch.Tensor | None = None  # a bias-free norm (ModernBERT's) gives the kernel zeros

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native and x.dim() == 2 and x.dtype in (torch.float32, torch.bfloat16) and self.weight is not None:
            bias = self.bias
            if bias is None:
                if self._zero_bias is None or self._zero_bias.dtype != self.weight.dtype:
                    self._zero_bias = torch.zeros_like(self.weight)
                bias = self._zero_bias
            return torch.ops.polyvec.layer_norm(x, self.weight, bias, self.eps)
        return super().forward(x)
