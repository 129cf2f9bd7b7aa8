"""polyvec: a fast inference engine for pooling models (dense, multi-vector, classification, scoring)."""

import os

# oneDNN caches a compiled primitive per matmul shape (~0.4 MB each with AMX bf16, measured); rebuilding one
# costs up to ~15 ms. Packed batches would have a different token count almost every step, so the model runner
# rounds it up to one of 112 bucket sizes (engine/model_runner.py): with four projection shapes per layer that is
# ~450 primitives for everything a model can run, so 512 entries hold them all and memory stays bounded
# (~200 MB at most). 128 entries held ~30 bucket sizes: enough offline (full batches, few sizes), but serving
# batches of 1-8 passages cycled through ~100 sizes and rebuilt primitives on most steps (6k vs 10-11k tokens/s).
# Read when oneDNN first runs, so it must be set before the first matmul; a value set by the user wins.
PRIMITIVE_CACHE_CAPACITY = 512
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(PRIMITIVE_CACHE_CAPACITY))

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
