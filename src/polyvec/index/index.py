"""A searchable collection of documents' token vectors: polyvec encodes, Qdrant stores and searches.

    index = Index.create("vaswani.idx", LLM("colbert-model"))      # embedded (Qdrant Edge), a local folder
    index = Index.create("http://qdrant:6333", llm, collection="docs")  # a Qdrant server or cluster
    index.add(texts, ids); index.optimize()
    Index.open("vaswani.idx").search("what is late interaction?", k=10)

Documents go in as token vectors (optionally pooled) plus their first-stage vector (MUVERA encoding or the
model's single-vector embedding), both from one forward pass; a query is encoded the same way (as a query) and
answered by one Qdrant query: the first stage's `prefetch` candidates by HNSW, re-ranked by MaxSim.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..muvera import MuveraParams, muvera_for
from ..pooling_params import PoolingParams
from .config import IndexConfig
from .qdrant import TOKENS, Backend, ClientBackend, EdgeBackend, Hit, SearchOptions

if TYPE_CHECKING:
    from ..entrypoints.llm import LLM


def _is_server(location: str) -> bool:
    return location == ":memory:" or location.startswith(("http://", "https://"))


class Index:
    def __init__(self, backend: Backend, llm: LLM | None = None):
        self.backend, self.config, self._llm = backend, backend.config, llm

    # ------------------------------------------------------------------------------------------- open

    @classmethod
    def create(
        cls,
        location: str | os.PathLike,
        llm: LLM | None = None,
        *,
        model: str | None = None,
        dim: int | None = None,
        first_stage: str = "muvera",
        muvera: MuveraParams | dict | None = None,
        dense_dim: int | None = None,
        quantization: str = "none",
        pool_factor: int | None = None,
        collection: str = "polyvec",
        api_key: str | None = None,
        shards: int | None = None,
        replicas: int | None = None,
        overwrite: bool = False,
    ) -> Index:
        """A new index at `location`: a folder (embedded), an http(s) URL of a Qdrant server, or ":memory:".
        With `llm`, the model's name and widths come from it; without, give `model` and `dim` and add vectors.
        On a cluster, `shards` and `replicas` set the collection's shard_number and replication_factor."""
        if llm is not None:
            mc = llm.model_config
            model, dim = model or mc.model, dim or mc.token_dim
            if first_stage == "dense":
                if "embed" not in llm.supported_tasks:
                    raise ValueError(f"first_stage 'dense' needs a model with embed; {mc.model} has none")
                dense_dim = dense_dim or mc.embed_dim
        if model is None or dim is None:
            raise ValueError("give an LLM, or model and dim")
        config = IndexConfig(
            model=model,
            dim=dim,
            first_stage=first_stage,
            dense_dim=dense_dim,
            quantization=quantization,
            pool_factor=pool_factor,
        )
        if muvera is not None:
            config = replace(config, muvera=MuveraParams.coerce(muvera))
        if config.first_stage == "muvera":
            muvera_for(dim, config.muvera)  # its checks, before anything is created
        loc = str(location)
        backend: Backend
        if _is_server(loc):
            client = ClientBackend.connect(loc, api_key)
            backend = ClientBackend.create(client, collection, config, overwrite, shards, replicas)
        else:
            if shards is not None or replicas is not None:
                raise ValueError("shards and replicas apply to a Qdrant server or cluster (an http(s) URL)")
            backend = EdgeBackend.create(loc, config, overwrite)
        return cls(backend, llm)

    @classmethod
    def open(
        cls,
        location: str | os.PathLike,
        llm: LLM | None = None,
        *,
        collection: str = "polyvec",
        api_key: str | None = None,
    ) -> Index:
        """An existing index; its model is loaded when a text is first encoded, unless `llm` is given."""
        loc = str(location)
        backend: Backend
        if _is_server(loc):
            backend = ClientBackend.open(ClientBackend.connect(loc, api_key), collection)
        else:
            backend = EdgeBackend.open(loc)
        return cls(backend, llm)

    @property
    def llm(self) -> LLM:
        if self._llm is None:
            from ..entrypoints.llm import LLM

            self._llm = LLM(self.config.model)
        return self._llm

    # ------------------------------------------------------------------------------------------- write

    def _tasks(self) -> str | list[str]:
        return ["token_embed", "embed"] if self.config.first_stage == "dense" else "token_embed"

    def _encode(self, texts: Sequence[Any], input_type: str) -> tuple[list[torch.Tensor], np.ndarray | None]:
        params = PoolingParams(input_type=input_type)
        outs = self.llm.encode(list(texts), params, pooling_task=self._tasks(), use_tqdm=False)
        if self.config.first_stage != "dense":
            return [o.outputs.data for o in outs], None
        tokens = [o.outputs.data["token_embed"] for o in outs]
        return tokens, torch.stack([o.outputs.data["embed"] for o in outs]).float().numpy()

    def add(self, texts: Iterable[Any], ids: Iterable[str] | None = None, batch_size: int = 512) -> int:
        """Encode documents (texts, or any prompt the model takes) and store them; ids default to their
        positions counted from the index's size. Returns how many were added."""
        start = self.backend.count() if ids is None else 0
        id_iter = iter(ids) if ids is not None else None
        batch: list[Any] = []
        added = 0

        def flush() -> None:
            nonlocal added
            if not batch:
                return
            names = [next(id_iter) if id_iter is not None else str(start + added + i) for i in range(len(batch))]
            tokens, dense = self._encode(batch, "document")
            self.add_vectors(names, tokens, dense)
            added += len(batch)
            batch.clear()

        for text in texts:
            batch.append(text)
            if len(batch) >= batch_size:
                flush()
        flush()
        return added

    def add_vectors(
        self,
        ids: Sequence[str],
        tokens: Sequence[torch.Tensor | np.ndarray],
        dense: np.ndarray | None = None,
    ) -> None:
        """Store documents already encoded: their token vectors [n_i, dim] (pooled here if the index pools)
        and, for a dense first stage, their embeddings [len(ids), dense_dim]."""
        if len(ids) != len(tokens):
            raise ValueError(f"{len(ids)} ids for {len(tokens)} documents")
        mats = [_matrix(t, self.config.dim, f"document {doc_id!r}") for doc_id, t in zip(ids, tokens)]
        if self.config.pool_factor and self.config.pool_factor > 1:
            from ..token_pooling import hierarchical_pool

            mats = [hierarchical_pool(torch.from_numpy(m), self.config.pool_factor).numpy() for m in mats]
        vectors: dict[str, Any] = {TOKENS: mats}
        if self.config.first_stage == "muvera":
            vectors["muvera"] = muvera_for(self.config.dim, self.config.muvera).encode(mats)
        elif self.config.first_stage == "dense":
            if dense is None or len(dense) != len(ids):
                raise ValueError("a dense first stage needs one embedding per document")
            vectors["dense"] = np.asarray(dense, dtype=np.float32)
        self.backend.upsert(ids, vectors)

    def optimize(self) -> None:
        """Build the HNSW graphs and merge segments after a bulk load (embedded; a server does it itself)."""
        self.backend.optimize()

    # ------------------------------------------------------------------------------------------- read

    def search(
        self,
        queries: Any,
        k: int = 10,
        *,
        prefetch: int = 100,
        hnsw_ef: int | None = None,
        rescore: bool | None = None,
        oversampling: float | None = None,
    ) -> list[list[Hit]]:
        """The k best documents for each query (a string or a list), best first, by MaxSim over the first
        stage's `prefetch` candidates."""
        texts = [queries] if isinstance(queries, str) else list(queries)
        tokens, dense = self._encode(texts, "query")
        return self.search_vectors(
            tokens, dense, k=k, prefetch=prefetch, hnsw_ef=hnsw_ef, rescore=rescore, oversampling=oversampling
        )

    def search_vectors(
        self,
        tokens: Sequence[torch.Tensor | np.ndarray],
        dense: np.ndarray | None = None,
        *,
        k: int = 10,
        prefetch: int = 100,
        hnsw_ef: int | None = None,
        rescore: bool | None = None,
        oversampling: float | None = None,
        exact: bool = False,
    ) -> list[list[Hit]]:
        """Search with queries already encoded (as queries): token vectors and, for a dense first stage, their
        embeddings."""
        if k < 1 or prefetch < 1:
            raise ValueError(f"k and prefetch must be positive, got k={k}, prefetch={prefetch}")
        mats = [_matrix(t, self.config.dim, f"query {i}") for i, t in enumerate(tokens)]
        queries: dict[str, Any] = {TOKENS: mats}
        if self.config.first_stage == "muvera":
            queries["muvera"] = muvera_for(self.config.dim, self.config.muvera).encode(mats, query=True)
        elif self.config.first_stage == "dense":
            if dense is None or len(dense) != len(mats):
                raise ValueError("a dense first stage needs one embedding per query")
            queries["dense"] = np.asarray(dense, dtype=np.float32)
        options = SearchOptions(hnsw_ef=hnsw_ef, rescore=rescore, oversampling=oversampling, exact=exact)
        return self.backend.search(queries, k, max(prefetch, k), options)

    def __len__(self) -> int:
        return self.backend.count()

    def disk_bytes(self) -> int | None:
        """Bytes of the embedded index on disk (None for a server)."""
        return self.backend.disk_bytes()

    def close(self) -> None:
        self.backend.close()

    def __enter__(self) -> Index:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _matrix(x: torch.Tensor | np.ndarray, dim: int, what: str) -> np.ndarray:
    m = x.detach().float().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x, dtype=np.float32)
    if m.ndim != 2 or m.shape[1] != dim or not len(m):
        raise ValueError(f"{what}: expected token vectors of shape (n >= 1, {dim}), got {tuple(m.shape)}")
    return m
