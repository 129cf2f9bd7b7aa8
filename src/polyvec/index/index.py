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

import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch

from ..multimodal.image import is_image_object
from ..muvera import MuveraParams, muvera_for
from ..outputs import SparseEmbeddingOutput
from ..pooling_params import PoolingParams
from .config import IndexConfig
from .qdrant import TOKENS, Backend, ClientBackend, EdgeBackend, Hit, SearchOptions, SparseVector

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from ..entrypoints.llm import LLM


MAX_RESULTS = 1_000_000
"""The most hits (k), first-stage candidates (prefetch) or HNSW ef one search may ask for."""


def _is_server(location: str) -> bool:
    return location == ":memory:" or location.startswith(("http://", "https://"))


def _doc_id(value: Any, position: int) -> str:
    """A document's id as stored: a string, or an integer's decimal string."""
    if value is None:
        raise ValueError(f"fewer ids than documents: document {position} has no id")
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ValueError(f"id {position} is {type(value).__name__} {value!r}, not a string")
    if value == "":  # a run file (TREC) or a log line could not tell it from a missing one
        raise ValueError(f"id {position} is empty")
    return str(value)


def _check_texts(texts: Sequence[Any], what: str, first: int = 0) -> None:
    """An empty or blank text as a document or query: refused (its marker and expansion tokens alone would match
    every query, and rank first)."""
    for i, t in enumerate(texts):
        text = t.get("prompt") if isinstance(t, dict) and "prompt_token_ids" not in t else t  # a prompt dict's
        if isinstance(text, str) and not text.strip() and not (isinstance(t, dict) and t.get("multi_modal_data")):
            raise ValueError(f"{what} {first + i} is {'empty' if not text else 'blank'}: it has no text to encode")


def stored_name(name: str) -> str:
    """A model as the recipe keeps it: a local folder by its absolute path (a relative one named another folder,
    or a hub id, from another working directory), else the name given."""
    path = os.path.expanduser(name)
    return os.path.abspath(path) if os.path.isdir(path) else name


class Index:
    def __init__(self, backend: Backend, llm: LLM | None = None, sparse_llm: LLM | None = None):
        self._backend, self.config, self._llm, self._sparse_llm = backend, backend.config, llm, sparse_llm
        self._closed = False

    @property
    def backend(self) -> Backend:
        """The store; ValueError once the index is closed (Qdrant's own error was a bare Exception)."""
        if self._closed:
            raise ValueError("this index is closed (open it again with Index.open)")
        return self._backend

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
        sparse_model: str | LLM | None = None,
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
        On a cluster, `shards` and `replicas` set the collection's shard_number and replication_factor. A
        "sparse" first stage takes `sparse_model` (an LLM or a model name) or, when the model has embed_sparse,
        the model itself."""
        sparse_llm = None
        if not isinstance(sparse_model, (str, type(None))):
            sparse_llm, sparse_model = sparse_model, sparse_model.model_config.model
        if sparse_model is not None and first_stage != "sparse":
            raise ValueError(f"sparse_model goes with first_stage 'sparse', not {first_stage!r}")
        options: dict[str, Any] = {}
        if llm is not None:
            mc = llm.model_config
            model, options = model or mc.model, llm.engine.options
            # the width the model gives (a pooler_config's dimensions cut token vectors too), not its config's
            dim = dim or int(llm.encode("width", pooling_task="token_embed", use_tqdm=False)[0].outputs.data.shape[-1])
            if first_stage == "dense":
                if "embed" not in llm.supported_tasks:
                    raise ValueError(f"first_stage 'dense' needs a model with embed; {mc.model} has none")
                dense_dim = dense_dim or int(llm.embed("width", use_tqdm=False)[0].outputs.data.shape[-1])  # as dim
            if first_stage == "sparse":
                if sparse_model is None and "embed_sparse" not in llm.supported_tasks:
                    raise ValueError(
                        f"first_stage 'sparse' needs sparse_model (a model with embed_sparse); {mc.model} has none"
                    )
                sparse_model = sparse_model or mc.model
                if sparse_llm is None and sparse_model == mc.model:
                    sparse_llm = llm
        if sparse_llm is not None and "embed_sparse" not in sparse_llm.supported_tasks:
            raise ValueError(f"sparse_model {sparse_model} has no embed_sparse")
        if model is None or dim is None:
            raise ValueError("give an LLM, or model and dim")
        config = IndexConfig(
            model=stored_name(model),
            dim=dim,
            first_stage=first_stage,
            dense_dim=dense_dim,
            sparse_model=stored_name(sparse_model) if first_stage == "sparse" and sparse_model else None,
            quantization=quantization,
            pool_factor=pool_factor,
            engine=options,
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
        return cls(backend, llm, sparse_llm)

    @classmethod
    def open(
        cls,
        location: str | os.PathLike,
        llm: LLM | None = None,
        *,
        collection: str = "polyvec",
        api_key: str | None = None,
        sparse_llm: LLM | None = None,
    ) -> Index:
        """An existing index; its model (and a sparse first stage's) is loaded when a text is first encoded,
        unless `llm` (`sparse_llm`) is given."""
        loc = str(location)
        backend: Backend
        if _is_server(loc):
            backend = ClientBackend.open(ClientBackend.connect(loc, api_key), collection)
        else:
            backend = EdgeBackend.open(loc)
        return cls(backend, llm, sparse_llm)

    @property
    def llm(self) -> LLM:
        if self._llm is None:
            from ..entrypoints.llm import LLM

            self._llm = LLM(self.config.model, **self.config.engine)
        return self._llm

    @property
    def sparse_llm(self) -> LLM:
        """A sparse first stage's model: the token model itself, or one of its own."""
        if self.config.sparse_model in (None, self.config.model) and self._sparse_llm is None:
            return self.llm
        if self._sparse_llm is None:
            from ..entrypoints.llm import LLM

            self._sparse_llm = LLM(str(self.config.sparse_model))
        return self._sparse_llm

    # ------------------------------------------------------------------------------------------- write

    def _tasks(self) -> list[str]:
        """What one forward pass of the token model gives: its token vectors, and the first stage's vector when
        it comes from the same model."""
        tasks = ["token_embed"]
        if self.config.first_stage == "dense":
            tasks.append("embed")
        elif self.config.first_stage == "sparse" and self.sparse_llm is self.llm:
            tasks.append("embed_sparse")
        return tasks

    def _encode(self, texts: Sequence[Any], input_type: str) -> Encoded:
        params = PoolingParams(input_type=input_type)
        tasks = self._tasks()
        outs = self.llm.encode(list(texts), params, pooling_task=tasks if len(tasks) > 1 else tasks[0], use_tqdm=False)
        if len(tasks) == 1:
            tokens = [o.outputs.data for o in outs]
        else:
            tokens = [o.outputs.data["token_embed"] for o in outs]
        dense = sparse = None
        if "embed" in tasks:
            dense = torch.stack([o.outputs.data["embed"] for o in outs]).float().numpy()
        if "embed_sparse" in tasks:
            sparse = [_sparse(o.outputs.data["embed_sparse"]) for o in outs]
        elif self.config.first_stage == "sparse":
            sparse_outs = self.sparse_llm.encode(list(texts), params, pooling_task="embed_sparse", use_tqdm=False)
            sparse = [_sparse(o.outputs.data) for o in sparse_outs]
        return Encoded(tokens, dense, sparse)

    def add(self, texts: Iterable[Any], ids: Iterable[str | int] | None = None, batch_size: int = 512) -> int:
        """Encode documents (texts, or any prompt the model takes; one text alone is one document) and store them
        under `ids` (strings, or integers as their decimal strings; an id already there is replaced). Without ids,
        their positions counted from the index's size, refused where one is an id given before. Returns how many
        were added; ValueError when there are more or fewer ids than documents."""
        if isinstance(texts, (str, dict)) or is_image_object(texts):
            texts = [texts]
        if isinstance(texts, Sequence) and isinstance(ids, Sequence) and len(texts) != len(ids):
            raise ValueError(f"{len(ids)} ids for {len(texts)} documents")  # before any is written
        if isinstance(texts, Sequence):
            _check_texts(texts, "document")  # likewise
        start = self.backend.count() if ids is None else 0
        id_iter = iter(ids) if ids is not None else None
        batch: list[Any] = []
        added = 0
        seen: dict[str, int] = {}  # one call's ids: a repeat would replace a document it just added

        def flush() -> None:
            nonlocal added
            if not batch:
                return
            if id_iter is None:
                names = [str(start + added + i) for i in range(len(batch))]
                taken = self.backend.existing(names)
                if taken:  # a document added with that id before: not replaced without being named
                    raise ValueError(
                        f"ids default to positions from the index's size, and {taken[0]!r} is a document's id "
                        "already: give ids"
                    )
            else:
                names = [_doc_id(next(id_iter, None), added + i) for i in range(len(batch))]
                for i, name in enumerate(names):
                    first = seen.setdefault(name, added + i)
                    if first != added + i:
                        raise ValueError(f"id {added + i} repeats {name!r}, the id of document {first}")
            _check_texts(batch, "document", added)
            enc = self._encode(batch, "document")
            self.add_vectors(names, enc.tokens, enc.dense, enc.sparse)
            added += len(batch)
            batch.clear()

        for text in texts:
            batch.append(text)
            if len(batch) >= batch_size:
                flush()
        flush()
        if id_iter is not None and next(id_iter, None) is not None:
            raise ValueError(f"more ids than documents: {added} documents were added, and ids are left over")
        return added

    def add_vectors(
        self,
        ids: Sequence[str],
        tokens: Sequence[torch.Tensor | np.ndarray],
        dense: np.ndarray | None = None,
        sparse: Sequence[SparseVector] | None = None,
    ) -> None:
        """Store documents already encoded: their token vectors [n_i, dim] (pooled here if the index pools)
        and, for a dense first stage, their embeddings [len(ids), dense_dim]; for a sparse one, their sparse
        vectors as (indices, values)."""
        if len(ids) != len(tokens):
            raise ValueError(f"{len(ids)} ids for {len(tokens)} documents")
        mats = [_matrix(t, self.config.dim, f"document {doc_id!r}") for doc_id, t in zip(ids, tokens)]
        if self.config.pool_factor and self.config.pool_factor > 1:
            from ..token_pooling import MAX_POOL_BLOCK, pool_in_blocks

            block = self._llm.model_config.max_model_len if self._llm is not None else MAX_POOL_BLOCK
            mats = [pool_in_blocks(torch.from_numpy(m), self.config.pool_factor, block).numpy() for m in mats]
        vectors: dict[str, Any] = {TOKENS: mats}
        if self.config.first_stage == "muvera":
            vectors["muvera"] = muvera_for(self.config.dim, self.config.muvera).encode(mats)
        elif self.config.first_stage == "dense":
            if dense is None or len(dense) != len(ids):
                raise ValueError("a dense first stage needs one embedding per document")
            vectors["dense"] = np.asarray(dense, dtype=np.float32)
        elif self.config.first_stage == "sparse":
            vectors["sparse"] = _sparse_list(sparse, len(ids), "document")
            empty = [doc_id for doc_id, (idx, _) in zip(ids, vectors["sparse"]) if not len(idx)]
            if empty:  # stored, but no sparse query will ever make them a candidate
                logger.warning("documents with an empty sparse vector, never a first-stage candidate: %s", empty[:20])
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
        # one query as add takes one document: a text, a prompt dict, an image
        texts = [queries] if isinstance(queries, (str, dict)) or is_image_object(queries) else list(queries)
        self._check_search(k, prefetch, hnsw_ef, oversampling)
        if not texts:
            return []
        _check_texts(texts, "query")
        enc = self._encode(texts, "query")
        return self.search_vectors(
            enc.tokens,
            enc.dense,
            enc.sparse,
            k=k,
            prefetch=prefetch,
            hnsw_ef=hnsw_ef,
            rescore=rescore,
            oversampling=oversampling,
        )

    def search_vectors(
        self,
        tokens: Sequence[torch.Tensor | np.ndarray],
        dense: np.ndarray | None = None,
        sparse: Sequence[SparseVector] | None = None,
        *,
        k: int = 10,
        prefetch: int = 100,
        hnsw_ef: int | None = None,
        rescore: bool | None = None,
        oversampling: float | None = None,
        exact: bool = False,
    ) -> list[list[Hit]]:
        """Search with queries already encoded (as queries): token vectors and, for a dense or sparse first stage,
        their embeddings or sparse vectors."""
        self._check_search(k, prefetch, hnsw_ef, oversampling)
        if not tokens:
            return []
        mats = [_matrix(t, self.config.dim, f"query {i}") for i, t in enumerate(tokens)]
        queries: dict[str, Any] = {TOKENS: mats}
        if self.config.first_stage == "muvera":
            queries["muvera"] = muvera_for(self.config.dim, self.config.muvera).encode(mats, query=True)
        elif self.config.first_stage == "dense":
            if dense is None or len(dense) != len(mats):
                raise ValueError("a dense first stage needs one embedding per query")
            queries["dense"] = np.asarray(dense, dtype=np.float32)
        elif self.config.first_stage == "sparse":
            queries["sparse"] = _sparse_list(sparse, len(mats), "query")
            for i, (idx, _) in enumerate(queries["sparse"]):
                if not len(idx):
                    raise ValueError(f"query {i} has an empty sparse vector: a sparse first stage finds nothing for it")
        options = SearchOptions(hnsw_ef=hnsw_ef, rescore=rescore, oversampling=oversampling, exact=exact)
        return self.backend.search(queries, k, max(prefetch, k), options)

    @staticmethod
    def _check_search(k: int, prefetch: int, hnsw_ef: int | None, oversampling: float | None) -> None:
        for name, value in (("k", k), ("prefetch", prefetch), ("hnsw_ef", hnsw_ef)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
            if value is not None and value > MAX_RESULTS:  # past Qdrant's integers (a traceback), or its memory
                raise ValueError(f"{name} must be at most {MAX_RESULTS:,}, got {value}")
        if oversampling is not None and (isinstance(oversampling, bool) or not oversampling >= 1):
            raise ValueError(f"oversampling must be a number of at least 1, got {oversampling!r}")

    def __len__(self) -> int:
        return self.backend.count()

    def disk_bytes(self) -> int | None:
        """Bytes of the embedded index on disk (None for a server)."""
        return self.backend.disk_bytes()

    def close(self) -> None:
        """Flush and release the index (its folder's lock); closing it again does nothing."""
        if not self._closed:
            self._closed = True
            self._backend.close()

    def __enter__(self) -> Index:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Encoded(NamedTuple):
    tokens: list[torch.Tensor]
    dense: np.ndarray | None
    sparse: list[SparseVector] | None


def _sparse(v: torch.Tensor) -> SparseVector:
    """An embed_sparse output (a vocabulary-wide vector) as its non-zero (indices, values)."""
    out = SparseEmbeddingOutput(v.detach().float().cpu())
    return np.asarray(out.indices, dtype=np.uint32), np.asarray(out.values, dtype=np.float32)


def _array(x: Any) -> np.ndarray:
    if not isinstance(x, torch.Tensor):
        return np.asarray(x)
    x = x.detach().cpu()
    return (x.float() if x.is_floating_point() else x).numpy()  # numpy has no bfloat16


def _sparse_list(sparse: Sequence[SparseVector] | None, n: int, what: str) -> list[SparseVector]:
    """Checked (indices uint32, values float32) pairs: integer indices in [0, 2^32), unique, one value each."""
    if sparse is None or len(sparse) != n:
        raise ValueError(f"a sparse first stage needs one sparse vector (indices, values) per {what}")
    out = []
    for i, (indices, values) in enumerate(sparse):
        idx, val = _array(indices), _array(values)
        if idx.ndim != 1 or idx.shape != val.shape:
            raise ValueError(f"{what} {i}: sparse indices and values must be 1-D and of one length")
        if idx.size and (idx.dtype.kind not in "iu" or idx.min() < 0 or idx.max() >= 2**32):
            raise ValueError(f"{what} {i}: sparse indices must be integers in [0, 2^32)")
        if len(np.unique(idx)) != len(idx):
            raise ValueError(f"{what} {i}: sparse indices must not repeat")
        out.append((idx.astype(np.uint32), val.astype(np.float32)))
    return out


def _matrix(x: torch.Tensor | np.ndarray, dim: int, what: str) -> np.ndarray:
    m = x.detach().float().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x, dtype=np.float32)
    if m.ndim != 2 or m.shape[1] != dim or not len(m):
        raise ValueError(f"{what}: expected token vectors of shape (n >= 1, {dim}), got {tuple(m.shape)}")
    return m
