"""Pooling outputs as Arrow columns, and a corpus encoded into one Parquet file with them.

The same columns come from `polyvec embed --output FILE.parquet` and from `polyvec embed --ray` (Ray Data):
embed, a fixed_size_list<float32, d>; token_embed and token_classify, a list<fixed_size_list<float32, d>> (one
entry per token, nothing padded); classify, a list<float32>; embed_sparse, a struct of indices and values. Token
codes (`token_encoding`) keep their integers: int8 codes and a `{column}_scales` list<float32> (one scale per
token), or binary's packed uint8 bytes; a MUVERA encoding is one fixed_size_list<float32>. Plain Arrow types, so
any Parquet reader reads them. pyarrow is needed only here (it comes with `polyvec[ray]`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from .entrypoints.llm import LLM

TOKEN_BATCH_SIZE = 256
"""Rows per batch when a task returns vectors per token: megabytes of output a batch, written as it comes."""
ROW_BATCH_SIZE = 1024
"""Rows per batch when each row gets one vector or list: fewer, larger read, encode and write steps."""

PARQUET_OPTIONS: dict[str, Any] = {"use_dictionary": False}
"""Options of every Parquet write: dictionaries of float vectors (and of unique texts) cost time and save nothing."""


def default_batch_size(task: str | Sequence[str]) -> int:
    tasks = [task] if isinstance(task, str) else task
    return TOKEN_BATCH_SIZE if {"token_embed", "token_classify"} & set(tasks) else ROW_BATCH_SIZE


def _vectors(rows: Sequence[np.ndarray], dtype: Any = np.float32) -> Any:
    """[n_i, d] arrays → list<fixed_size_list<dtype, d>>: token vectors (or codes) without padding."""
    import pyarrow as pa

    width = rows[0].shape[1] if rows else 0
    flat = np.concatenate([r.reshape(-1, width) for r in rows]) if rows else np.zeros((0, 0))
    offsets = np.zeros(len(rows) + 1, dtype=np.int32)
    offsets[1:] = np.cumsum([r.shape[0] for r in rows])
    inner = pa.FixedSizeListArray.from_arrays(pa.array(flat.reshape(-1).astype(dtype, copy=False)), width)
    return pa.ListArray.from_arrays(pa.array(offsets), inner)


def _code_columns(name: str, outputs: Sequence[Any]) -> dict[str, Any]:
    """Token codes (`TokenCodes`, one per row): the codes as integers, and int8's scales."""
    import pyarrow as pa

    columns = {name: _vectors([c.codes.numpy() for c in outputs], outputs[0].codes.numpy().dtype)}
    if outputs[0].scales is not None:
        columns[f"{name}_scales"] = pa.array([c.scales.numpy() for c in outputs], pa.list_(pa.float32()))
    return columns


def task_column(task: str, outputs: Sequence[Any]) -> Any:
    """One task's outputs (tensors, one per row) as an Arrow array."""
    import pyarrow as pa

    arrays = [o.float().numpy() for o in outputs]
    if task == "token_classify":  # one score per token (bge-m3's sparse weights) is a width of 1
        return _vectors([a.reshape(a.shape[0], -1) for a in arrays])
    if task == "token_embed" and not (arrays and arrays[0].ndim == 1):  # 1-D: MUVERA's
        return _vectors(arrays)
    if task == "embed_sparse":
        indices = [np.flatnonzero(a).astype(np.int32) for a in arrays]
        values = [a[i] for a, i in zip(arrays, indices)]
        return pa.StructArray.from_arrays(
            [pa.array(indices, pa.list_(pa.int32())), pa.array(values, pa.list_(pa.float32()))], ["indices", "values"]
        )
    if task == "classify":
        return pa.array([a.astype(np.float32) for a in arrays], pa.list_(pa.float32()))
    width = arrays[0].shape[0] if arrays else 0  # embed: one vector per row
    flat = np.concatenate(arrays).astype(np.float32, copy=False) if arrays else np.zeros(0, dtype=np.float32)
    return pa.FixedSizeListArray.from_arrays(pa.array(flat), width)


def output_columns(
    tasks: str | Sequence[str], outputs: Sequence[Any], output_column: str | None = None
) -> dict[str, Any]:
    """{column name: Arrow array} of a batch's outputs (`PoolingRequestOutput`s): one task's column is named
    `output_column` (default: the task); several tasks from one pass get `{output_column}_{task}` (or the task)."""
    if isinstance(tasks, str):
        if outputs and getattr(outputs[0].outputs, "codes", None) is not None:
            return _code_columns(output_column or tasks, [o.outputs.codes for o in outputs])
        return {output_column or tasks: task_column(tasks, [o.outputs.data for o in outputs])}
    prefix = f"{output_column}_" if output_column else ""
    return {prefix + t: task_column(t, [o.outputs.data[t] for o in outputs]) for t in tasks}


def token_rows(column: Any) -> list[np.ndarray]:
    """A list<fixed_size_list<float32, d>> column back to one [n_i, d] array per row."""
    import pyarrow as pa

    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    width = arr.type.value_type.list_size
    offsets = arr.offsets.to_numpy()
    flat = arr.values.flatten().to_numpy(zero_copy_only=False).reshape(-1, width)
    return [flat[offsets[i] : offsets[i + 1]] for i in range(len(arr))]


def encode_to_parquet(
    llm: LLM,
    ids: Sequence[str],
    texts: Sequence[str],
    path: str,
    task: str | Sequence[str] = "embed",
    *,
    batch_size: int | None = None,
    on_row: Callable[[Any], None] | None = None,
) -> int:
    """Encode `texts` (row i has id `ids[i]`) and write `id`, `text` and the task's column(s) to the Parquet
    file `path`, a row group every `batch_size` rows as outputs come: memory holds a batch, not the corpus.
    `on_row(output)` sees each output. Returns the number of rows written."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if not texts or len(ids) != len(texts):
        raise ValueError(f"encode_to_parquet needs texts and one id each: {len(texts)} texts, {len(ids)} ids")

    rows = batch_size or default_batch_size(task)
    writer: Any = None
    pending: list[Any] = []
    written = 0

    def flush() -> None:
        nonlocal writer, written
        n = len(pending)
        table = pa.table(
            {
                "id": pa.array(ids[written : written + n], pa.string()),
                "text": pa.array(texts[written : written + n], pa.string()),
                **output_columns(task, pending),
            }
        )
        if writer is None:
            writer = pq.ParquetWriter(path, table.schema, **PARQUET_OPTIONS)
        writer.write_table(table, row_group_size=n)
        written += n
        pending.clear()

    try:
        for out in llm.iter_encode(texts, pooling_task=task):
            pending.append(out)
            if on_row is not None:
                on_row(out)
            if len(pending) == rows:
                flush()
        if pending:
            flush()
    finally:
        if writer is not None:
            writer.close()
    return written
