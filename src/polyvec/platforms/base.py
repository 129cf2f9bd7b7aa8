"""The interface every platform implements, and the switches for polyvec's native CPU code."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

# vLLM's _FLOAT16_NOT_SUPPORTED_MODELS: numerically unstable in float16 (never its default; refused when asked for).
FLOAT16_UNSTABLE = ("gemma2", "gemma3", "gemma3_text", "glm4")

if TYPE_CHECKING:
    from ..config import ModelConfig
    from ..models.registry import PoolingModel


def _disabled(name: str) -> bool:
    return os.environ.get(name, "0") == "1"


@dataclass(frozen=True)
class KernelOptions:
    """Which of polyvec's own CPU paths may run (each falls back to plain PyTorch when off)."""

    native: bool = True
    """polyvec's C++ kernels: packed attention, LayerNorm, int8 quantize passes, AMX projections."""
    onednn: bool = True
    """Projections prepacked for oneDNN, with the activation fused."""
    amx: bool = True
    """AMX tiles (bf16 attention and small-batch projections) where the CPU has them."""

    @classmethod
    def from_env(cls) -> KernelOptions:
        """The defaults, less what POLYVEC_DISABLE_KERNELS / _ONEDNN / _AMX=1 turn off (read here only)."""
        return cls(
            native=not _disabled("POLYVEC_DISABLE_KERNELS"),
            onednn=not _disabled("POLYVEC_DISABLE_ONEDNN"),
            amx=not _disabled("POLYVEC_DISABLE_AMX"),
        )


class Platform:
    """What the engine asks of a device. Subclasses override what differs; these defaults are plain PyTorch."""

    name = "base"

    def __init__(self, device: torch.device):
        self.device = device

    def default_dtype(self, checkpoint_dtype: str | None, model_type: str | None = None) -> torch.dtype:
        """The dtype `dtype="auto"` means here, for a checkpoint saved in `checkpoint_dtype`."""
        return torch.float32

    def check_dtype(self, dtype: torch.dtype) -> None:
        """Say (a warning) when a dtype the user chose runs slower here than the one `auto` would pick."""

    def verify_quantization(self, quantization: str | None) -> None:
        """Refuse a quantization this device cannot run, before the model is read."""
        if quantization is not None:
            raise ValueError(f"quantization={quantization!r} runs on CPU only (device {self.device})")

    def default_max_num_batched_tokens(self, model_config: ModelConfig, quantization: str | None) -> int:
        """The token budget of one forward pass when the user sets none (encoders: at least one whole input)."""
        return 8192 if model_config.is_causal else max(8192, model_config.max_model_len)

    def configure_threads(self, num_threads: int | None) -> None:
        if num_threads is not None:
            torch.set_num_threads(num_threads)

    def packed_attention(self, dtype: torch.dtype, head_dim: int) -> bool:
        """Whether bidirectional attention runs straight on the packed batch (else SDPA over a padded grid)."""
        return False

    def prepare_model(self, model: PoolingModel, model_config: ModelConfig, quantization: str | None) -> None:
        """Called once the weights are loaded: swap in this device's forms of the projections and norms."""
        self.verify_quantization(quantization)

    def prepare_head(self, head: nn.Module) -> nn.Module:
        """A float32 head (classifier, projection, vocabulary decoder) in this device's form."""
        return head

    def pads_to_bucket(self, packed_attention: bool) -> bool:
        """Whether batches are rounded up to recurring token counts (kernels compiled per shape stay cached)."""
        return False

    def warm_kernels(self, model: PoolingModel, rows: int) -> None:
        """Compile and cache the kernels a batch of `rows` tokens runs (where kernels are built per shape)."""

    def after_batch(self) -> None:
        """Upkeep between batches."""

    def release_memory(self) -> None:
        """Return memory freed by the allocator to the OS where it keeps it (after a warm-up)."""
