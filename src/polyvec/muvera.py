"""MUVERA fixed-dimensional encodings: one vector per multi-vector input, for a single-vector ANN first stage.

Each of `r_reps` repetitions hashes every token vector with `k_sim` random hyperplanes (SimHash) into one of
2^k_sim partitions, sums the vectors of each partition (documents: the mean, and an empty partition takes the
first vector of the nearest occupied partition by Hamming distance), projects each partition's vector with a
random ±1 matrix to `dim_proj` dimensions (scaled 1/√dim_proj) and concatenates: r_reps · 2^k_sim · dim_proj
numbers. A query's encoding dotted with a document's approximates their MaxSim, so the encodings go into any
dot-product index and the candidates are re-ranked by exact MaxSim.

The random draws (numpy's default_rng(seed): the hyperplanes of each repetition, then the projections) are
fastembed's `Muvera`, so for the same parameters and seed both give the same encodings; a document and its
queries must be encoded with the same `MuveraParams`, which an index records.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from functools import lru_cache

import numpy as np
import torch

# Parameters that a request may set are bounded, so that one output, the random matrices (kept for reuse) and
# the work arrays stay a sane size (fastembed's defaults: 20 repetitions of 16 dimensions, 10,240 numbers).
MAX_K_SIM = 10
MAX_OUTPUT_DIM = 1 << 18
MAX_R_REPS = 256
MAX_PROJECTED = 4096  # r_reps · dim_proj: each token vector's projections


@dataclass(frozen=True)
class MuveraParams:
    """The encoding's parameters; fastembed's defaults."""

    k_sim: int = 5
    """SimHash hyperplanes per repetition: 2^k_sim partitions."""
    dim_proj: int = 16
    """Each partition's vector is projected to this many dimensions (no projection when it equals the input's)."""
    r_reps: int = 20
    """Independent repetitions, concatenated."""
    seed: int = 42
    """Seed of the random hyperplanes and projections."""

    def output_dim(self) -> int:
        return self.r_reps * (1 << self.k_sim) * self.dim_proj

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def coerce(cls, value: object) -> MuveraParams:
        """A MuveraParams from itself, a mapping of its fields (HTTP bodies, JSON manifests) or True (defaults);
        ValueError naming the field otherwise."""
        if isinstance(value, MuveraParams):
            params = value
        elif value is True:
            params = cls()
        elif isinstance(value, dict):
            unknown = sorted(set(value) - set(cls.__dataclass_fields__))
            if unknown:
                raise ValueError(f"muvera has no field {unknown[0]!r}; allowed: k_sim, dim_proj, r_reps, seed")
            params = cls(**value)
        else:
            raise ValueError(f"muvera must be an object with k_sim, dim_proj, r_reps and seed, got {value!r}")
        for name in ("k_sim", "dim_proj", "r_reps", "seed"):
            v = getattr(params, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "seed" else 1):
                low = "a non-negative" if name == "seed" else "a positive"
                raise ValueError(f"muvera.{name} must be {low} integer, got {v!r}")
        if params.k_sim > MAX_K_SIM:
            raise ValueError(f"muvera.k_sim must be at most {MAX_K_SIM}, got {params.k_sim}")
        if params.r_reps > MAX_R_REPS:
            raise ValueError(f"muvera.r_reps must be at most {MAX_R_REPS}, got {params.r_reps}")
        if params.r_reps * params.dim_proj > MAX_PROJECTED:
            raise ValueError(
                f"muvera gives each token vector r_reps · dim_proj = {params.r_reps * params.dim_proj} projected "
                f"numbers; the limit is {MAX_PROJECTED}"
            )
        if params.output_dim() > MAX_OUTPUT_DIM:
            raise ValueError(
                f"muvera gives r_reps · 2^k_sim · dim_proj = {params.output_dim()} numbers; "
                f"the limit is {MAX_OUTPUT_DIM}"
            )
        return params

    def check_width(self, dim: int) -> None:
        """ValueError unless vectors of width `dim` can be encoded (dim_proj projects them down, never up)."""
        if self.dim_proj > dim:
            raise ValueError(f"muvera.dim_proj ({self.dim_proj}) must not exceed the token vectors' width ({dim})")


class Muvera:
    """The encoder for vectors of width `dim` (its random matrices drawn once)."""

    def __init__(self, dim: int, params: MuveraParams | None = None):
        p = params or MuveraParams()
        p.check_width(dim)
        self.dim, self.params = dim, p
        rng = np.random.default_rng(p.seed)
        self.hyperplanes = np.stack([rng.normal(size=(dim, p.k_sim)) for _ in range(p.r_reps)])  # [r, dim, k]
        self._project: np.ndarray | None = None  # none where dim_proj is the width (the last draw: nothing shifts)
        if p.dim_proj < dim:  # [r, dim, dp], scaled: vectors are projected before the partition sums (both linear)
            self._project = rng.choice([-1, 1], size=(p.r_reps, dim, p.dim_proj)) / np.sqrt(p.dim_proj)
        ids = np.arange(1 << p.k_sim)
        popcount = np.array([bin(i).count("1") for i in range(1 << p.k_sim)])
        self.hamming = popcount[ids[:, None] ^ ids[None, :]]  # [B, B]

    @property
    def output_dim(self) -> int:
        return self.params.output_dim()

    def __call__(self, vectors: torch.Tensor | np.ndarray, query: bool = False) -> np.ndarray:
        """One input's token vectors [n, dim] → its encoding [output_dim] (float32); no vectors give zeros (their
        MaxSim with anything is 0), where fastembed raises."""
        # The cast in numpy: a torch op between numpy's BLAS calls makes their thread pools contend.
        if isinstance(vectors, torch.Tensor):
            t = vectors.detach().cpu()
            x = (t if t.dtype in (torch.float32, torch.float64) else t.float()).numpy()
        else:
            x = np.asarray(vectors)
        x = x.astype(np.float64, copy=False)
        if x.ndim != 2 or x.shape[1] != self.dim:
            raise ValueError(f"muvera expects vectors of shape (n, {self.dim}), got {tuple(x.shape)}")
        if not len(x):
            return np.zeros(self.output_dim, dtype=np.float32)
        p, n, parts = self.params, len(x), 1 << self.params.k_sim
        weights, order = 1 << np.arange(p.k_sim), np.arange(n)
        w = self.dim if self._project is None else p.dim_proj
        centers = np.zeros((p.r_reps, parts, w))
        for r in range(p.r_reps):  # one repetition at a time: memory stays n x (k_sim + w) whatever r_reps
            part = ((x @ self.hyperplanes[r]) > 0).astype(np.int64) @ weights  # [n]: each vector's partition
            y = x if self._project is None else x @ self._project[r]  # [n, w]
            np.add.at(centers[r], part, y)  # partition sums
            if query:
                continue
            counts = np.bincount(part, minlength=parts)
            centers[r] /= np.maximum(counts, 1)[:, None]
            hollow, occupied = np.flatnonzero(counts == 0), np.flatnonzero(counts)
            if len(hollow):
                # The nearest occupied partition by Hamming distance (ties: the lowest id, as fastembed's
                # argmin), and the first vector that fell into it.
                nearest = occupied[self.hamming[np.ix_(hollow, occupied)].argmin(1)]
                first = np.full(parts, n)
                np.minimum.at(first, part, order)
                centers[r, hollow] = y[first[nearest]]
        return centers.reshape(-1).astype(np.float32)

    def encode(self, inputs: Sequence[torch.Tensor | np.ndarray], query: bool = False) -> np.ndarray:
        """Several inputs → their encodings [len(inputs), output_dim]."""
        out = np.empty((len(inputs), self.output_dim), dtype=np.float32)
        for i, v in enumerate(inputs):
            out[i] = self(v, query)
        return out


@lru_cache(maxsize=8)
def muvera_for(dim: int, params: MuveraParams) -> Muvera:
    """The encoder of one width and parameter set, built once (its matrices are the costly part)."""
    return Muvera(dim, params)
