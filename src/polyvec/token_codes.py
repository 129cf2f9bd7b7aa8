"""Token vectors stored small: int8 codes with one scale per vector, or sign bits, and MaxSim against them.

int8: code = round(127 · x / max|x|) per vector, scale = max|x| / 127, so x ≈ code · scale (4x smaller than
float32, plus 4 bytes a vector). binary: the sign bits (x ≥ 0), packed most significant bit first as
`np.packbits` writes them (32x smaller); a binary vector reads back as (2b − 1) / √d, a unit vector. MaxSim is
asymmetric: the query stays float32 and meets the documents' codes read back, so only the documents' storage
shrinks (the scheme of PLAID-style and Qdrant-quantized multivector stores).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

TokenEncoding = Literal["int8", "binary"]
TOKEN_ENCODINGS: tuple[str, ...] = ("int8", "binary")


@dataclass(frozen=True)
class TokenCodes:
    """A document's token vectors in a small form; `dim` is the vectors' width."""

    encoding: TokenEncoding
    codes: torch.Tensor  # int8 [n, dim] | uint8 [n, ceil(dim / 8)]
    scales: torch.Tensor | None  # float32 [n] (int8), None (binary)
    dim: int

    @property
    def nbytes(self) -> int:
        extra = 0 if self.scales is None else self.scales.numel() * 4
        return self.codes.numel() * self.codes.element_size() + extra

    def dequantize(self) -> torch.Tensor:
        """The vectors as float32 [n, dim]."""
        if self.encoding == "int8":
            assert self.scales is not None
            return self.codes.float() * self.scales[:, None]
        bits = np.unpackbits(self.codes.numpy(), axis=1)[:, : self.dim]
        return (torch.from_numpy(bits).float() * 2 - 1) / math.sqrt(self.dim)


def encode_tokens(vectors: torch.Tensor, encoding: str) -> TokenCodes:
    """float token vectors [n, d] → their codes."""
    x = vectors.detach().float().cpu()
    if encoding == "int8":
        peak = x.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny)  # [n]
        codes = torch.round(x * (127.0 / peak[:, None])).clamp_(-127, 127).to(torch.int8)
        return TokenCodes("int8", codes, peak / 127.0, x.shape[1])
    if encoding == "binary":
        packed = np.packbits((x >= 0).numpy(), axis=1)
        return TokenCodes("binary", torch.from_numpy(packed), None, x.shape[1])
    raise ValueError(f"token_encoding must be one of {', '.join(TOKEN_ENCODINGS)}, got {encoding!r}")


def maxsim(query: torch.Tensor, document: torch.Tensor | TokenCodes) -> float:
    """Σ over query tokens of the max over document tokens of their dot product, in float32; a document may be
    codes (asymmetric: the query is not quantized)."""
    doc = document.dequantize() if isinstance(document, TokenCodes) else document.float()
    return float((query.float() @ doc.T).amax(dim=1).sum())
