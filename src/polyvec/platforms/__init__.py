"""The platform seam: everything that differs between devices (CPU, CUDA) behind one small interface.

`get_platform(device, kernels)` returns the platform the model runner and `LLM` ask about dtype defaults,
the token budget, attention on packed batches, preparing a loaded model's projections, and upkeep between
batches. Models expose neutral hooks (`replace_projections`) and never learn which device they run on.
"""

from __future__ import annotations

import torch

from .base import KernelOptions, Platform


def get_platform(device: torch.device, kernels: KernelOptions | None = None) -> Platform:
    if device.type == "cuda":
        from .cuda import CudaPlatform

        return CudaPlatform(device)
    from .cpu import CpuPlatform

    return CpuPlatform(device, kernels or KernelOptions.from_env())


__all__ = ["KernelOptions", "Platform", "get_platform"]
