"""Output encodings of the embedding endpoints: float lists, base64, raw bytes and Cohere's packed bits.

base64 and bytes carry the raw elements of `embed_dtype` (bfloat16 as its 16-bit pattern) in the asked-for
byte order, flattened; multi-vector outputs add their `shape` so clients can rebuild them. The bytes formats
answer with `application/octet-stream`; `bytes` adds a `metadata` header (JSON: id, created, model, usage and
per item index, embed_dtype, endianness, start, end, shape), `bytes_only` sends the body alone. Cohere's embed
types (float, int8, uint8, binary, ubinary, base64) are built by `encode_by_type`.

JSON bodies that carry vectors are rendered by `VectorJSONResponse` (orjson): a float vector stays a float64
numpy array (`float_array`) up to the wire, so no Python float objects are made and json.dumps' per-float
repr is skipped. float64, not the model's float32: orjson writes a float32 array's elements as their shortest
float32 repr ("0.1"), which a client parses to a different float64 than the float32's exact value that
tensor.tolist() + json.dumps sent; widening first keeps every number a client parses bit-for-bit as before.
"""

from __future__ import annotations

import base64
import sys
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import orjson
import torch
from fastapi.responses import JSONResponse

from ...config import DTYPES

# embed_dtype → torch dtype: the model dtypes and vLLM's two float8 formats (one byte each).
EMBED_DTYPES = {**DTYPES, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def _wire_dtype(embed_dtype: str) -> torch.dtype:
    """The element type on the wire: numpy has no bfloat16 or float8, so they travel as their bit patterns."""
    dtype = EMBED_DTYPES[embed_dtype]
    if dtype.itemsize == 1:
        return torch.uint8
    return torch.int16 if dtype == torch.bfloat16 else dtype


def to_bytes(tensor: torch.Tensor, embed_dtype: str, endianness: str) -> bytes:
    t = tensor.detach().to(EMBED_DTYPES[embed_dtype]).contiguous().flatten().view(_wire_dtype(embed_dtype))
    array = t.numpy()
    if endianness != "native" and endianness != sys.byteorder:
        array = array.byteswap()
    return array.tobytes()


def from_bytes(data: bytes, shape: list[int] | tuple[int, ...], embed_dtype: str, endianness: str) -> torch.Tensor:
    """Inverse of `to_bytes` (used by the tests and usable by clients)."""
    array = np.frombuffer(data, dtype=torch.empty(0, dtype=_wire_dtype(embed_dtype)).numpy().dtype)
    if endianness != "native" and endianness != sys.byteorder:
        array = array.byteswap()
    t = torch.from_numpy(array.copy()).view(EMBED_DTYPES[embed_dtype])
    return t.reshape(tuple(shape)).float()


class VectorJSONResponse(JSONResponse):
    """JSONResponse rendered by orjson, numpy arrays (from `float_array`) included. Same JSON as json.dumps for
    these bodies (compact, UTF-8, keys in insertion order). orjson writes a non-finite float as null where
    JSONResponse raised; `float_array` raises for vectors, the scores are finite by construction."""

    def render(self, content: Any) -> bytes:
        if getattr(_large, "body", False):
            return dumps_in_pieces(content)
        return orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)


_large = threading.local()
"""Set by `build_large`: this thread builds a large body (a worker thread's, off the event loop), in pieces."""


def build_large(build: Callable[[], Any]) -> Any:
    """`build()` with VectorJSONResponse rendering in pieces (in a worker thread: see _PIECE_NUMBERS)."""
    _large.body = True
    try:
        return build()
    finally:
        _large.body = False


_PIECE_NUMBERS = 1 << 16
"""Most numbers orjson encodes in one call: it holds the GIL for a whole call, and a large body built in a worker
thread held the event loop (its health checks) as long."""


def dumps_in_pieces(value: Any) -> bytes:
    """orjson.dumps(value) (numpy arrays included), byte for byte, from calls of at most _PIECE_NUMBERS numbers
    each, joined once: the GIL is free between them."""
    pieces: list[bytes | memoryview] = []
    _pieces(value, pieces)
    return b"".join(pieces)


def _pieces(value: Any, out: list[bytes | memoryview]) -> None:
    if isinstance(value, np.ndarray) and value.size > _PIECE_NUMBERS and value.ndim > 0:
        rows = max(1, _PIECE_NUMBERS // max(1, value[0].size))
        out.append(b"[")
        for i in range(0, len(value), rows):
            if i:
                out.append(b",")
            if value[0].size > _PIECE_NUMBERS:  # rows too large themselves: one at a time, split again
                _pieces(value[i], out)
            else:
                out.append(memoryview(orjson.dumps(value[i : i + rows], option=orjson.OPT_SERIALIZE_NUMPY))[1:-1])
        out.append(b"]")
    elif isinstance(value, dict) and value:
        out.append(b"{")
        for j, (k, v) in enumerate(value.items()):
            if j:
                out.append(b",")
            out.append(orjson.dumps(str(k)) + b":")
            _pieces(v, out)
        out.append(b"}")
    elif isinstance(value, (list, tuple)) and len(value) > 1:
        out.append(b"[")
        for j, v in enumerate(value):
            if j:
                out.append(b",")
            _pieces(v, out)
        out.append(b"]")
    else:
        out.append(orjson.dumps(value, option=orjson.OPT_SERIALIZE_NUMPY))


def float_array(tensor: torch.Tensor) -> np.ndarray | float:
    """A tensor for `VectorJSONResponse`: float64 (the values tolist() gives, exactly), any shape; a 0-d tensor is
    a Python float. NaN or infinity, which JSON cannot spell, is a RuntimeError (a 500, as JSONResponse gave; not a
    ValueError, which the Cohere route reports as a bad embedding_types)."""
    array = tensor.detach().to(torch.float64).contiguous().numpy()  # orjson takes C-contiguous arrays only
    if not np.isfinite(array).all():
        raise RuntimeError("the model output a NaN or infinite value, which JSON cannot carry")
    return array if array.ndim else float(array)


def encode_json(tensor: torch.Tensor, encoding_format: str, embed_dtype: str, endianness: str):
    """float → a float64 array (JSON nested lists, by `VectorJSONResponse`); base64 → a string of the raw bytes."""
    if encoding_format == "float":
        return float_array(tensor)
    return base64.b64encode(to_bytes(tensor, embed_dtype, endianness)).decode("ascii")


def encode_bytes(tensors: list[torch.Tensor], embed_dtype: str, endianness: str) -> tuple[bytes, list[dict]]:
    chunks, items, offset = [], [], 0
    for i, t in enumerate(tensors):
        raw = to_bytes(t, embed_dtype, endianness)
        items.append(
            {
                "index": i,
                "embed_dtype": embed_dtype,
                "endianness": endianness,
                "start": offset,
                "end": offset + len(raw),
                "shape": list(t.shape),
            }
        )
        chunks.append(raw)
        offset += len(raw)
    return b"".join(chunks), items


def pack_bits(vectors: np.ndarray, kind: str) -> np.ndarray:
    """Cohere's binary / ubinary: one bit per dimension, set where the value is >= 0, 8 to a byte, most
    significant first (np.packbits; Cohere's docs unpack with np.unpackbits and map a bit b to 2b-1); ubinary is
    the byte (0..255), binary the byte minus 128 (-128..127). >= 0 as vLLM packs (sentence-transformers uses
    > 0): the two differ only for a value of exactly 0, which lies as near +1 as -1."""
    if vectors.shape[1] % 8:
        raise ValueError(f"embedding_types '{kind}' needs a dimension divisible by 8, not {vectors.shape[1]}")
    packed = np.packbits(vectors >= 0, axis=-1)
    return packed.astype(np.int16) - 128 if kind == "binary" else packed


def quantize(vectors: np.ndarray, kind: str) -> np.ndarray:
    """Cohere's int8 / uint8. Cohere publishes no rule, so polyvec's is per vector, from that vector alone (never
    from the rest of the batch): int8 = round(127 * x / max|x|), in -127..127 (a zero vector stays 0); uint8 =
    int8 + 128, in 1..255. The direction is kept (cosine to the float vector above 0.999 for sentence
    embeddings), the length is not: compare codes by cosine, or normalize them before a dot product."""
    peak = np.abs(vectors).max(axis=1, keepdims=True)
    scaled = np.divide(vectors * 127, peak, out=np.zeros_like(vectors), where=peak > 0)
    codes = np.rint(scaled)
    return (codes + 128).astype(np.uint8) if kind == "uint8" else codes.astype(np.int8)


def encode_by_type(tensors: list[torch.Tensor], kinds: list[str]) -> dict[str, Any]:
    """Cohere embed `embeddings`: for each requested type, one entry per input (numpy arrays of codes, which
    `VectorJSONResponse` writes as nested lists). float and base64 (of little-endian float32) take any shape;
    int8, uint8, binary and ubinary need one vector per input."""
    embeddings: dict[str, Any] = {}
    vectors: np.ndarray | None = None
    for kind in kinds:
        if kind in ("float", "base64"):
            embeddings[kind] = [encode_json(t, kind, "float32", "little") for t in tensors]
            continue
        if vectors is None:  # float64 holds every float32 / bfloat16 value exactly
            vectors = np.stack([t.detach().to(torch.float64).numpy() for t in tensors])
            if not np.isfinite(vectors).all():
                raise RuntimeError("the model output a NaN or infinite value, which cannot be quantized")
        embeddings[kind] = quantize(vectors, kind) if kind in ("int8", "uint8") else pack_bits(vectors, kind)
    return embeddings
