"""Linear layers with weights prepacked for oneDNN on CPU, optionally with the activation fused.

PyTorch's default CPU `F.linear` re-lays the weight out on every call; oneDNN with a weight reordered once
into its blocked format reaches ~1.5x the fp32 throughput on these cores (AVX-512) and fuses GELU into the
matmul's epilogue. Each output row depends only on its input row, so batch invariance is kept. This is the
op PyTorch's inductor emits for frozen CPU linears (`mkldnn._linear_pointwise`); where it is missing
(non-mkldnn builds) or on CUDA, layers stay plain `nn.Linear`.
"""

from __future__ import annotations

import os

import torch
from torch import nn

_FUSABLE = {"gelu": ("gelu", "none"), "gelu_new": ("gelu", "tanh"), "gelu_fast": ("gelu", "tanh"),
            "gelu_pytorch_tanh": ("gelu", "tanh"), "relu": ("relu", ""), "silu": ("swish", ""),
            "swish": ("swish", "")}


def onednn_available(device: torch.device, dtype: torch.dtype) -> bool:
    return (device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
            and os.environ.get("POLYVEC_DISABLE_ONEDNN", "0") != "1"
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class PackedLinear(nn.Module):
    """`act(x @ W.T + b)` with W prepacked for oneDNN; `act` is one of oneDNN's fused post-ops."""

    def __init__(self, linear: nn.Linear, activation: str | None = None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach())
        self.bias = None if linear.bias is None else linear.bias.detach()
        self.attr, self.algorithm = _FUSABLE[activation] if activation else ("none", "")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, self.attr, [], self.algorithm)

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """`residual + x @ W.T + b` with the add fused into the matmul's epilogue (a binary post-op): the
        residual stream is not read and written once more (~10% of an fp32 projection, ~2x in bf16)."""
        assert self.attr == "none", "a binary post-op replaces the activation"
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.weight, self.bias, "add")

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, fused={self.attr}"


def can_fuse(activation: str) -> bool:
    return activation in _FUSABLE


def linear_add(linear: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """`residual + linear(x)`, fused where the linear is prepacked."""
    if isinstance(linear, PackedLinear):
        return linear.forward_add(x, residual)
    return residual + linear(x)
