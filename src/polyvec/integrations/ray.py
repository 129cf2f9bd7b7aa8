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
from ..eval import row_id, row_text, titled_texts
from . import engine_device

__all__ = [
    "ROW_BATCH_SIZE",
    "TOKEN_BATCH_SIZE",
    "default_batch_size",
    "encode_dataset",
    "index_dataset",
    "plan_pool",
    "token_rows",
]


class PolyvecEncoder:
    """The callable class `map_batches` runs in each actor: one LLM per actor, loaded once.

    `rows` is what a batch holds and gives back: "keep" (the default) adds the output columns to the input's;
    "plain" gives `id` (a string, from `_id` or `id`), `text` and the outputs, the columns `polyvec embed --output
    FILE.parquet` writes; "jsonl" does the same from lines of JSON in `text_column` (a JSONL file read as text,
    so ids stay the strings they are: Ray's JSON reader guesses "007" is 7)."""

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
        rows: str = "keep",
    ):
        from .. import LLM, PoolingParams

        self.llm = LLM(model, num_threads=num_threads, **(llm_kwargs or {}))
        self.task, self.text_column, self.title_column = task, text_column, title_column
        self.output_column, self.rows = output_column, rows
        self.params = PoolingParams(**(pooling_params or {}))
        self.pid = os.getpid()

    def __call__(self, batch: Any) -> Any:
        import pyarrow as pa

        if self.rows == "jsonl":
            ids, texts = _json_rows(batch.column("text").to_pylist(), self.text_column)
            batch = pa.table({"id": ids, "text": texts})
        else:
            if self.text_column not in batch.column_names:
                names = ", ".join(batch.column_names)
                raise ValueError(f"no column {self.text_column!r} (give --text-column); it has: {names}")
            texts = batch.column(self.text_column).to_pylist()
            if self.title_column and self.title_column in batch.column_names:  # BEIR: title and text as one text
                texts = titled_texts(batch.column(self.title_column).to_pylist(), texts, self.text_column)
                batch = batch.set_column(batch.column_names.index(self.text_column), self.text_column, pa.array(texts))
            bad = next((i for i, t in enumerate(texts) if not isinstance(t, str)), None)
            if bad is not None:
                raise ValueError(f"a row of column {self.text_column!r} is not a text: {texts[bad]!r}")
            if self.rows == "plain":
                batch = pa.table({"id": _ids(batch), "text": texts})
        outs = self.llm.encode(texts, self.params, pooling_task=self.task, use_tqdm=False)
        for name, column in output_columns(self.task, outs, self.output_column).items():
            batch = batch.append_column(name, column)
        return batch


ROWS = ("keep", "plain", "jsonl")


LLM_ARGS = frozenset(
    "allowed_media_domains convert device download_dir dtype enable_prefix_caching hf_overrides kernels "
    "kv_cache_memory_bytes limit_mm_per_prompt long_input max_image_pixels max_model_len max_num_batched_tokens "
    "max_num_seqs mm_processor_kwargs num_threads pooler_config quantization revision scheduling_policy tokenizer "
    "truncation "
    "window_overlap".split()
)
"""LLM()'s own keywords, written out: the driver checks them without importing torch (a test keeps them equal)."""


def _check_llm_kwargs(kwargs: dict[str, Any]) -> None:
    """TypeError for a keyword LLM() does not take (a typo failed each actor once the job ran)."""
    from ..entrypoints import vllm_compat

    known = LLM_ARGS | {*vllm_compat.IGNORED, *vllm_compat.PARALLEL, "runner", "task", "enforce_eager"}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise TypeError(f"encode_dataset got unexpected arguments (neither its own nor LLM's): {', '.join(unknown)}")


def _ids(batch: Any) -> list[str]:
    """A batch's ids as strings, from `_id` (BEIR) or `id`."""
    name = next((c for c in ("_id", "id") if c in batch.column_names), None)
    if name is None:  # row numbers, as polyvec embed gives such rows, have no meaning across Ray's blocks
        raise ValueError(f"no '_id' or 'id' column: --ray needs ids (it has: {', '.join(batch.column_names)})")
    values = batch.column(name).to_pylist()
    for value in values:  # as polyvec embed reads a Parquet id: a string or an integer, never made up
        if value is None or isinstance(value, bool) or not isinstance(value, (str, int)):
            raise ValueError(f"a row's {name!r} is {type(value).__name__} {value!r}, not an id")
    return [str(x) for x in values]


def _json_rows(lines: list[str], text_column: str) -> tuple[list[str], list[str]]:
    """Ids and texts of JSONL lines, as `polyvec embed` reads them (row_text), ids required."""
    import json

    ids, texts = [], []
    for line in lines:
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            texts.append(row_text(row, text_column))
            doc_id = row_id(row)
        except ValueError as exc:  # not JSON, not an object, no text, an id that is null or a list
            raise ValueError(f"the JSON line {line[:80]!r} {exc}") from None
        if doc_id is None:
            raise ValueError(f"a JSON line without '_id' or 'id' (--ray needs ids): {line[:80]!r}")
        ids.append(doc_id)
    return ids, texts


def plan_pool(actors: int | None, threads: int | None, num_gpus: float = 0) -> tuple[int, int, float]:
    """(actors, threads per actor, CPUs each reserves) for the connected cluster. Defaults: one engine per GPU,
    else one per node with the node's CPUs as its threads (one engine using every core beats several sharing
    them). The reservations always leave half a CPU on a node for the read and write tasks that feed the engines
    (num_cpus 0.25 each, as `polyvec embed --ray` asks): taking every CPU left them unscheduled, a job hung."""
    import ray

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    cpus = min([int(n["Resources"].get("CPU", 0)) for n in nodes] or [os.cpu_count() or 1])
    if num_gpus:
        gpus = sum(n["Resources"].get("GPU", 0) for n in nodes)
        if gpus < num_gpus:  # Ray would wait for them for ever
            raise ValueError(f"{num_gpus:g} GPU(s) per actor asked of a cluster with {gpus:g} GPU(s)")
        actors = actors or max(1, int(gpus // num_gpus))
    else:
        actors = actors or max(1, len(nodes))
    per_node = -(-actors // max(1, len(nodes)))  # on the busiest node, as Ray spreads them
    if threads is not None and threads > cpus and not num_gpus:
        raise ValueError(f"{threads} threads per actor is more than a node's {cpus} CPUs")
    threads = threads or (2 if num_gpus else max(1, cpus // per_node))
    room = (cpus - 0.5) / per_node
    if room <= 0:
        raise ValueError(f"{actors} actors do not fit nodes of {cpus} CPUs beside the read and write tasks")
    # An engine on a whole node by default reserves a CPU less than it uses (half a CPU was too little room for
    # Ray Data, whose own processes then slowed it); given threads, what it uses, within the room there is.
    want = max(0.5, threads - 1) if threads == cpus // per_node and not num_gpus else threads
    return actors, threads, min(want, room)


def encode_dataset(
    ds: Any,
    model: str,
    task: str | Sequence[str] = "embed",
    *,
    text_column: str = "text",
    title_column: str | None = None,
    rows: str = "keep",
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
    the text column holds that; the engines join them, so no pass over the data is added. `rows`: what the
    output rows hold (see PolyvecEncoder; "plain" and "jsonl" give `polyvec embed`'s columns)."""
    import ray.data

    if not ray.is_initialized():
        ray.init()
    batch_size = default_batch_size(task) if batch_size is None else batch_size
    if (actors is not None and actors < 1) or (threads_per_actor is not None and threads_per_actor < 1):
        raise ValueError(f"actors and threads_per_actor must be positive: {actors}, {threads_per_actor}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive: {batch_size}")
    if rows not in ROWS:
        raise ValueError(f"rows must be one of {', '.join(ROWS)}, not {rows!r}")
    _check_llm_kwargs(llm_kwargs)  # here, not in each actor once the job runs
    llm_kwargs = engine_device(llm_kwargs, num_gpus)
    actors, threads, reserve = plan_pool(actors, threads_per_actor, num_gpus)
    return ds.map_batches(
        PolyvecEncoder,
        fn_constructor_kwargs={
            "model": model,
            "task": task,
            "text_column": text_column,
            "title_column": title_column,
            "rows": rows,
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
    id_column: str | None = None,
    text_column: str = "text",
    actors: int | None = None,
    threads_per_actor: int | None = None,
    num_gpus: float = 0,
    batch_size: int = TOKEN_BATCH_SIZE,
    **llm_kwargs: Any,
) -> int:
    """Encode a Dataset's documents on Ray with the index's model (as documents; with the embed or embed_sparse
    vectors too for a dense or sparse first stage of the same model) and write them into `index` (a
    `polyvec.index.Index`) from the driver, batch by batch; ids from `id_column` (default: `_id`, as in BEIR, or
    `id`). Returns how many were written."""
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
        ids = [str(x) for x in batch.column(id_column).to_pylist()] if id_column else _ids(batch)
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
