"""Corpus encoding on Ray Data: a pool of polyvec engines (one Ray actor each) behind `map_batches`.

    import ray
    from polyvec.integrations.ray import encode_dataset

    ds = ray.data.read_json("corpus.jsonl", num_cpus=0.25)         # or read_parquet, from_items, ...
    out = encode_dataset(ds, "colbert-model", task="token_embed")  # one engine per node by default
    out.write_parquet("vectors/", ray_remote_args={"num_cpus": 0.25})

Every task polyvec serves: embed (a fixed-size list column), token_embed and token_classify (a list of
fixed-size lists: one row per token, nothing padded), classify (a list), embed_sparse (a struct of indices and
values) and several tasks from one forward pass (one column per task). The columns are plain Arrow types, so
Parquet readers without Ray read them. Ray retries a batch whose actor died on a new one; the output of a
batch is kept only once it completes, so each input row comes out exactly once. `index_dataset` writes the
token vectors into a `polyvec.index.Index` (Qdrant) instead.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..columns import ROW_BATCH_SIZE, TOKEN_BATCH_SIZE, default_batch_size, output_columns, token_rows
from ..eval import document_text

__all__ = ["ROW_BATCH_SIZE", "TOKEN_BATCH_SIZE", "default_batch_size", "encode_dataset", "index_dataset", "token_rows"]


class PolyvecEncoder:
    """The callable class `map_batches` runs in each actor: one LLM per actor, loaded once."""

    def __init__(
        self,
        model: str,
        task: str | Sequence[str] = "embed",
        text_column: str = "text",
        output_column: str | None = None,
        pooling_params: dict[str, Any] | None = None,
        num_threads: int | None = None,
        llm_kwargs: dict[str, Any] | None = None,
        title_column: str | None = None,
    ):
        from .. import LLM, PoolingParams

        self.llm = LLM(model, num_threads=num_threads, **(llm_kwargs or {}))
        self.task, self.text_column, self.title_column = task, text_column, title_column
        self.output_column = output_column
        self.params = PoolingParams(**(pooling_params or {}))
        self.pid = os.getpid()

    def __call__(self, batch: Any) -> Any:
        texts = batch.column(self.text_column).to_pylist()
        if self.title_column and self.title_column in batch.column_names:  # BEIR: title and text as one text
            import pyarrow as pa

            titles = batch.column(self.title_column).to_pylist()
            texts = [document_text({"title": a, "text": b}) for a, b in zip(titles, texts)]
            batch = batch.set_column(batch.column_names.index(self.text_column), self.text_column, pa.array(texts))
        outs = self.llm.encode(texts, self.params, pooling_task=self.task, use_tqdm=False)
        for name, column in output_columns(self.task, outs, self.output_column).items():
            batch = batch.append_column(name, column)
        return batch


def default_pool(num_gpus: float = 0) -> tuple[int, int]:
    """(actors, threads per actor) for the connected cluster: one engine per GPU, else one per node with the
    node's CPUs as its threads (one engine using every core beats several sharing them)."""
    import ray

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    if num_gpus:
        gpus = sum(n["Resources"].get("GPU", 0) for n in nodes)
        return max(1, int(gpus // num_gpus)), 2
    cpus = [int(n["Resources"].get("CPU", 1)) for n in nodes] or [os.cpu_count() or 1]
    return len(cpus), max(1, min(cpus))


def encode_dataset(
    ds: Any,
    model: str,
    task: str | Sequence[str] = "embed",
    *,
    text_column: str = "text",
    title_column: str | None = None,
    output_column: str | None = None,
    pooling_params: dict[str, Any] | None = None,
    actors: int | None = None,
    threads_per_actor: int | None = None,
    num_gpus: float = 0,
    batch_size: int | None = None,
    **llm_kwargs: Any,
) -> Any:
    """`ds` with the task's output column(s) added, computed by `actors` polyvec engines (lazy, as Ray Data
    is: write or iterate the result to run it); `batch_size` rows at a time (default: `default_batch_size`).
    With `title_column` (a BEIR corpus: "title"), rows that have one are encoded as title and text joined, and
    the text column holds that; the engines join them, so no pass over the data is added."""
    import ray.data

    if not ray.is_initialized():
        ray.init()
    auto_actors, auto_threads = default_pool(num_gpus)
    actors = actors or auto_actors
    threads = threads_per_actor or auto_threads
    # An engine on a whole node reserves a CPU less than it uses, so that the read and write tasks feeding it
    # (give them num_cpus <= 0.5, as `polyvec embed --ray` does) can be scheduled beside it, not deadlock; half a
    # CPU was too little room for Ray Data, whose own processes then slowed the engine.
    reserve = threads if threads_per_actor or num_gpus else max(0.5, threads - 1)
    batch_size = default_batch_size(task) if batch_size is None else batch_size
    if actors < 1 or threads < 1 or batch_size < 1:
        raise ValueError(
            f"actors, threads_per_actor and batch_size must be positive: {actors}, {threads}, {batch_size}"
        )
    return ds.map_batches(
        PolyvecEncoder,
        fn_constructor_kwargs={
            "model": model,
            "task": task,
            "text_column": text_column,
            "title_column": title_column,
            "output_column": output_column,
            "pooling_params": pooling_params,
            "num_threads": None if num_gpus else threads,
            "llm_kwargs": llm_kwargs,
        },
        batch_size=batch_size,
        batch_format="pyarrow",
        compute=ray.data.ActorPoolStrategy(size=actors),
        num_cpus=reserve,
        num_gpus=num_gpus or None,
    )


def index_dataset(
    ds: Any,
    index: Any,
    *,
    id_column: str = "id",
    text_column: str = "text",
    actors: int | None = None,
    threads_per_actor: int | None = None,
    num_gpus: float = 0,
    batch_size: int = TOKEN_BATCH_SIZE,
    **llm_kwargs: Any,
) -> int:
    """Encode a Dataset's documents on Ray with the index's model (as documents; with the embed or embed_sparse
    vectors too for a dense or sparse first stage of the same model) and write them into `index` (a
    `polyvec.index.Index`) from the driver, batch by batch. Returns how many were written."""
    config = index.config
    dense, sparse = config.first_stage == "dense", config.first_stage == "sparse"
    if sparse and config.sparse_model != config.model:
        raise ValueError("index_dataset encodes with one model: a sparse first stage must be the token model's own")
    out = encode_dataset(
        ds,
        config.model,
        task=["token_embed", "embed"] if dense else ["token_embed", "embed_sparse"] if sparse else "token_embed",
        text_column=text_column,
        pooling_params={"input_type": "document"},
        actors=actors,
        threads_per_actor=threads_per_actor,
        num_gpus=num_gpus,
        batch_size=batch_size,
        **llm_kwargs,
    )
    written = 0
    for batch in out.iter_batches(batch_format="pyarrow", batch_size=batch_size):
        ids = [str(x) for x in batch.column(id_column).to_pylist()]
        vectors = None
        if dense:
            col = batch.column("embed").combine_chunks()
            vectors = col.values.to_numpy(zero_copy_only=False).reshape(len(ids), -1)
        pairs = None
        if sparse:
            col = batch.column("embed_sparse").to_pylist()
            pairs = [
                (np.asarray(r["indices"], dtype=np.uint32), np.asarray(r["values"], dtype=np.float32)) for r in col
            ]
        index.add_vectors(ids, token_rows(batch.column("token_embed")), vectors, pairs)
        written += len(ids)
    return written
