"""Read a checkpoint's tensors and map their names onto polyvec's modules (vLLM's `load_weights` idea).

Rules are `(regex, replacement, shard)`: the first rule that matches renames the key; `shard` i copies the
tensor into the i-th equal slice of a fused parameter (q, k, v → qkv). Keys no rule or parameter claims are
checkpoint extras (buffers, unused heads) and are skipped; a parameter nothing filled is an error.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch
from torch import nn

logger = logging.getLogger(__name__)

Rule = tuple[str, str, int | None]


def load_mapped(
    module: nn.Module,
    state: dict[str, torch.Tensor],
    rules: list[Rule],
    strip_prefixes: tuple[str, ...] = (),
    optional: tuple[str, ...] = (),
) -> None:
    params = dict(module.named_parameters())
    filled: set[str] = set()
    compiled = [(re.compile(p), r, s) for p, r, s in rules]
    skipped = []
    num_shards = 1 + max((s for _, _, s in rules if s is not None), default=0)
    for key, tensor in state.items():
        for prefix in strip_prefixes:
            if key.startswith(prefix):
                key = key[len(prefix) :]
                break
        target, shard = key, None
        for pattern, repl, s in compiled:
            if pattern.search(key):
                target, shard = pattern.sub(repl, key), s
                break
        param = params.get(target)
        if param is None:
            skipped.append(key)
            continue
        with torch.no_grad():
            if shard is None:
                if param.shape != tensor.shape:
                    raise ValueError(
                        f"checkpoint tensor {key} has shape {tuple(tensor.shape)}, "
                        f"the model expects {tuple(param.shape)}"
                    )
                param.copy_(tensor)
                filled.add(target)
            else:  # one of equal slices of a fused parameter (q, k and v of one qkv)
                size = param.shape[0] // num_shards
                if tuple(tensor.shape) != (size, *param.shape[1:]):
                    raise ValueError(
                        f"checkpoint tensor {key} has shape {tuple(tensor.shape)}, "
                        f"the model expects {(size, *param.shape[1:])}"
                    )
                param[shard * size : (shard + 1) * size].copy_(tensor)
                filled.add(f"{target}#{shard}")
    if skipped:
        logger.debug("checkpoint tensors not used: %s", skipped)
    missing = []
    for name in params:
        if name in filled or any(name.startswith(o) for o in optional):
            continue
        if sum(1 for k in filled if k.rsplit("#", 1)[0] == name) == num_shards > 1:
            continue
        missing.append(name)
    if missing:
        raise ValueError(f"the checkpoint has no weights for: {', '.join(missing)}")


def read_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint folder (safetensors, sharded safetensors, or a pickled .bin)."""
    from safetensors.torch import load_file

    if (folder / "model.safetensors").is_file():
        state = load_file(folder / "model.safetensors")
    elif (folder / "model.safetensors.index.json").is_file():
        index = json.loads((folder / "model.safetensors.index.json").read_text(encoding="utf-8"))
        state = {}
        for shard in sorted(set(index["weight_map"].values())):
            state.update(load_file(folder / shard))
    elif (folder / "pytorch_model.bin").is_file():
        state = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    elif (folder / "pytorch_model.bin.index.json").is_file():  # sharded pickles, as transformers saved them
        index = json.loads((folder / "pytorch_model.bin.index.json").read_text(encoding="utf-8"))
        state = {}
        for shard in sorted(set(index["weight_map"].values())):
            state.update(torch.load(folder / shard, map_location="cpu", weights_only=True))
    else:
        raise ValueError(f"no model.safetensors or pytorch_model.bin (nor a sharded one's .index.json) in {folder}")
    return {_legacy_name(k): v for k, v in state.items()}


def _legacy_name(name: str) -> str:
    # TF-era BERT checkpoints call LayerNorm's parameters gamma/beta.
    if name.endswith(".gamma"):
        return name[:-6] + ".weight"
    if name.endswith(".beta"):
        return name[:-5] + ".bias"
    return name
