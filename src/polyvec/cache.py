"""Where polyvec keeps what it builds or unpacks once per machine: compiled kernels, models joined from wheels."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """`POLYVEC_CACHE`, else `$XDG_CACHE_HOME/polyvec` (default `~/.cache/polyvec`)."""
    base = os.environ.get("POLYVEC_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
        "polyvec",  # empty: unset (XDG's rule)
    )
    return Path(base)
