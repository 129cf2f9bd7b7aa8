"""The one way an `Engine` is built, for `LLM` and `polyvec serve` alike: device → platform → dtype → model
configuration → token budget → engine configuration → engine."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..config import (
    EngineConfig,
    LongInput,
    ModelConfig,
    PoolerConfig,
    Quantization,
    SchedulingPolicy,
    Truncation,
    resolve_dtype,
)
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
    limit_mm_per_prompt: dict[str, int] | None = None,
    mm_processor_kwargs: dict[str, Any] | None = None,
    max_image_pixels: int = 50_000_000,
    max_request_image_pixels: int | None = None,
    allowed_media_domains: list[str] | tuple[str, ...] | None = None,
    scheduling_policy: SchedulingPolicy = "fcfs",
) -> Engine:
    """See `LLM` for the arguments. The settings are checked before the model is read."""
    if max_model_len == -1:  # vLLM's "auto": the model's own
        max_model_len = None
    for name, value in (("max_model_len", max_model_len), ("max_num_batched_tokens", max_num_batched_tokens)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive integer, got {value!r}")  # 0 meant the default, True 1
    if hf_overrides is not None and not isinstance(hf_overrides, dict):
        raise ValueError(f"hf_overrides must be a dict of config fields, got {type(hf_overrides).__name__}")
    if pooler_config is not None and pooler_config.enable_chunked_processing and long_input == "truncate":
        long_input = "window"  # vLLM's chunked processing of long inputs is polyvec's windows
    # one host given as a string is that host (iterated, it was its letters: a check any host passed)
    hosts = [allowed_media_domains] if isinstance(allowed_media_domains, str) else allowed_media_domains or ()
    checked = EngineConfig(
        max_num_batched_tokens=max_num_batched_tokens or 1,
        max_num_seqs=max_num_seqs,
        scheduling_policy=scheduling_policy,
        device=device,
        truncation=truncation,
        num_threads=num_threads,
        long_input=long_input,
        window_overlap=window_overlap,
        kv_cache_memory_bytes=kv_cache_memory_bytes,
        enable_prefix_caching=enable_prefix_caching,
        quantization=quantization,
        kernels=kernels or KernelOptions.from_env(),
        max_images_per_prompt=_images_per_prompt(limit_mm_per_prompt),
        max_image_pixels=max_image_pixels,
        max_request_image_pixels=max_request_image_pixels,
        allowed_media_domains=tuple(d.lower().strip(".") for d in hosts),
    )
    platform = get_platform(checked.resolve_device(), checked.kernels)
    platform.verify_quantization(quantization)
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
    # again with the model's type known: auto's rules that read the checkpoint (CUDA), float16 refused for Gemma 3
    if (chosen := resolve_dtype(dtype, platform, model_config.hf_config)) != model_config.dtype:
        model_config = dataclasses.replace(model_config, dtype=chosen)
    if mm_processor_kwargs:
        model_config = _with_processor_kwargs(model_config, mm_processor_kwargs)
    if checked.window_overlap * 2 >= model_config.max_model_len:  # as a request's own window_overlap is checked
        raise ValueError(
            f"window_overlap={checked.window_overlap} must be less than half of "
            f"max_model_len={model_config.max_model_len}: each window must move on"
        )
    budget = max_num_batched_tokens or platform.default_max_num_batched_tokens(model_config, quantization)
    engine = Engine(model_config, dataclasses.replace(checked, max_num_batched_tokens=budget))
    shaping = {
        "hf_overrides": hf_overrides,
        "pooler_config": None if pooler_config is None else pooler_config.to_dict(),
        "max_model_len": max_model_len,
        "revision": revision,
        "tokenizer": tokenizer,
        "convert": convert,
        "mm_processor_kwargs": mm_processor_kwargs,
        "long_input": None if long_input == "truncate" else long_input,
        "window_overlap": window_overlap or None,
        # the numbers too: an index's queries in the dtype and quantization its documents were encoded in
        "dtype": None if dtype == "auto" else dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch."),
        "quantization": quantization,
    }
    engine.options = {name: value for name, value in shaping.items() if value is not None}
    return engine


def _images_per_prompt(limit: dict[str, int] | None) -> int | None:
    """vLLM's limit_mm_per_prompt ({"image": N}); other modalities may only be limited to 0 (none are read)."""
    if limit is None:
        return None
    if not isinstance(limit, dict):
        raise ValueError(f'limit_mm_per_prompt must be a dict like {{"image": 4}}, got {limit!r}')
    counts: dict[str, Any] = {k: (v.get("count") if isinstance(v, dict) else v) for k, v in limit.items()}
    for modality, n in counts.items():  # vLLM's dict form {"count": N, ...} counts too
        if modality != "image" and n:
            raise ValueError(f"limit_mm_per_prompt: polyvec reads images only, not {modality!r}")
    n = counts.get("image")
    if n is None:
        return None
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"limit_mm_per_prompt['image'] must be an integer >= 0, got {n!r}")
    return n


PROCESSOR_KWARGS = ("min_pixels", "max_pixels")


def _with_processor_kwargs(model_config: ModelConfig, kwargs: dict[str, Any]) -> ModelConfig:
    """vLLM's mm_processor_kwargs: the image processor's resize budget (min_pixels / max_pixels, in pixels)."""
    spec = model_config.colqwen2
    if spec is None:
        raise ValueError(f"mm_processor_kwargs apply to image models; {model_config.model} reads text only")
    if spec.family == "paligemma":
        raise ValueError("mm_processor_kwargs: ColPali resizes every image to one square size; no budget to set")
    unknown = sorted(set(kwargs) - set(PROCESSOR_KWARGS))
    if unknown:
        raise ValueError(
            f"mm_processor_kwargs: {', '.join(unknown)} not supported; polyvec takes min_pixels, max_pixels"
        )
    values = {k: kwargs[k] for k in PROCESSOR_KWARGS if k in kwargs}
    for k, v in values.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"mm_processor_kwargs[{k!r}] must be a positive integer, got {v!r}")
    spec = dataclasses.replace(spec, **values)
    if spec.min_pixels > spec.max_pixels:
        raise ValueError(f"mm_processor_kwargs: min_pixels {spec.min_pixels} > max_pixels {spec.max_pixels}")
    sources = {**model_config.sources, "pixels": "mm_processor_kwargs"}
    return dataclasses.replace(model_config, colqwen2=spec, sources=sources)
