"""polyvec: a fast inference engine for pooling models (dense, multi-vector, classification, scoring).

The public names are imported on first use, so `polyvec --help` and other light entry points start without
loading torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": ".entrypoints.llm",
    "PoolingParams": ".pooling_params",
    "LateChunkingParams": ".late_chunking",
    "PoolerConfig": ".config",
    "EngineConfig": ".config",
    "ModelConfig": ".config",
    "PoolingOutput": ".outputs",
    "PoolingRequestOutput": ".outputs",
    "EmbeddingOutput": ".outputs",
    "EmbeddingRequestOutput": ".outputs",
    "ClassificationOutput": ".outputs",
    "ClassificationRequestOutput": ".outputs",
    "ScoringOutput": ".outputs",
    "ScoringRequestOutput": ".outputs",
    "TextPrompt": ".inputs",
    "TokensPrompt": ".inputs",
    "PromptType": ".inputs",
}

__all__ = [
    "LLM",
    "PoolingParams",
    "LateChunkingParams",
    "PoolerConfig",
    "EngineConfig",
    "ModelConfig",
    "PoolingOutput",
    "PoolingRequestOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "ClassificationOutput",
    "ClassificationRequestOutput",
    "ScoringOutput",
    "ScoringRequestOutput",
    "TextPrompt",
    "TokensPrompt",
    "PromptType",
    "__version__",
]

if TYPE_CHECKING:
    from .config import EngineConfig, ModelConfig, PoolerConfig
    from .entrypoints.llm import LLM
    from .inputs import PromptType, TextPrompt, TokensPrompt
    from .late_chunking import LateChunkingParams
    from .outputs import (
        ClassificationOutput,
        ClassificationRequestOutput,
        EmbeddingOutput,
        EmbeddingRequestOutput,
        PoolingOutput,
        PoolingRequestOutput,
        ScoringOutput,
        ScoringRequestOutput,
    )
    from .pooling_params import PoolingParams


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'polyvec' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
