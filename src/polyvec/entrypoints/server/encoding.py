"""Output encodings of vLLM's pooling endpoints: float lists, base64 and raw bytes.

base64 and bytes carry the raw elements of `embed_dtype` (bfloat16 as its 16-bit pattern) in the asked-for
byte order, flattened; multi-vector outputs add their `shape` so clients can rebuild them. The bytes formats
answer with `application/octet-stream`; `bytes` adds a `metadata` header (JSON: id, created, model, usage and
per item index, embed_dtype, endianness, start, end, shape), `bytes_only` sends the body alone.
"""

from __future__ import annotations

import base64
import sys

import numpy as np
import torch

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def to_bytes(tensor: torch.Tensor, embed_dtype: str, endianness: str) -> bytes:
    t = tensor.detach().to(TORCH_DTYPES[embed_dtype]).contiguous().flatten()
    if embed_dtype == "bfloat16":
        t = t.view(torch.int16)  # numpy has no bfloat16; ship the bit pattern
    array = t.numpy()
    if endianness != "native" and endianness != sys.byteorder:
        array = array.byteswap()
    return array.tobytes()


def from_bytes(data: bytes, shape: list[int] | tuple[int, ...], embed_dtype: str, endianness: str) -> torch.Tensor:
    """Inverse of `to_bytes` (used by the tests and usable by clients)."""
    np_dtype = {"float32": np.float32, "float16": np.float16, "bfloat16": np.int16}[embed_dtype]
    array = np.frombuffer(data, dtype=np_dtype)
    if endianness != "native" and endianness != sys.byteorder:
        array = array.byteswap()
    t = torch.from_numpy(array.copy())
    if embed_dtype == "bfloat16":
        t = t.view(torch.bfloat16)
    return t.reshape(tuple(shape)).float()


def encode_json(tensor: torch.Tensor, encoding_format: str, embed_dtype: str, endianness: str):
    """float → nested lists; base64 → a string of the raw bytes."""
    if encoding_format == "float":
        return tensor.tolist()
    return base64.b64encode(to_bytes(tensor, embed_dtype, endianness)).decode("ascii")


def encode_bytes(tensors: list[torch.Tensor], embed_dtype: str, endianness: str) -> tuple[bytes, list[dict]]:
    chunks, items, offset = [], [], 0
    for i, t in enumerate(tensors):
        raw = to_bytes(t, embed_dtype, endianness)
        items.append({"index": i, "embed_dtype": embed_dtype, "endianness": endianness, "start": offset,
                      "end": offset + len(raw), "shape": list(t.shape)})
        chunks.append(raw)
        offset += len(raw)
    return b"".join(chunks), items
