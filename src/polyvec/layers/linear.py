"""Linear layers with weights prepacked for oneDNN on CPU, optionally with the activation fused.

PyTorch's default CPU `F.linear` re-lays the weight out on every call; oneDNN takes a weight reordered once
into its blocked format, and fuses GELU and the residual add into the matmul's epilogue. Each output row depends only
on its input row, so batch invariance is kept. This is the op PyTorch's inductor emits for frozen CPU linears
(`mkldnn._linear_pointwise`); where it is missing (non-mkldnn builds) or on CUDA, layers stay plain `nn.Linear`.

In bfloat16 on CPUs with AMX, batches of at most `AMX_MAX_ROWS` rows (a short query alone: ~10) go to polyvec's
own kernel instead (csrc/amx_linear.cpp): at that size oneDNN's fixed per-call cost and the weight read are the
whole time, and one pass over a weight kept in the tile layout beats it. That second copy of each
weight is why it is opt-in per layer (`amx=True`); the model runner enables it for models whose projections
are small (see `AMX_MAX_COPY_BYTES` in platforms/cpu.py). Both paths compute the same float32 sums of
exact bf16 products (bit-identical outputs without GELU in the tests; the two GELU approximations may round
to neighbouring bf16 values), so across batch sizes a row agrees to bf16 rounding.
"""

from __future__ import annotations

import os
from typing import cast

import torch
from torch import nn

_FUSABLE = {
    "gelu": ("gelu", "none"),
    "gelu_new": ("gelu", "tanh"),
    "gelu_fast": ("gelu", "tanh"),
    "gelu_pytorch_tanh": ("gelu", "tanh"),
    "relu": ("relu", ""),
    "silu": ("swish", ""),
    "swish": ("swish", ""),
}


def onednn_bf16() -> bool:
    """oneDNN has a bf16 matmul on this CPU (AVX512 BW/VL/DQ or AVX-NE-CONVERT); AVX2-only CPUs have none, and
    packing a bf16 weight there raises."""
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(check()) if check is not None else True


def onednn_available(device: torch.device, dtype: torch.dtype) -> bool:
    return (
        device.type == "cpu"
        and dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and (dtype != torch.bfloat16 or onednn_bf16())
    )


# GELU variants polyvec's own epilogues apply (int8 dequantize, AMX): 1 erf, 2 tanh approximation.
_GELU_CODES = {"gelu": 1, "gelu_new": 2, "gelu_fast": 2, "gelu_pytorch_tanh": 2}

# Up to this many rows, a bf16 layer with an AMX copy of its weight uses it (beyond, oneDNN is faster; the
# figures are in benchmarks/RESULTS.md).
AMX_MAX_ROWS = 64


def pack_amx_weight(weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] → [N/16, K/32, 16, 32]: for 16 outputs × 32 inputs, AMX's B tile (16 input pairs × 16 outputs
    × the pair), the layout csrc/amx_linear.cpp reads."""
    n, k = weight.shape
    tiles = weight.view(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4)  # [nb, kb, pair, output, 2]
    return tiles.reshape(n // 16, k // 32, 16, 32).contiguous()


def amx_eligible(linear: nn.Linear, activation: str | None = None) -> bool:
    """bf16, a shape the tile kernel takes, an activation its epilogue applies, and AMX here."""
    from . import kernels

    return (
        linear.weight.dtype == torch.bfloat16
        and linear.in_features % 32 == 0
        and linear.out_features % 32 == 0
        and (activation is None or activation in _GELU_CODES)
        and kernels.amx_linear_available()
    )


class PackedLinear(nn.Module):
    """`act(x @ W.T + b)` with W prepacked for oneDNN; `act` is one of oneDNN's fused post-ops. With `amx`,
    batches of ≤ AMX_MAX_ROWS rows use a second copy of W in AMX's tile layout (module docstring)."""

    def __init__(self, linear: nn.Linear, activation: str | None = None, amx: bool = False):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach())
        self.bias = None if linear.bias is None else linear.bias.detach()
        self.attr, self.algorithm = _FUSABLE[activation] if activation else ("none", "")
        self.amx_weight = self.amx_bias = None
        if amx and amx_eligible(linear, activation):
            self.amx_weight = pack_amx_weight(linear.weight.detach())
            self.amx_bias = None if self.bias is None else self.bias.float()
            self.amx_act = _GELU_CODES[activation] if activation else 0
        self.forms: set[str] = set()  # "plain" / "add" / "mul": the oneDNN primitives this layer's model calls

    def _amx(self, x: torch.Tensor) -> bool:
        return self.amx_weight is not None and x.dim() == 2 and x.shape[0] <= AMX_MAX_ROWS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.forms.add("plain")
        if self._amx(x):
            return torch.ops.polyvec.amx_linear(x.contiguous(), self.amx_weight, self.amx_bias, None, self.amx_act)
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, self.attr, [], self.algorithm)

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """`residual + x @ W.T + b` with the add fused into the matmul's epilogue (a binary post-op): the
        residual stream is not read and written once more."""
        assert self.attr == "none", "a binary post-op replaces the activation"
        self.forms.add("add")
        if self._amx(x):
            return torch.ops.polyvec.amx_linear(
                x.contiguous(), self.amx_weight, self.amx_bias, residual.contiguous(), 0
            )
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.weight, self.bias, "add")

    def forward_mul(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """`other * (x @ W.T + b)` with the product fused into the matmul's epilogue (GeGLU's gate)."""
        assert self.attr == "none", "a binary post-op replaces the activation"
        if self._amx(x):
            return self.forward(x) * other
        self.forms.add("mul")
        return torch.ops.mkldnn._linear_pointwise.binary(x, other, self.weight, self.bias, "mul")

    def primitive_keys(self) -> list[tuple]:
        """What oneDNN keys this layer's primitives on, besides the row count (one per form called)."""
        shape = (self.in_features, self.out_features, self.weight.dtype, self.bias is None, self.attr, self.algorithm)
        return [(form, *shape) for form in sorted(self.forms)]

    @torch.inference_mode()
    def warm(self, form: str, rows: int) -> None:
        """Run the oneDNN primitive of `form` for `rows` rows once (on zeros), so it is compiled and cached."""
        x = torch.zeros(rows, self.in_features, dtype=self.weight.dtype)
        if form in ("add", "mul"):
            torch.ops.mkldnn._linear_pointwise.binary(x, torch.zeros(rows, self.out_features, dtype=x.dtype),
                                                      self.weight, self.bias, form)  # fmt: skip
        else:
            torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, self.attr, [], self.algorithm)

    def extra_repr(self) -> str:
        amx = ", amx" if self.amx_weight is not None else ""
        return f"in={self.in_features}, out={self.out_features}, fused={self.attr}{amx}"


def linear_mul(linear: nn.Module, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """`other * linear(x)`, fused where the linear is prepacked."""
    if isinstance(linear, PackedLinear):
        return linear.forward_mul(x, other)
    return other * linear(x)


# oneDNN ISAs (ONEDNN_MAX_CPU_ISA caps it) without an int8 dot-product instruction: there u8 x s8 products
# go through int16 pair sums that saturate, and int8 outputs drift far from float32.
_ISAS_WITHOUT_VNNI = ("SSE41", "AVX", "AVX2", "AVX512_CORE")


def int8_dot_products() -> bool:
    """Whether oneDNN's int8 matmuls run on VNNI or AMX here, where their integer sums are exact."""
    caps = torch.cpu.get_capabilities()
    if not any(caps.get(name) for name in ("avx512_vnni", "avx_vnni", "amx_int8")):
        return False
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or ""
    return cap.upper() not in _ISAS_WITHOUT_VNNI


def int8_available(device: torch.device) -> bool:
    """oneDNN's int8 matmul (PyTorch's x86 quantization op) and polyvec's quantize passes are both here."""
    from . import kernels

    return (
        device.type == "cpu"
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.onednn, "qlinear_pointwise")
        and kernels.load()
    )


# uint8 rows with their scale and offset, as quantize_rows returns them: x ≈ scale * q + offset per row.
QuantizedRows = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class Int8Linear(nn.Module):
    """`act(x @ W.T + b)` with W in int8 (per output channel, symmetric) and x quantized per token at run time.

    Dynamic W8A8 in the style of SmoothQuant's per-token / per-channel scheme (Xiao et al., 2023,
    https://arxiv.org/abs/2211.10438, without smoothing): each row of x gets its own asymmetric uint8 grid
    (csrc/dynamic_quant.cpp), oneDNN multiplies int8 by int8 into int32 (VNNI / AMX), and one pass rescales
    the row, adds the rank-one zero-point correction, the bias, the activation and the residual. Integer
    products are exact, so each output row still depends only on its input row. Not bit-equal to float:
    close to float32 (the tests bound MiniLM's vectors), not equal.
    """

    def __init__(self, linear: nn.Linear, activation: str | None = None):
        super().__init__()
        if activation is not None and activation not in _GELU_CODES:
            raise ValueError(f"int8 linear: unsupported fused activation {activation!r}")
        if not int8_available(linear.weight.device):
            raise RuntimeError("int8 linear: needs a CPU PyTorch with oneDNN and polyvec's native kernels")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach().float()
        w_scale = (w.abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
        w_int8 = torch.round(w / w_scale[:, None]).clamp(-127, 127).to(torch.int8)
        self.weight = torch.ops.onednn.qlinear_prepack(w_int8, None)
        self.w_scale = w_scale
        self.w_zero_point = torch.zeros(self.out_features, dtype=torch.long)
        # Σ_k of the dequantized weight row: multiplies each token's zero point (see csrc/dynamic_quant.cpp).
        self.colsum = (w_int8.float() * w_scale[:, None]).sum(dim=1)
        self.bias = None if linear.bias is None else linear.bias.detach().float()
        self.act = _GELU_CODES[activation] if activation else 0

    def _int32_sums(self, x: torch.Tensor | QuantizedRows) -> tuple[torch.Tensor, QuantizedRows]:
        """oneDNN's u8 x s8 product (times the weight scales, in float32) and x's quantized rows."""
        qx = x if isinstance(x, tuple) else torch.ops.polyvec.quantize_rows(x)
        y = torch.ops.onednn.qlinear_pointwise(
            qx[0], 1.0, 0, self.weight, self.w_scale, self.w_zero_point, None, 1.0, 0, torch.float32, "none", [], ""
        )
        return y, qx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, (_, scale, offset) = self._int32_sums(x)
        return torch.ops.polyvec.dequantize_rows(y, scale, offset, self.colsum, self.bias, None, self.act, x.dtype)

    def forward_requantized(self, x: torch.Tensor) -> QuantizedRows:
        """`act(x @ W.T + b)` already quantized for the next Int8Linear: the FFN intermediate (4x the hidden
        size) is never written in the activation dtype nor read back to be quantized."""
        y, (_, scale, offset) = self._int32_sums(x)
        return torch.ops.polyvec.requantize_rows(y, scale, offset, self.colsum, self.bias, self.act)

    def forward_add(self, x: torch.Tensor | QuantizedRows, residual: torch.Tensor) -> torch.Tensor:
        """`residual + x @ W.T + b`, the add in the dequantize pass; x may come quantized already."""
        assert self.act == 0, "the residual add replaces the activation"
        y, (_, scale, offset) = self._int32_sums(x)
        return torch.ops.polyvec.dequantize_rows(y, scale, offset, self.colsum, self.bias, residual, 0, residual.dtype)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, int8, act={self.act}"


def pack_linear(linear: nn.Linear, activation: str | None = None, int8: bool = False, amx: bool = False) -> nn.Module:
    """The CPU form of a projection: int8 (`quantization="int8"`) or oneDNN-prepacked (`amx`: with the AMX copy
    for small batches, where eligible); `activation` is fused into it (callers check `can_fuse` first)."""
    return Int8Linear(linear, activation) if int8 else PackedLinear(linear, activation, amx)


def can_fuse(activation: str, int8: bool = False) -> bool:
    return activation in (_GELU_CODES if int8 else _FUSABLE)


def linear_add(linear: nn.Module, x: torch.Tensor | QuantizedRows, residual: torch.Tensor) -> torch.Tensor:
    """`residual + linear(x)`, fused where the linear is prepacked."""
    if isinstance(linear, Int8Linear):
        return linear.forward_add(x, residual)
    # Quantized rows come only from an Int8Linear's `forward_requantized`, whose next projection is int8 too.
    x = cast(torch.Tensor, x)
    if isinstance(linear, PackedLinear):
        return linear.forward_add(x, residual)
    return residual + linear(x)
