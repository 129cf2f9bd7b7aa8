"""The one way an `Engine` is built, for `LLM` and `polyvec serve` alike: device → platform → dtype → model
configuration → token budget → engine configuration → engine."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..config import EngineConfig, LongInput, PoolerConfig, Quantization, Truncation, resolve_dtype
from ..loader import load_model_config
from ..platforms import KernelOptions, get_platform
from .engine import Engine


def create_engine(
    model: str,
    *,
    dtype: str | torch.dtype = "auto",
    device: str = "auto",
    max_model_len: int | None = None,
    max_num_batched_tokens: int | None = None,
    max_num_seqs: int = 256,
    pooler_config: PoolerConfig | None = None,
    truncation: Truncation = "auto",
    hf_overrides: dict[str, Any] | None = None,
    revision: str | None = None,
    download_dir: str | None = None,
    num_threads: int | None = None,
    convert: str | None = None,
    long_input: LongInput = "truncate",
    window_overlap: int = 0,
    kv_cache_memory_bytes: int | None = None,
    enable_prefix_caching: bool | None = None,
    quantization: Quantization | None = None,
    kernels: KernelOptions | None = None,
    tokenizer: str | None = None,
) -> Engine:
    """See `LLM` for the arguments. The settings are checked before the model is read."""
    if pooler_config is not None and pooler_config.enable_chunked_processing and long_input == "truncate":
        long_input = "window"  # vLLM's chunked processing of long inputs is polyvec's windows
    checked = EngineConfig(
        max_num_batched_tokens=max_num_batched_tokens or 1,
        max_num_seqs=max_num_seqs,
        device=device,
        truncation=truncation,
        num_threads=num_threads,
        long_input=long_input,
        window_overlap=window_overlap,
        kv_cache_memory_bytes=kv_cache_memory_bytes,
        enable_prefix_caching=enable_prefix_caching,
        quantization=quantization,
        kernels=kernels or KernelOptions.from_env(),
    )
    platform = get_platform(checked.resolve_device(), checked.kernels)
    model_config = load_model_config(
        model,
        dtype=resolve_dtype(dtype, platform),
        max_model_len=max_model_len,
        pooler_config=pooler_config,
        hf_overrides=hf_overrides,
        revision=revision,
        download_dir=download_dir,
        convert=convert,
        tokenizer=tokenizer,
    )
    budget = max_num_batched_tokens or platform.default_max_num_batched_tokens(model_config, quantization)
    return Engine(model_config, dataclasses.replace(checked, max_num_batched_tokens=budget))
