"""CPU: oneDNN-prepacked projections, polyvec's native kernels (attention on the packed batch, LayerNorm,
int8, AMX small batches), bf16 where the CPU multiplies it natively, and heap upkeep between batches.

Each native path has a switch (`KernelOptions`) and a plain PyTorch fallback; the test suite runs the
fallbacks too (tests/platforms).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from ..layers import kernels
from ..layers.layernorm import LayerNorm
from ..layers.linear import (
    AMX_MAX_ROWS,
    PackedLinear,
    can_fuse,
    int8_available,
    int8_dot_products,
    onednn_available,
    pack_linear,
)
from .base import KernelOptions, Platform

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from ..config import ModelConfig
    from ..models.interface import Layer
    from ..models.registry import PoolingModel

# oneDNN caches a compiled primitive per matmul shape; the model runner rounds batches up to one of 112 bucket
# sizes (engine/model_runner.py), and a model has four projection shapes per size, each taking two entries (the
# inner product and the matmul inside it): 1024 entries hold every primitive a model can run, so none is rebuilt
# while serving (512 held half, and a server cycling through sizes rebuilt one most steps). oneDNN reads it when
# it first runs, so it is set when this module is imported (with the model runner, before polyvec's first
# matmul); a value set by the user wins.
PRIMITIVE_CACHE_CAPACITY = 1024
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(PRIMITIVE_CACHE_CAPACITY))

# The most memory the AMX copies of the projections may take (MiniLM-L6: 21 MiB, MPNet-base: 162 MiB).
AMX_MAX_COPY_BYTES = 512 * 2**20

# glibc serves allocations above 32 MiB (its largest mmap threshold) with fresh mmaps: every such tensor is
# page-faulted and zeroed by the kernel on first touch, every layer of every batch.
_MMAP_CEILING = 32 << 20

# Batches between two returns of freed heap memory to the OS.
TRIM_EVERY = 16


@functools.lru_cache(maxsize=1)
def bf16_is_faster() -> bool:
    """Whether `auto` picks bfloat16: the CPU has AVX512-BF16 or AMX *and* a bfloat16 matmul measures clearly
    faster than float32 here (some machines report AVX512-BF16 and run bfloat16 at well under float32's
    speed). A few milliseconds, once per process."""
    if not cpu_has_native_bf16():
        return False
    return bf16_speedup() >= BF16_MIN_SPEEDUP


BF16_MIN_SPEEDUP = 1.2  # below this, float32's exactness wins (AMX and Zen 4 measure well above)


def bf16_speedup(rounds: int = 10) -> float:
    """float32 time / bfloat16 time of a projection-shaped matmul (256 x 384 @ 384 x 1536) on one thread, the
    two dtypes alternated, best of `rounds` each: on two threads, or one dtype's runs after the other's, a busy
    neighbour process swung the ratio across the threshold between runs (and auto's choice with it); one thread,
    interleaved, measures the cores' own ratio whether or not the machine is busy."""
    import time

    pairs = [(torch.randn(256, 384, dtype=d), torch.randn(384, 1536, dtype=d)) for d in (torch.float32, torch.bfloat16)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for a, b in pairs:
            a @ b  # oneDNN's first call builds its kernel
        best = [float("inf"), float("inf")]
        for _ in range(rounds):
            for k, (a, b) in enumerate(pairs):
                start = time.perf_counter()
                a @ b
                best[k] = min(best[k], time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return best[0] / max(best[1], 1e-9)


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX in the CPU's flags (bfloat16 matmuls may then run at about twice float32)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="ignore") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def _glibc_malloc_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        return libc.malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS, Windows): nothing to do
        return None


_MALLOC_TRIM = _glibc_malloc_trim()


class Projections:
    """How a model's layers swap their `nn.Linear`s for the CPU forms (the `replace_projections` hook)."""

    def __init__(self, int8: bool, amx: bool):
        self.int8, self.amx = int8, amx

    def fuses(self, activation: str) -> bool:
        return can_fuse(activation, self.int8)

    def __call__(self, linear: nn.Linear, activation: str | None = None) -> nn.Module:
        return pack_linear(linear, activation, int8=self.int8, amx=self.amx)


def _one_thread_after_fork() -> None:
    """In a forked child (gunicorn --preload, DataLoader or multiprocessing workers): torch on one thread. The
    parent's OpenMP pool (which loading a model starts) does not exist there, and the child's first parallel op
    waited for it for ever; torch's DataLoader sets its workers to one thread the same way."""
    torch.set_num_threads(1)


_FORK_HOOK: list[bool] = []


class CpuPlatform(Platform):
    name = "cpu"

    def __init__(self, device: torch.device, options: KernelOptions | None = None):
        super().__init__(device)
        if not _FORK_HOOK and hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=_one_thread_after_fork)
            _FORK_HOOK.append(True)
        self.options = options or KernelOptions.from_env()
        self.onednn = False
        self._batches = 0

    def native_kernels(self) -> bool:
        return self.options.native and kernels.load()

    def check_dtype(self, dtype: torch.dtype) -> None:
        if dtype == torch.bfloat16 and not bf16_is_faster():
            logger.warning(
                "dtype bfloat16 on this CPU: its bfloat16 matmuls are not faster than float32's (%s); dtype auto "
                "(float32 here) runs faster",
                "measured" if cpu_has_native_bf16() else "no AVX512-BF16 or AMX",
            )

    def verify_quantization(self, quantization: str | None) -> None:
        pass  # prepare_model checks what int8 needs here (dtype, oneDNN, kernels, VNNI)

    def default_dtype(self, checkpoint_dtype: str | None, model_type: str | None = None) -> torch.dtype:
        return torch.bfloat16 if bf16_is_faster() else torch.float32

    def default_max_num_batched_tokens(self, model_config: ModelConfig, quantization: str | None) -> int:
        """The largest power of two (1024..8192) whose widest activation (tokens x max(FFN width, 3 x hidden))
        stays under glibc's mmap ceiling, so per-layer tensors are reused from the heap instead of faulted in
        anew. int8 projections write float32 before rescaling, whatever the activation dtype."""
        cfg = model_config.hf_config
        width = max(int(cfg.get("intermediate_size", 0) or 0), 3 * model_config.hidden_size)
        tokens = 1024
        itemsize = 4 if quantization == "int8" else model_config.dtype.itemsize
        while tokens < 8192 and 2 * tokens * width * itemsize <= _MMAP_CEILING:
            tokens *= 2
        return tokens if model_config.is_causal else max(tokens, model_config.max_model_len)

    def packed_attention(self, dtype: torch.dtype, head_dim: int) -> bool:
        return self.options.native and kernels.packed_attention_available(self.device, dtype, head_dim)

    def prepare_model(self, model: PoolingModel, model_config: ModelConfig, quantization: str | None) -> None:
        int8 = quantization == "int8"
        self.onednn = self.options.onednn and onednn_available(self.device, model_config.dtype)
        native = self.native_kernels()
        if int8 and not (self.onednn and native and int8_available(self.device)):
            raise ValueError(
                "quantization='int8' needs a CPU device, dtype float32 or bfloat16, PyTorch with "
                "oneDNN and polyvec's native kernels (it found: device "
                f"{self.device}, dtype {model_config.dtype})"
            )
        if int8 and not int8_dot_products():
            raise ValueError(
                "quantization='int8' needs a CPU with int8 dot products (AVX512-VNNI, AVX-VNNI or AMX): without "
                "them oneDNN's int8 sums saturate and outputs drift far from float32; use dtype bfloat16 instead"
            )
        if native:
            torch.ops.polyvec.set_amx_enabled(self.options.amx)
        if self.onednn:
            # bf16 batches of a few rows (a query alone) run on AMX from a second copy of each projection's
            # weight (layers/linear.py); models whose projections exceed AMX_MAX_COPY_BYTES keep one copy.
            layers = cast(nn.ModuleList, model.encoder.layers)  # every trunk's, each a `Layer`
            size = sum(m.weight.numel() * m.weight.element_size() for m in layers.modules() if isinstance(m, nn.Linear))
            amx = native and self.options.amx and not int8 and size <= AMX_MAX_COPY_BYTES
            projections = Projections(int8, amx)
            for layer in layers:
                cast("Layer", layer).replace_projections(projections)
            # Input encoders (a vision tower) run on hundreds of rows per image: oneDNN's forms, no AMX copies.
            for tower in getattr(model.encoder, "towers", ()):
                cast("Layer", tower).replace_projections(Projections(int8, amx=False))
            # and the rest (a vision tower's patch embedding and merger): batch-invariant, as the heads
            self.prepare_head(model.encoder)
        if native:
            for module in model.modules():  # LayerNorm, and layers with a native step of their own (`native`)
                if isinstance(module, LayerNorm) or hasattr(module, "native"):
                    setattr(module, "native", True)  # noqa: B010 (nn.Module's typed attribute access)

    def prepare_head(self, head: nn.Module) -> nn.Module:
        # MKL's result for a row depends on how many rows it is multiplied with (a query alone differs from
        # the same query in a batch by ~1e-5); oneDNN's packed form does not, so heads are batch-invariant.
        if not self.options.onednn:
            return head
        if isinstance(head, nn.Linear):  # ScoreHead too
            return PackedLinear(head) if onednn_available(self.device, head.weight.dtype) else head
        for name, child in head.named_children():
            setattr(head, name, self.prepare_head(child))
        return head

    def warm_kernels(self, model: PoolingModel, rows: int) -> None:
        # oneDNN keys a primitive on the shapes, not the weights: one call per distinct projection and form.
        seen: set[tuple] = set()
        for module in model.modules():
            if not isinstance(module, PackedLinear) or (module.amx_weight is not None and rows <= AMX_MAX_ROWS):
                continue
            for key in module.primitive_keys():
                if key not in seen:
                    seen.add(key)
                    module.warm(key[0], rows)

    def pads_to_bucket(self, packed_attention: bool) -> bool:
        # Dummy sequences attend only to themselves, which needs the packed kernel (no grid to pad).
        return self.onednn and packed_attention

    def after_batch(self) -> None:
        self._batches += 1
        if self._batches % TRIM_EVERY == 0:
            # Batches allocate tensors of ever-different sizes; glibc keeps the freed ones in its heap, so a
            # long offline run's RSS would creep up. Trimming every few batches keeps it flat.
            self.release_memory()

    def release_memory(self) -> None:
        if _MALLOC_TRIM is not None:
            _MALLOC_TRIM(0)
