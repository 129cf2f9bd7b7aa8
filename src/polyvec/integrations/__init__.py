"""Bridges to other systems (Ray)."""

from __future__ import annotations

from typing import Any


def engine_device(options: dict[str, Any], num_gpus: float) -> dict[str, Any]:
    """`options` with device "cpu" where an actor reserves no GPU and no device was chosen: Ray leaves such an
    actor every GPU of its node visible, and "auto" would load the model onto GPU 0 behind Ray's back."""
    if num_gpus or options.get("device", "auto") not in (None, "auto"):
        return options
    return {**options, "device": "cpu"}
