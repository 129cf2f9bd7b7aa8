"""CUDA: what PyTorch offers (cuBLAS projections, SDPA attention over a padded grid), bf16 by default.

Written to the same interface as the CPU platform, so a GPU run exercises exactly this file; its choices are
tested on CPU by running a model through this platform on a CPU device (tests/platforms).
"""

from __future__ import annotations

import torch

from .base import Platform


class CudaPlatform(Platform):
    name = "cuda"

    def default_dtype(self, checkpoint_dtype: str | None) -> torch.dtype:
        return torch.float16 if checkpoint_dtype == "float16" else torch.bfloat16
