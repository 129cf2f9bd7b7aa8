"""Token vectors in Qdrant: a multivector collection with MaxSim, and a first-stage vector searched by HNSW.

Two ways to reach the same engine, with the same collection layout: embedded (Qdrant Edge, `qdrant-edge-py`,
a shard in a local folder and no server) and a Qdrant server or cluster (`qdrant-client`, a URL; ":memory:"
for its in-process mode). The layout follows Qdrant's advice for multivectors: "tokens" (MaxSim, no HNSW
graph of its own) re-ranks the candidates of "muvera" or "dense" (HNSW) in one query with a prefetch.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any, NamedTuple, Protocol

import numpy as np

from .config import IndexConfig

TOKENS = "tokens"
SPARSE = "sparse"
SparseVector = tuple[np.ndarray, np.ndarray]
"""(indices uint32, values float32) of a sparse vector's non-zero entries."""
MANIFEST = "polyvec-index.json"
LOCK = ".polyvec-index.lock"
_IDS = uuid.UUID("6f1d3c2a-8c57-4b4e-9a55-3d1c8d8f0b21")  # namespace of the point ids: uuid5(doc id)


class Hit(NamedTuple):
    id: str
    score: float


def point_id(doc_id: str) -> uuid.UUID:
    """Qdrant ids are integers or UUIDs; a document's is derived from its id, so adding it again replaces it."""
    return uuid.uuid5(_IDS, doc_id)


class Backend(Protocol):
    config: IndexConfig

    def upsert(self, ids: Sequence[str], vectors: dict[str, list[np.ndarray] | np.ndarray]) -> None: ...

    def search(
        self, queries: dict[str, list[np.ndarray] | np.ndarray], k: int, prefetch: int, params: SearchOptions
    ) -> list[list[Hit]]: ...

    def count(self) -> int: ...

    def existing(self, ids: Sequence[str]) -> list[str]: ...

    def optimize(self) -> None: ...

    def disk_bytes(self) -> int | None: ...

    def close(self) -> None: ...


class SearchOptions(NamedTuple):
    hnsw_ef: int | None = None
    rescore: bool | None = None  # quantized indexes: re-score with the float32 originals (Qdrant's default: yes)
    oversampling: float | None = None
    exact: bool = False  # the first stage by brute force instead of HNSW


def _first_stage(config: IndexConfig) -> tuple[str, int] | None:
    """The first stage's dense vector: its name and width (None for "sparse" and "none")."""
    if config.first_stage == "muvera":
        return "muvera", config.muvera.output_dim()
    if config.first_stage == "dense":
        assert config.dense_dim is not None
        return "dense", config.dense_dim
    return None


# -------------------------------------------------------------------------------------------------- embedded


def _lock(root: Path) -> IO[str] | None:
    """An exclusive lock on the index folder while it is open (released when the file closes): two handles on
    one embedded shard each write their own view, and the last to close drops the other's documents."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock, as before
        return None
    try:
        f = open(root / LOCK, "a")  # noqa: SIM115 (held open while the index is)
    except OSError:  # a folder this user may only read: locked as it is, if the lock file is there
        try:
            f = open(root / LOCK)  # noqa: SIM115
        except OSError:
            return None
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        raise ValueError(f"{root} is open elsewhere (another process or Index handle); close it first") from None
    return f


class EdgeBackend:
    """A Qdrant Edge shard in `path`/shard, the recipe in `path`/polyvec-index.json."""

    def __init__(self, path: Path, config: IndexConfig, shard: Any, lock: IO[str] | None = None):
        self.path, self.config, self.shard, self.lock = path, config, shard, lock

    @classmethod
    def create(cls, path: str | os.PathLike, config: IndexConfig, overwrite: bool = False) -> EdgeBackend:
        q = _edge()  # the extra not installed: said before a folder is made
        root = Path(path)
        exists = (root / MANIFEST).exists() or (root / "shard").exists()
        if exists and not overwrite:
            raise FileExistsError(f"{root} already holds an index (overwrite=True, or --overwrite, replaces it)")
        root.mkdir(parents=True, exist_ok=True)
        lock = _lock(root)
        try:
            backend = cls._create(q, root, config, exists, lock)
        except BaseException:
            if lock is not None:
                lock.close()
            raise
        return backend

    @classmethod
    def _create(cls, q: Any, root: Path, config: IndexConfig, exists: bool, lock: IO[str] | None) -> EdgeBackend:
        if exists and (root / "shard").exists():  # a folder this user may not write: said, not left half-replaced
            shutil.rmtree(root / "shard")
        quant: Any = None
        if config.quantization == "int8":
            quant = q.ScalarQuantizationConfig(q.ScalarType.Int8, always_ram=True)
        elif config.quantization == "binary":
            quant = q.BinaryQuantizationConfig(always_ram=True)
        cold = q.Memory.Cold if quant is not None else None  # float32 originals on disk, read to re-score
        maxsim = q.MultiVectorConfig(q.MultiVectorComparator.MaxSim)
        vectors = {
            TOKENS: q.EdgeVectorParams(
                size=config.dim,
                distance=q.Distance.Dot,
                multivector_config=maxsim,
                hnsw_config=q.HnswIndexConfig(m=0, ef_construct=100, full_scan_threshold=10_000),  # re-rank only
                quantization_config=quant,
                memory=cold,
            )
        }
        stage = _first_stage(config)
        if stage is not None:
            vectors[stage[0]] = q.EdgeVectorParams(
                size=stage[1], distance=q.Distance.Dot, quantization_config=quant, memory=cold
            )
        sparse = {SPARSE: q.EdgeSparseVectorParams()} if config.first_stage == "sparse" else None
        # No write-ahead log: every upsert is flushed into the segments instead (durable once `add` returns), which
        # writes faster and spares a log the size of the data that Qdrant Edge does not trim.
        edge_config = q.EdgeConfig(vectors=vectors, sparse_vectors=sparse, wal_enabled=False)
        shard = q.EdgeShard.create(str(root / "shard"), edge_config)
        (root / MANIFEST).write_text(json.dumps(config.to_dict(), indent=1) + "\n")
        return cls(root, config, shard, lock)

    @classmethod
    def open(cls, path: str | os.PathLike) -> EdgeBackend:
        root = Path(path)
        if not (root / MANIFEST).is_file():
            raise FileNotFoundError(f"{root} holds no polyvec index ({MANIFEST} is missing)")
        try:
            recipe = json.loads((root / MANIFEST).read_text())
            if not isinstance(recipe, dict):
                raise ValueError(f"{MANIFEST} holds {type(recipe).__name__}, not an object")
            config = IndexConfig.from_dict(recipe)
        except (ValueError, TypeError) as exc:  # a damaged recipe (JSON errors are ValueErrors)
            raise ValueError(f"{root} is not a readable polyvec index: {exc}") from None
        q = _edge()
        lock = _lock(root)
        try:
            shard = q.EdgeShard.load(str(root / "shard"))
        except Exception as exc:  # Qdrant Edge's own error type for a missing or damaged shard
            if lock is not None:
                lock.close()
            if "Permission denied" in str(exc):  # not damaged: Qdrant Edge opens its files for writing, even to search
                raise ValueError(
                    f"{root}: this user may not write the index's files, which Qdrant Edge opens for writing even "
                    f"to search ({exc})"
                ) from None
            raise ValueError(f"{root} is not a readable polyvec index: {exc}") from None
        return cls(root, config, shard, lock)

    def upsert(self, ids: Sequence[str], vectors: dict[str, list[np.ndarray] | np.ndarray]) -> None:
        q = _edge()

        def value(name: str, i: int) -> Any:
            v = vectors[name][i]
            return q.SparseVector(v[0].tolist(), v[1].tolist()) if name == SPARSE else v.tolist()

        points = [
            q.Point(point_id(doc_id), {n: value(n, i) for n in vectors}, {"id": doc_id}) for i, doc_id in enumerate(ids)
        ]
        self.shard.update(q.UpdateOperation.upsert_points(points))
        self.shard.flush()

    def search(
        self, queries: dict[str, list[np.ndarray] | np.ndarray], k: int, prefetch: int, params: SearchOptions
    ) -> list[list[Hit]]:
        q = _edge()
        quant = None
        if self.config.quantization != "none":
            quant = q.QuantizationSearchParams(rescore=params.rescore, oversampling=params.oversampling)
        sp = q.SearchParams(hnsw_ef=params.hnsw_ef, exact=params.exact, quantization=quant)
        stage = _first_stage(self.config)
        requests = []
        for i, tokens in enumerate(queries[TOKENS]):
            rerank = q.Query.Nearest(tokens.tolist(), using=TOKENS)
            if SPARSE in queries:
                indices, values = queries[SPARSE][i]
                near = q.Query.Nearest(q.SparseVector(indices.tolist(), values.tolist()), using=SPARSE)
            elif stage is None:
                requests.append(q.QueryRequest(limit=k, query=rerank, with_payload=["id"], params=sp))
                continue
            else:
                near = q.Query.Nearest(queries[stage[0]][i].tolist(), using=stage[0])
            first = q.Prefetch(limit=prefetch, query=near, params=sp)
            requests.append(q.QueryRequest(limit=k, prefetches=[first], query=rerank, with_payload=["id"], params=sp))
        results = self.shard.query_batch(q.QueryBatchRequest(requests))
        return [[Hit(str((p.payload or {})["id"]), float(p.score)) for p in r] for r in results]

    def count(self) -> int:
        return int(self.shard.info().points_count)

    def existing(self, ids: Sequence[str]) -> list[str]:
        """Those of `ids` already stored."""
        found = self.shard.retrieve([point_id(i) for i in ids], ["id"], False)
        return [str((p.payload or {})["id"]) for p in found]

    def optimize(self) -> None:
        self.shard.optimize()  # merges segments and builds the HNSW graphs

    def disk_bytes(self) -> int | None:
        # The segments' blocks in use, as du counts them (Qdrant preallocates its mmap files sparsely); an index
        # written before the log was turned off keeps a write-ahead log beside them, not counted.
        files = (self.path / "shard" / "segments").rglob("*")
        return sum(f.stat().st_blocks * 512 for f in files if f.is_file())

    def close(self) -> None:
        try:
            self.shard.flush()
            self.shard.close()
        finally:
            if self.lock is not None:
                self.lock.close()
                self.lock = None


def _edge() -> Any:
    try:
        import qdrant_edge
    except ImportError:
        raise ImportError(
            "an embedded index needs Qdrant Edge: pip install 'polyvec[index]' (qdrant-edge-py)"
        ) from None
    return qdrant_edge


# -------------------------------------------------------------------------------------------------- a server


class ClientBackend:
    """A collection on a Qdrant server or cluster (or qdrant-client's in-process mode), the recipe in the
    collection's metadata."""

    def __init__(self, client: Any, collection: str, config: IndexConfig):
        self.client, self.collection, self.config = client, collection, config

    @staticmethod
    def connect(location: str, api_key: str | None = None) -> Any:
        try:
            from qdrant_client import QdrantClient
        except ImportError:
            raise ImportError("a Qdrant server index needs qdrant-client: pip install 'polyvec[index]'") from None
        if location == ":memory:":
            return QdrantClient(":memory:")
        return QdrantClient(url=location, api_key=api_key or os.environ.get("QDRANT_API_KEY"))

    @classmethod
    def create(
        cls,
        client: Any,
        collection: str,
        config: IndexConfig,
        overwrite: bool = False,
        shards: int | None = None,
        replicas: int | None = None,
    ) -> ClientBackend:
        from qdrant_client import models as m

        if client.collection_exists(collection):
            if not overwrite:
                raise FileExistsError(
                    f"collection {collection!r} already exists (overwrite=True, or --overwrite, replaces it)"
                )
            client.delete_collection(collection)
        quant: Any = None
        if config.quantization == "int8":
            quant = m.ScalarQuantization(scalar=m.ScalarQuantizationConfig(type=m.ScalarType.INT8, always_ram=True))
        elif config.quantization == "binary":
            quant = m.BinaryQuantization(binary=m.BinaryQuantizationConfig(always_ram=True))
        on_disk = True if quant is not None else None
        vectors = {
            TOKENS: m.VectorParams(
                size=config.dim,
                distance=m.Distance.DOT,
                multivector_config=m.MultiVectorConfig(comparator=m.MultiVectorComparator.MAX_SIM),
                hnsw_config=m.HnswConfigDiff(m=0),  # re-rank only
                quantization_config=quant,
                on_disk=on_disk,
            )
        }
        stage = _first_stage(config)
        if stage is not None:
            vectors[stage[0]] = m.VectorParams(
                size=stage[1], distance=m.Distance.DOT, quantization_config=quant, on_disk=on_disk
            )
        client.create_collection(
            collection,
            vectors_config=vectors,
            sparse_vectors_config={SPARSE: m.SparseVectorParams()} if config.first_stage == "sparse" else None,
            shard_number=shards,
            replication_factor=replicas,
            metadata={"polyvec": config.to_dict()},
        )
        return cls(client, collection, config)

    @classmethod
    def open(cls, client: Any, collection: str) -> ClientBackend:
        if not client.collection_exists(collection):
            raise FileNotFoundError(f"no collection {collection!r}")
        meta = (client.get_collection(collection).config.metadata or {}).get("polyvec")
        if meta is None:
            raise FileNotFoundError(f"collection {collection!r} was not written by polyvec (no 'polyvec' metadata)")
        return cls(client, collection, IndexConfig.from_dict(meta))

    def upsert(self, ids: Sequence[str], vectors: dict[str, list[np.ndarray] | np.ndarray]) -> None:
        from qdrant_client import models as m

        def value(name: str, i: int) -> Any:
            v = vectors[name][i]
            return m.SparseVector(indices=v[0].tolist(), values=v[1].tolist()) if name == SPARSE else v.tolist()

        points = [
            m.PointStruct(id=str(point_id(doc_id)), vector={n: value(n, i) for n in vectors}, payload={"id": doc_id})
            for i, doc_id in enumerate(ids)
        ]
        self.client.upsert(self.collection, points=points, wait=True)

    def search(
        self, queries: dict[str, list[np.ndarray] | np.ndarray], k: int, prefetch: int, params: SearchOptions
    ) -> list[list[Hit]]:
        from qdrant_client import models as m

        quant = None
        if self.config.quantization != "none":
            quant = m.QuantizationSearchParams(rescore=params.rescore, oversampling=params.oversampling)
        sp = None  # left out unless set: qdrant-client's in-process mode warns that it ignores them
        if quant is not None or params.hnsw_ef is not None or params.exact:
            sp = m.SearchParams(hnsw_ef=params.hnsw_ef, exact=params.exact, quantization=quant)
        stage = _first_stage(self.config)
        requests = []
        for i, tokens in enumerate(queries[TOKENS]):
            first = None
            if SPARSE in queries:
                indices, values = queries[SPARSE][i]
                near = m.SparseVector(indices=indices.tolist(), values=values.tolist())
                first = [m.Prefetch(query=near, using=SPARSE, limit=prefetch, params=sp)]
            elif stage is not None:
                first = [m.Prefetch(query=queries[stage[0]][i].tolist(), using=stage[0], limit=prefetch, params=sp)]
            requests.append(
                m.QueryRequest(
                    query=tokens.tolist(), using=TOKENS, prefetch=first, limit=k, with_payload=["id"], params=sp
                )
            )
        results = self.client.query_batch_points(self.collection, requests=requests)
        return [[Hit(str((p.payload or {})["id"]), float(p.score)) for p in r.points] for r in results]

    def count(self) -> int:
        return int(self.client.count(self.collection, exact=True).count)

    def existing(self, ids: Sequence[str]) -> list[str]:
        found = self.client.retrieve(self.collection, [str(point_id(i)) for i in ids], with_payload=["id"])
        return [str((p.payload or {})["id"]) for p in found]

    def optimize(self) -> None:
        pass  # a server optimizes in the background

    def disk_bytes(self) -> int | None:
        return None

    def close(self) -> None:
        self.client.close()
