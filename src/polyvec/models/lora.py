"""PEFT LoRA adapters merged into their base checkpoint's weights at load time: W + s · B·A.

Some checkpoints ship only an adapter (`adapter_config.json` + `adapter_model.safetensors`) that names its base
model, as colpali-engine's ColQwen2 and ColQwen2.5 releases do (vidore/colqwen2-v1.0 on vidore/colqwen2-base).
The merge is PEFT's own: for each adapted linear layer, W += (alpha / r) · B @ A (alpha / √r with rsLoRA; ranks
and alphas overridden per module by `rank_pattern` / `alpha_pattern`), computed in float32 and cast back. Tensors
the adapter holds whole (`modules_to_save`, trained biases) replace the base's. Once merged, the model is a plain
checkpoint: nothing of the adapter runs per request.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import torch

from ..config import LoraSpec

ADAPTER_CONFIG = "adapter_config.json"
_PREFIX = "base_model.model."


def _pattern_value(patterns: dict[str, float], module: str, default: float) -> float:
    """PEFT's per-module override: the first key that ends the module's dotted name."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def is_adapter(folder: Path) -> bool:
    return (folder / ADAPTER_CONFIG).is_file() and not (folder / "config.json").is_file()


def has_embedded_adapter(folder: Path) -> bool:
    """A whole model with an adapter beside its weights: transformers loads the local weights, then the adapter."""
    return (folder / ADAPTER_CONFIG).is_file() and (folder / "config.json").is_file()


def read_adapter_config(folder: Path, base: str | None = None) -> LoraSpec:
    """The adapter's settings; anything whose merge is not W + s·B·A is refused by name. `base`: the model it
    adapts, when not the one its config names (an adapter embedded in a whole model adapts that model)."""
    cfg: dict[str, Any] = json.loads((folder / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    where = folder / ADAPTER_CONFIG
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{where}: peft_type {cfg.get('peft_type')!r} is not supported; polyvec merges LORA adapters")
    # aLoRA (alora_invocation_tokens) adapts only tokens after its invocation; Arrow routes among adapters
    refused = ("use_dora", "fan_in_fan_out", "layer_replication", "lora_bias", "use_qalora", "alora_invocation_tokens",
               "arrow_config")  # fmt: skip
    for key in (*refused, "trainable_token_indices", "target_parameters"):  # the last two: not a W + s·B·A merge
        if cfg.get(key):
            raise ValueError(f"{where}: {key}={cfg[key]!r} is not supported; polyvec merges plain LoRA adapters")
    base = base or cfg.get("base_model_name_or_path")
    if not base:
        raise ValueError(f"{where} names no base_model_name_or_path: polyvec cannot tell which model it adapts")
    return LoraSpec(
        path=folder,
        base_model=str(base),
        r=int(cfg.get("r", 8)),
        alpha=float(cfg.get("lora_alpha", 8)),
        use_rslora=bool(cfg.get("use_rslora", False)),
        alpha_pattern={str(k): float(v) for k, v in (cfg.get("alpha_pattern") or {}).items()},
    )


def _read_adapter_weights(folder: Path) -> dict[str, torch.Tensor]:
    if (folder / "adapter_model.safetensors").is_file():
        from safetensors.torch import load_file

        return load_file(folder / "adapter_model.safetensors")
    if (folder / "adapter_model.bin").is_file():
        return torch.load(folder / "adapter_model.bin", map_location="cpu", weights_only=True)
    raise ValueError(f"no adapter_model.safetensors or adapter_model.bin in {folder}")


def _bare(name: str) -> str:
    """A tensor name without wrapper segments (`model.`, `vision_model.`), which transformers 5 leaves out of
    module names at run time (so in a new adapter's keys) but writes in checkpoints, as older versions named them."""
    return re.sub(r"(^|\.)(model|vision_model)\.", r"\1", name)


def _find(state: dict[str, torch.Tensor], name: str, bare: dict[str, str | None]) -> str | None:
    if name in state:
        return name
    return bare.get(_bare(name))


def merge_lora(state: dict[str, torch.Tensor], spec: LoraSpec) -> int:
    """Merge the adapter into `state` (the base checkpoint's tensors, by their names) in place; returns how many
    layers it changed."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    whole: dict[str, torch.Tensor] = {}
    for key, tensor in _read_adapter_weights(spec.path).items():
        name = key[len(_PREFIX) :] if key.startswith(_PREFIX) else key
        if ".lora_embedding_" in name or ".lora_magnitude_vector" in name:
            raise ValueError(f"adapter tensor {key}: only LoRA on linear layers is supported")
        m = re.fullmatch(r"(.+)\.(lora_A|lora_B)(?:\.[^.]+)?\.weight", name)
        if m:
            pairs.setdefault(m.group(1), {})[m.group(2)] = tensor
        elif ".trainable_tokens_" in name or ".token_adapter." in name:
            raise ValueError(f"adapter tensor {key}: trainable tokens are not supported; polyvec merges LoRA layers")
        else:  # modules_to_save, trained biases (PEFT names them `<layer>.base_layer.bias`): they replace the base's
            whole[name.replace(".modules_to_save.default.", ".").replace(".base_layer.", ".")] = tensor
    bare: dict[str, str | None] = {}
    for key in state:  # a bare name two tensors share finds neither
        bare[_bare(key)] = None if _bare(key) in bare else key
    for module, ab in pairs.items():
        if set(ab) != {"lora_A", "lora_B"}:
            raise ValueError(f"adapter module {module} lacks its {'lora_B' if 'lora_A' in ab else 'lora_A'} weight")
        target = _find(state, module + ".weight", bare)
        if target is None and module.rsplit(".", 1)[-1] == "lm_head":
            continue  # a tied or dropped output layer: pooling never runs it
        if target is None:
            raise ValueError(f"adapter module {module} adapts {module}.weight, which the base checkpoint does not have")
        a, b, w = ab["lora_A"].float(), ab["lora_B"].float(), state[target]
        alpha = _pattern_value(spec.alpha_pattern, module, spec.alpha)
        rank = a.shape[0]  # rank_pattern's, where it names this module
        delta = (b @ a) * (alpha / (math.sqrt(rank) if spec.use_rslora else rank))  # [out, r] @ [r, in]
        if delta.shape != w.shape:
            raise ValueError(f"adapter module {module}: B·A is {tuple(delta.shape)}, {target} is {tuple(w.shape)}")
        state[target] = (w.float() + delta).to(w.dtype)
    for name, tensor in whole.items():
        found = _find(state, name, bare)
        if found is None and name.rsplit(".", 2)[-2:-1] == ["lm_head"]:
            continue  # PEFT saves the output layer's base weight beside its LoRA; pooling never runs it
        if found is None:
            raise ValueError(f"adapter tensor {name} has no counterpart in the base checkpoint")
        state[found] = tensor.to(state[found].dtype)
    return len(pairs)
