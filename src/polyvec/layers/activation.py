"""Activation functions named as in HF `config.json` (`hidden_act`) and sentence-transformers modules."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


QUICK_GELU = 1.702  # quick_gelu(x) = x·σ(1.702x) = silu(1.702x) / 1.702


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(QUICK_GELU * x)  # CLIP's and Qwen2-VL's vision towers


def identity(x: torch.Tensor) -> torch.Tensor:
    return x


_HIDDEN_ACTS = {
    "gelu": F.gelu,  # exact (erf) GELU, as BERT defines it
    "gelu_new": _gelu_tanh,
    "gelu_fast": _gelu_tanh,
    "gelu_pytorch_tanh": _gelu_tanh,
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "quick_gelu": quick_gelu,
    "identity": identity,
}


def get_act_fn(name: str):
    try:
        return _HIDDEN_ACTS[name]
    except KeyError:
        raise ValueError(f"unsupported activation {name!r}; supported: {', '.join(_HIDDEN_ACTS)}") from None


class Dense(nn.Module):
    """sentence-transformers `Dense`: activation(linear(x)) [+ x, or + residual(x) when sizes differ].

    Weights are named `linear.weight`/`linear.bias` (and `residual.weight`) as in its saved files.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, activation: str, use_residual: bool = False):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features, bias=bias)
        self.act = classifier_activation(activation)
        self.use_residual = use_residual
        self.residual = (
            nn.Linear(in_features, out_features, bias=False) if use_residual and in_features != out_features else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.act(self.linear(x))
        if self.use_residual:
            out = out + (x if self.residual is None else self.residual(x))
        return out


def classifier_activation(name: str):
    """The classify tasks' activation: softmax over labels, sigmoid per label, or identity."""
    if name == "softmax":
        return lambda x: torch.softmax(x, dim=-1)
    return get_act_fn(name)
