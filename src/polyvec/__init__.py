"""polyvec: a fast inference engine for pooling models (dense, multi-vector, classification, scoring)."""

import os

# oneDNN caches a compiled primitive per matmul shape, up to 1024 of them (~1 MB each with AMX bf16). Packed
# batches would have a different token count almost every step, so the cache would only grow (+1 GB of RSS
# over a 100k-passage run); the model runner rounds token counts up to buckets instead (engine/model_runner.py),
# and 128 entries hold the projections of ~30 bucket sizes: a rebuilt primitive costs ~25 ms with AMX bf16.
# Read when oneDNN first runs, so it must be set before the first matmul; a value set by the user wins.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "128")

from .config import EngineConfig, ModelConfig, PoolerConfig
from .entrypoints.llm import LLM
from .outputs import (ClassificationOutput, ClassificationRequestOutput, EmbeddingOutput, EmbeddingRequestOutput,
                      PoolingOutput, PoolingRequestOutput, ScoringOutput, ScoringRequestOutput)
from .pooling_params import PoolingParams

__version__ = "0.1.0"

__all__ = [
    "LLM", "PoolingParams", "PoolerConfig", "EngineConfig", "ModelConfig", "PoolingOutput", "PoolingRequestOutput",
    "EmbeddingOutput", "EmbeddingRequestOutput", "ClassificationOutput", "ClassificationRequestOutput",
    "ScoringOutput", "ScoringRequestOutput", "__version__",
]
