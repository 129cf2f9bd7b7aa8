"""What an index holds and how its vectors were made, recorded with it so that queries are encoded the same way."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ..muvera import MuveraParams

FIRST_STAGES = ("muvera", "dense", "sparse", "none")
QUANTIZATIONS = ("none", "int8", "binary")
FORMAT = 1


@dataclass(frozen=True)
class IndexConfig:
    """One index's recipe; written as the collection's metadata (a server) or `polyvec-index.json` (embedded)."""

    model: str
    """The model that encoded the documents; `Index.open` loads it again for queries."""
    dim: int
    """Width of a token vector."""
    first_stage: str = "muvera"
    """Candidates for the MaxSim re-rank: "muvera" (HNSW over the documents' MUVERA encodings), "dense" (HNSW over
    the model's single-vector embeddings), "sparse" (Qdrant's inverted index over learned sparse vectors,
    `sparse_model`'s) or "none" (MaxSim over every document)."""
    muvera: MuveraParams = field(default_factory=lambda: MuveraParams(k_sim=4, dim_proj=16, r_reps=20))
    """first_stage "muvera": the encoding's parameters (both sides)."""
    dense_dim: int | None = None
    """first_stage "dense": the embedding's width."""
    sparse_model: str | None = None
    """first_stage "sparse": the model whose `embed_sparse` vectors (SPLADE-style) are the first stage; the token
    model itself when it has them (one forward pass for both)."""
    quantization: str = "none"
    """Token vectors kept in RAM as "int8" (Qdrant's scalar quantization) or "binary" codes, the float32
    originals on disk for re-scoring; "none": float32 in RAM."""
    pool_factor: int | None = None
    """Documents' token vectors pooled by this factor before storage (PyLate's hierarchical pooling)."""
    engine: dict[str, Any] = field(default_factory=dict)
    """The model's loading options that shape its vectors (`hf_overrides`, `pooler_config`, `max_model_len`,
    ...; `Engine.options`): queries are encoded by the model loaded with them."""
    format: int = FORMAT

    def __post_init__(self) -> None:
        if self.first_stage not in FIRST_STAGES:
            raise ValueError(f"first_stage must be one of {', '.join(FIRST_STAGES)}, got {self.first_stage!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.first_stage == "dense" and not self.dense_dim:
            raise ValueError("first_stage 'dense' needs dense_dim")
        if self.first_stage == "sparse" and not self.sparse_model:
            raise ValueError("first_stage 'sparse' needs sparse_model (a model with embed_sparse)")
        if self.pool_factor is not None and self.pool_factor < 1:
            raise ValueError(f"pool_factor must be a positive integer, got {self.pool_factor}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> IndexConfig:
        if d.get("format") != FORMAT:
            raise ValueError(f"index format {d.get('format')!r} is not one this polyvec reads ({FORMAT})")
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        known["muvera"] = MuveraParams.coerce(known.get("muvera") or {})
        return cls(**known)
