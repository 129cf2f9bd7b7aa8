"""CUDA: what PyTorch offers (cuBLAS projections, SDPA attention over a padded grid), vLLM's dtype rule.

Written to the same interface as the CPU platform, so a GPU run exercises exactly this file; its choices are
tested on CPU by running a model through this platform on a CPU device (tests/platforms).
"""

from __future__ import annotations

import torch

from .base import FLOAT16_UNSTABLE, Platform


class CudaPlatform(Platform):
    name = "cuda"

    def default_dtype(self, checkpoint_dtype: str | None, model_type: str | None = None) -> torch.dtype:
        """vLLM 0.34's rule for pooling models (`_resolve_auto_dtype`): float16, a bfloat16 checkpoint kept in
        bfloat16 where the GPU computes it (compute capability 8.0+), never float16 for the unstable models."""
        supported = [torch.float16, torch.float32]
        if torch.cuda.get_device_capability(self.device) >= (8, 0):
            supported.insert(0, torch.bfloat16)
        if model_type in FLOAT16_UNSTABLE:
            supported.remove(torch.float16)
        preferred = torch.float16 if torch.float16 in supported else supported[0]
        wanted = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(checkpoint_dtype or "", preferred)
        return wanted if wanted in supported else preferred
