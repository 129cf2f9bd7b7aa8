"""polyvec: a fast inference engine for pooling models (dense, multi-vector, classification, scoring)."""

import os

# oneDNN caches a compiled primitive per matmul shape, up to 1024 of them; packed batches have a different
# token count almost every step, so the cache only grows (+1 GB of RSS over a 100k-passage run) and rarely
# hits. A small cache keeps memory flat at no measured cost. Read when oneDNN first runs, so it must be set
# before the first matmul; a value set by the user wins.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "16")

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
