"""polyvec: a fast inference engine for pooling models (dense, multi-vector, classification, scoring)."""

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
