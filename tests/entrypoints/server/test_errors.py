"""Bad input gets a 4xx JSON error naming the problem (the field, and the item where there is one), never a 5xx,
and the server keeps serving."""

from __future__ import annotations

import json
from typing import Any, NamedTuple

import httpx
import pytest

OK = {"input": "a good request"}
LONG = "turbulent boundary layer " * 4000  # ~100k characters
AUTH = {"Authorization": "Bearer sekret"}
UNCHECKED = "(param not checked)"


class Bad(NamedTuple):
    path: str
    body: Any
    """A JSON value (sent ASCII-escaped, so lone surrogates and NaN travel as JSON can spell them), raw bytes,
    or None for no body."""
    status: int
    words: str
    """What the error message must contain."""
    param: str | None = UNCHECKED
    method: str = "POST"
    headers: dict[str, str] | None = None
    strict: bool = False
    """Sent to strict_server (API key, truncation=error, max_model_len 64, 200 kB bodies) with its key."""


NOT_PROMPTS = "'input' must be a string, a list of strings, a list of token ids or a list of token-id lists, not"
TOO_DEEP = "the request body is nested too deeply"
NESTED = b"[" * 10_000 + b"]" * 10_000
FORM = "multipart/form-data; boundary=x"

CASES = [
    # /v1/embeddings: types and shapes of `input`
    Bad("/v1/embeddings", {"input": 5}, 400, f"{NOT_PROMPTS} a number", "input"),
    Bad("/v1/embeddings", {"input": None}, 400, f"{NOT_PROMPTS} null", "input"),
    Bad("/v1/embeddings", {"input": True}, 400, f"{NOT_PROMPTS} a boolean", "input"),
    Bad("/v1/embeddings", {"input": {"text": "x"}}, 400, f"{NOT_PROMPTS} an object", "input"),
    Bad("/v1/embeddings", b'{"input": NaN}', 400, f"{NOT_PROMPTS} a number", "input"),
    Bad("/v1/embeddings", {"input": ["a", 1]}, 400, "'input' item 1 is a number, not a string", "input"),
    Bad("/v1/embeddings", {"input": ["a", None]}, 400, "'input' item 1 is null, not a string", "input"),
    Bad("/v1/embeddings", {"input": [[101], "a"]}, 400, "'input' item 1 is a string, but item 0 is a list", "input"),
    Bad("/v1/embeddings", {"input": [[[101]]]}, 400, "'input' item 0 position 0 is an array, not a token id", "input"),
    Bad("/v1/embeddings", {"input": "x", "colour": "red"}, 400, "unknown field 'colour'", "colour"),
    Bad("/v1/embeddings", {}, 400, "field 'input' is required", "input"),
    # empty and zero-token inputs
    Bad("/v1/embeddings", {"input": []}, 400, "'input' must not be empty", "input"),
    Bad("/v1/embeddings", {"input": [[]]}, 400, "'input' item 0 is an empty list of token ids", "input"),
    Bad("/v1/embeddings", {"input": [[101], []]}, 400, "'input' item 1 is an empty list of token ids", "input"),
    Bad(
        "/v1/embeddings",
        {"input": ["ok", "\u200b"], "add_special_tokens": False},
        400,
        "'input' item 1 has no tokens after tokenization",
        "input",
    ),
    Bad(
        "/v1/embeddings",
        {"input": "\u0003", "add_special_tokens": False, "encoding_format": "base64"},
        400,
        "'input' item 0 has no tokens after tokenization",
        "input",
    ),
    Bad(
        "/pooling",
        {"input": ["\u200b"], "add_special_tokens": False, "task": "token_embed"},
        400,
        "'input' item 0 has no tokens after tokenization",
        "input",
    ),
    # token ids: booleans, negatives, fractions, out of the vocabulary
    Bad("/v1/embeddings", {"input": [True, False]}, 400, "'input' item 0 is a boolean, not a token id", "input"),
    Bad("/v1/embeddings", {"input": [101, True]}, 400, "'input' item 1 is a boolean, not a token id", "input"),
    Bad(
        "/v1/embeddings", {"input": [[101, 102], [101, False]]}, 400, "'input' item 1 position 1 is a boolean", "input"
    ),
    Bad("/v1/embeddings", {"input": [101, -5]}, 400, "'input' item 1 is negative, out of vocabulary", "input"),
    Bad("/v1/embeddings", {"input": [101, 1.5]}, 400, "'input' item 1 is a number with a fraction", "input"),
    Bad("/v1/embeddings", {"input": [101.0]}, 400, "'input' item 0 is a number with a fraction", "input"),
    Bad("/v1/embeddings", {"input": [101, 99999999]}, 400, "token ids must be integers in 0..30521", "input"),
    Bad("/v1/embeddings", {"input": [2**70]}, 400, "token ids must be integers in 0..30521", "input"),
    Bad("/pooling", {"input": [True], "task": "embed"}, 400, "'input' item 0 is a boolean, not a token id", "input"),
    Bad("/classify", {"input": [[False]]}, 400, "'input' item 0 position 0 is a boolean", "input"),
    # unicode: lone surrogates (escaped, or raw bytes decoded with surrogatepass), bad bytes, control characters
    Bad("/v1/embeddings", {"input": "\ud800"}, 400, "'input' is not valid UTF-8 text (lone surrogate)", "input"),
    Bad("/v1/embeddings", {"input": ["ok", "a\udfffb"]}, 400, "'input' item 1 is not valid UTF-8 text", "input"),
    Bad("/v1/embeddings", b'{"input": "\xed\xa0\x80"}', 400, "'input' is not valid UTF-8 text", "input"),
    Bad("/pooling", {"input": ["\udc00"], "task": "embed"}, 400, "'input' item 0 is not valid UTF-8 text", "input"),
    Bad("/v1/embeddings", {"input": "x", "\ud800": 1}, 400, "has a key that is not valid UTF-8 text"),
    # the response's id carries request_id (a 500 after the model ran); a literal's value is no key
    Bad("/v1/embeddings", {"input": "x", "request_id": "\ud800"}, 400, "'request_id' is not valid UTF-8", "request_id"),
    Bad("/rerank", {"query": "q", "documents": ["d"], "request_id": "a\ud800"}, 400, "'request_id'", "request_id"),
    Bad(
        "/v1/embeddings",
        {"input": "x", "encoding_format": "\ud800"},
        400,
        "field 'encoding_format' is not valid UTF-8 text (lone surrogate)",
        "encoding_format",
    ),  # fmt: skip
    Bad("/v1/embeddings", {"input": "x", "model": "\ud800"}, 404, "the model '\ud800' does not exist", "model"),
    Bad("/v1/embeddings", b'{"input": "\xff"}', 400, "not valid JSON (it must be UTF-8 encoded JSON)"),
    Bad("/v1/embeddings", b'\xff\xfe\x00{"input": "x"}', 400, "not valid JSON"),
    Bad("/v1/embeddings", b'{"input": "a\x01b"}', 400, "not valid JSON (Invalid control character"),
    # the body itself: empty, not an object, broken, nested, huge numbers, other content types
    Bad("/v1/embeddings", b"", 400, "the request body is empty"),
    Bad("/v1/embeddings", None, 400, "the request body is empty"),
    Bad("/v1/embeddings", b"null", 400, "the request body must be a JSON object, not null"),
    Bad("/v1/embeddings", b"[1, 2, 3]", 400, "the request body must be a JSON object, not an array"),
    Bad("/v1/embeddings", b'"input"', 400, "the request body must be a JSON object, not a string"),
    Bad("/v1/embeddings", b'{"input": [1, 2', 400, "not valid JSON"),
    Bad("/v1/embeddings", b'{"input": "x",}', 400, "not valid JSON"),
    Bad("/v1/embeddings", NESTED, 400, TOO_DEEP),
    Bad("/v1/embeddings", b'{"input": ' + NESTED + b"}", 400, TOO_DEEP),
    Bad("/tokenize", b'{"prompt": "x", "model": ' + b'{"a": ' * 10_000 + b"1" + b"}" * 10_001, 400, TOO_DEEP),
    Bad("/v1/embeddings", b'{"input": [' + b"9" * 5000 + b"]}", 400, "a number with too many digits"),
    Bad("/v1/embeddings", {"input": ["x"] * 5000}, 400, "the limit is 4096 per request", "input"),
    Bad(
        "/v1/embeddings",
        b"input=hello",
        400,
        "not valid JSON",
        headers={"content-type": "application/x-www-form-urlencoded"},
    ),
    Bad(
        "/v1/embeddings",
        b"--x\r\n\r\nhello\r\n--x--",
        400,
        "not valid JSON",
        headers={"content-type": FORM},
    ),
    # other fields: out-of-range numbers, wrong types, unknown values
    Bad("/v1/embeddings", {"input": "x", "dimensions": 0}, 400, "field 'dimensions'", "dimensions"),
    Bad("/v1/embeddings", {"input": "x", "dimensions": -1}, 400, "field 'dimensions'", "dimensions"),
    Bad("/v1/embeddings", {"input": "x", "dimensions": "big"}, 400, "field 'dimensions'", "dimensions"),
    Bad("/v1/embeddings", {"input": "x", "dimensions": 100}, 400, "dimensions=100 is not allowed"),
    Bad("/v1/embeddings", {"input": "x", "dimensions": 10**30}, 400, "is not allowed"),
    Bad("/v1/embeddings", {"input": "x", "truncate_prompt_tokens": 1000}, 400, "truncate_prompt_tokens=1000"),
    Bad("/v1/embeddings", {"input": "x", "truncate_prompt_tokens": -2}, 400, "field 'truncate_prompt_tokens'"),
    Bad("/v1/embeddings", {"input": "x", "priority": float("inf")}, 400, "field 'priority'", "priority"),
    Bad("/v1/embeddings", {"input": "x", "priority": 2**63}, 400, "field 'priority'", "priority"),
    Bad("/pooling", {"input": "x", "priority": None}, 400, "field 'priority'", "priority"),
    Bad(
        "/v1/embeddings",
        {"input": "x", "cache_salt": ""},
        400,
        "'cache_salt' must be 1 to 128 characters",
        "cache_salt",
    ),
    Bad("/v1/embeddings", {"input": "x", "cache_salt": "a/b"}, 400, "none of '@', '/'", "cache_salt"),
    Bad(
        "/v1/embeddings",
        {"input": "x", "encoding_format": "hex"},
        400,
        "invalid value \"hex\" for field 'encoding_format'",
    ),
    Bad("/v1/embeddings", {"input": "x", "encoding_format": None}, 400, "field 'encoding_format'"),
    Bad(
        "/v1/embeddings",
        {"input": "x", "embed_dtype": "int8"},
        400,
        "invalid value \"int8\" for field 'embed_dtype'",
        "embed_dtype",
    ),
    Bad("/v1/embeddings", {"input": "x", "endianness": "middle"}, 400, "field 'endianness'", "endianness"),
    Bad("/v1/embeddings", {"input": "x", "long_input": "slide"}, 400, "field 'long_input'", "long_input"),
    Bad("/v1/embeddings", {"input": "x", "window_overlap": -1}, 400, "field 'window_overlap'", "window_overlap"),
    Bad("/v1/embeddings", {"input": "x", "add_special_tokens": "maybe"}, 400, "field 'add_special_tokens'"),
    Bad("/v1/embeddings", {"input": "x", "user": 5}, 400, "field 'user'", "user"),
    Bad("/v1/embeddings", {"input": "x", "mm_processor_kwargs": 5}, 400, "field 'mm_processor_kwargs'"),
    Bad(
        "/v1/embeddings",
        {"input": "x", "input_type": "banana"},
        400,
        "Unsupported input_type 'banana'; allowed:",
        "input_type",
    ),
    Bad("/v1/embeddings", {"input": "x", "normalize": True, "use_activation": False}, 400, "conflicts"),
    Bad("/v1/embeddings", {"input": "x", "model": "gpt-4"}, 404, "the model 'gpt-4' does not exist", "model"),
    Bad("/v1/embeddings", {"input": "x", "a" * 500: 1}, 400, "unknown field 'aaaa"),
    Bad("/v1/embeddings", {"input": ["x", "word " * 100]}, 400, "'input' item 1 has 102 tokens", "input", strict=True),
    Bad("/v1/embeddings", {"input": LONG * 2}, 413, "larger than the limit of 200000 bytes", strict=True),
    # /pooling and /classify
    Bad("/pooling", {"input": "x", "task": "summarize"}, 400, "field 'task'", "task"),
    Bad("/pooling", {"input": "x", "task": "encode"}, 400, "`encode` task was removed; use `token_embed`", "task"),
    Bad("/pooling", {"input": "x", "task": "score"}, 400, "`score` task was removed; use `classify` instead.", "task"),
    Bad("/pooling", {"input": "x", "task": "classify"}, 400, "it supports: embed, token_embed"),
    Bad("/pooling", {"input": "x", "task": "embed", "activation": True}, 400, "activation is only valid"),
    Bad("/pooling", {"input": "x", "task": "embed", "softmax": True}, 400, "unknown field 'softmax'"),
    Bad("/pooling", {"input": "x", "task": "embed", "dimensions": 0}, 400, "field 'dimensions'"),
    Bad("/classify", {"input": "x"}, 400, "it supports: embed, token_embed"),
    Bad("/classify", {}, 400, "field 'input' is required", "input"),
    # /score and /rerank
    Bad("/score", {"text_1": "x"}, 400, "text_1 and text_2 are required", "text_2"),
    Bad("/score", {"documents": ["x"]}, 400, "queries/documents, queries/items", "queries"),
    Bad("/score", {"queries": "a", "documents": ["c"], "items": ["d"]}, 400, "queries/documents and items", "items"),
    Bad("/score", {"text_1": [], "text_2": "y"}, 400, "'text_1' must not be empty", "text_1"),
    Bad("/score", {"text_1": 5, "text_2": "y"}, 400, "'text_1' must be a string or a list of strings", "text_1"),
    Bad("/score", {"text_1": "x", "text_2": ["a", 5]}, 400, "'text_2' item 1 is a number, not a string", "text_2"),
    Bad("/score", {"text_1": "\ud800", "text_2": "y"}, 400, "'text_1' is not valid UTF-8 text", "text_1"),
    Bad("/v1/score", {"queries": "x", "documents": ["\ud800"]}, 400, "'documents' item 0 is not valid UTF-8"),
    Bad("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, 400, "text_1 has 2 items and text_2 has 3"),
    Bad("/score", {"text_1": "x", "text_2": "y", "use_activation": "yes please"}, 400, "field 'use_activation'"),
    Bad(
        "/score",
        {"text_1": "q", "text_2": ["short", "word " * 100]},
        400,
        "'text_2' item 1 has 102 tokens",
        "text_2",
        strict=True,
    ),
    Bad("/rerank", {"query": "q", "documents": []}, 400, "'documents' must not be empty", "documents"),
    Bad("/rerank", {"query": "q", "documents": ["a"], "top_n": -1}, 400, "field 'top_n'", "top_n"),
    Bad("/rerank", {"query": "q"}, 400, "field 'documents' is required", "documents"),
    Bad("/rerank", {"documents": ["a"]}, 400, "field 'query' is required", "query"),
    Bad("/rerank", {"query": "q", "documents": 7}, 400, "'documents' must be a list of strings"),
    Bad("/rerank", {"query": "q", "documents": ["a", None]}, 400, "'documents' item 1 is null", "documents"),
    Bad("/rerank", {"query": 5, "documents": ["a"]}, 400, "'query' must be a string, not a number", "query"),
    Bad("/rerank", {"query": "\ud800", "documents": ["a"]}, 400, "'query' is not valid UTF-8 text", "query"),
    Bad("/v1/rerank", {"query": "q", "documents": ["a"], "return_documents": "sure"}, 400, "'return_documents'"),
    Bad("/v2/rerank", {"query": "q", "documents": ["a"], "model": "nope"}, 404, "the model 'nope' does not exist"),
    Bad(
        "/rerank",
        {"query": "q", "documents": ["short", "word " * 100]},
        400,
        "'documents' item 1 has 102 tokens",
        "documents",
        strict=True,
    ),
    Bad("/rerank", {"query": "word " * 100, "documents": ["a"]}, 400, "'query' has 102 tokens", "query", strict=True),
    # /v2/embed
    Bad(
        "/v2/embed",
        {"texts": ["x"], "truncate": "MIDDLE"},
        400,
        "invalid value \"MIDDLE\" for field 'truncate'",
        "truncate",
    ),
    Bad("/v2/embed", {"texts": ["x"], "embedding_types": ["int4"]}, 400, "field 'embedding_types' item 0"),
    Bad("/v2/embed", {"texts": ["x"], "embedding_types": []}, 400, "field 'embedding_types'", "embedding_types"),
    Bad("/v2/embed", {}, 400, "one of 'texts' and 'inputs' is required", "texts"),
    Bad("/v2/embed", {"texts": ["x"], "inputs": [{"content": [{"type": "text", "text": "x"}]}]}, 400, "not both"),
    Bad("/v2/embed", {"images": ["data:image/png;base64,iVBO"]}, 400, "'images': images are not supported", "images"),
    Bad(
        "/v2/embed",
        {
            "inputs": [
                {"content": [{"type": "text", "text": "a cat"}]},
                {"content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBO"}}]},
            ]
        },
        400,
        "'inputs' item 1 content 0 is an image_url part; images are not supported yet",
        "inputs",
    ),
    Bad("/v2/embed", {"inputs": [{"content": []}]}, 400, "field 'inputs' item 0.content", "inputs"),
    Bad("/v2/embed", {"inputs": [{"content": [{"type": "audio"}]}]}, 400, "'inputs' item 0.content item 0", "inputs"),
    # the union's tag is not a field ("item 0.content item 0.text.text is required" before)
    Bad(
        "/v2/embed",
        {"inputs": [{"content": [{"type": "text"}]}]},
        400,
        "field 'inputs' item 0.content item 0.text is required",
        "inputs",
    ),  # fmt: skip
    Bad(
        "/v2/embed",
        {"inputs": [{"content": [{"type": "image_url", "image_url": {}}]}]},
        400,
        "field 'inputs' item 0.content item 0.image_url.url is required",
        "inputs",
    ),  # fmt: skip
    Bad("/v2/embed", {"inputs": [{"content": [{"type": "text", "text": "\ud800"}]}]}, 400, "is not valid UTF-8"),
    Bad("/v2/embed", {"texts": ["x"], "input_type": "image"}, 400, "images are not supported yet", "input_type"),
    Bad(
        "/v2/embed",
        {"texts": ["x"], "input_type": "poetry"},
        400,
        "Unsupported input_type 'poetry'; allowed:",
        "input_type",
    ),
    Bad("/v2/embed", {"texts": ["x"], "max_tokens": 257}, 400, "max_tokens=257 is more than", "max_tokens"),
    Bad(
        "/v2/embed",
        {"texts": ["x", "word " * 30], "truncate": "NONE", "max_tokens": 16},
        400,
        "'texts' item 1 has 32 tokens, more than max_tokens=16",
        "max_tokens",
    ),
    Bad("/v2/embed", {"texts": []}, 400, "'texts' must not be empty", "texts"),
    Bad("/v2/embed", {"texts": "x"}, 400, "'texts' must be a list of strings, not a string", "texts"),
    Bad("/v2/embed", {"texts": ["ok", "\ud800"]}, 400, "'texts' item 1 is not valid UTF-8 text", "texts"),
    Bad("/v2/embed", {"texts": ["x"], "output_dimension": 0}, 400, "field 'output_dimension'"),
    Bad("/v2/embed", {"texts": ["x"], "max_tokens": 0}, 400, "field 'max_tokens'", "max_tokens"),
    Bad("/v2/embed", {"texts": ["x", "word " * 300], "truncate": "NONE"}, 400, "'texts' item 1 has 302 tokens"),
    # /v1/embed
    Bad("/v1/embed", {"inputs": [{"content": [{"type": "text", "text": "x"}]}]}, 400, "unknown field 'inputs'"),
    Bad("/v1/embed", {"texts": ["x"], "max_tokens": 8}, 400, "unknown field 'max_tokens'", "max_tokens"),
    Bad("/v1/embed", {"input_type": "search_query"}, 400, "field 'texts' is required", "texts"),
    Bad("/v1/embed", {"texts": ["x"], "embedding_types": ["float", "int4"]}, 400, "'embedding_types' item 1"),
    # /tokenize and /detokenize
    Bad("/tokenize", {"prompt": "x", "text": "x"}, 400, "unknown field 'text'", "text"),
    Bad("/tokenize", {"text": "x"}, 400, "unknown field 'text'", "text"),
    Bad("/tokenize", {"add_special_tokens": True}, 400, "give either 'prompt' or 'messages'", "prompt"),
    Bad("/tokenize", {"prompt": "\ud800"}, 400, "'prompt' is not valid UTF-8 text (lone surrogate)", "prompt"),
    Bad("/tokenize", {"prompt": 5}, 400, "'prompt' must be a string, not a number", "prompt"),
    Bad("/tokenize", {"prompt": ["a"]}, 400, "'prompt' must be a string, not an array", "prompt"),
    Bad("/tokenize", {"prompt": "x", "model": "nope"}, 404, "the model 'nope' does not exist", "model"),
    Bad("/detokenize", {"tokens": [True]}, 400, "'tokens' item 0 is a boolean, not a token id", "tokens"),
    Bad("/detokenize", {"tokens": [7592, -1]}, 400, "'tokens' item 1 is negative", "tokens"),
    Bad("/detokenize", {"tokens": [1.5]}, 400, "'tokens' item 0 is a number with a fraction", "tokens"),
    Bad("/detokenize", {"tokens": "101"}, 400, "'tokens' must be a list of token ids, not a string", "tokens"),
    Bad("/detokenize", {"tokens": [99999999]}, 400, "outside the vocabulary", "tokens"),
    Bad("/detokenize", {}, 400, "field 'tokens' is required", "tokens"),
    # methods and routes
    Bad("/v1/embeddings", None, 405, "method GET not allowed here", method="GET"),
    Bad("/v1/embeddings", b"{}", 405, "method PUT not allowed here", method="PUT"),
    Bad("/pooling", None, 405, "method DELETE not allowed here", method="DELETE"),
    Bad("/health", b"{}", 405, "method POST not allowed here"),
    Bad("/v1/models", OK, 405, "method POST not allowed here"),
    Bad("/nowhere", {"input": "x"}, 404, "no route /nowhere"),
    Bad("/V1/EMBEDDINGS", {"input": "x"}, 404, "no route /V1/EMBEDDINGS"),
    Bad("/nowhere", None, 404, "no route /nowhere", method="GET"),
    # chat bodies: the renderer's own names, lone surrogates in messages
    Bad(
        "/v1/embeddings",
        {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"chat_template": "{{ 1 }}"}},
        400,
        "chat_template_kwargs cannot set chat_template",
        "chat_template_kwargs",
    ),  # fmt: skip
    Bad(
        "/tokenize",
        {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"messages": []}},
        400,
        "chat_template_kwargs cannot set messages",
        "chat_template_kwargs",
    ),  # fmt: skip
    Bad(
        "/tokenize",
        {"messages": [{"role": "user", "content": "\ud800"}]},
        400,
        "messages item 0 is not valid UTF-8 text (lone surrogate)",
        "messages",
    ),  # fmt: skip
    Bad(
        "/v1/embeddings",
        {
            "messages": [
                {"role": "user", "content": "ok"},
                {"role": "user", "content": [{"type": "text", "text": "\udfff"}]},
            ]
        },
        400,
        "messages item 1 is not valid UTF-8 text",
        "messages",
    ),  # fmt: skip
    # options that would do nothing, sides that contradict each other
    Bad(
        "/score",
        {"text_1": "hi", "text_2": "x", "queries": "a", "documents": ["b"]},
        400,
        "give one pair of sides: text_1/text_2 and queries, documents were both given",
        "queries",
    ),  # fmt: skip
    Bad(
        "/score",
        {"text_1": "hi", "text_2": "x", "data_1": "zzz"},
        400,
        "text_1/text_2 and data_1 were both given",
        "data_1",
    ),  # fmt: skip
    Bad(
        "/pooling",
        {"input": "hi", "task": ["embed", "token_embed"], "sparse_top_k": 3},
        400,
        "sparse_top_k applies to embed_sparse, which is not among ['embed', 'token_embed']",
        "sparse_top_k",
    ),  # fmt: skip
    Bad(
        "/pooling",
        {"input": "hi", "task": ["embed"], "return_tokens": True},
        400,
        "return_tokens applies to embed_sparse",
        "return_tokens",
    ),  # fmt: skip
    Bad("/v1/embeddings", {"input": "hi", "dimensions": 100}, 400, "dimensions", "dimensions"),
    # the option the body gave, and the body's task, named (param was sparse_top_k, or null)
    Bad(
        "/pooling", {"input": "a", "return_tokens": True}, 400, "return_tokens applies to embed_sparse", "return_tokens"
    ),  # fmt: skip
    Bad(
        "/pooling",
        {"input": "a", "sparse_threshold": 0.5},
        400,
        "sparse_threshold applies to embed_sparse",
        "sparse_threshold",
    ),  # fmt: skip
    Bad("/pooling", {"input": "a", "task": ["embed", "embed"]}, 400, "without repeats", "task"),
    Bad("/pooling", {"input": "a", "task": "classify"}, 400, "Unsupported task: 'classify'", "task"),
    Bad(
        "/score",
        {"text_1": ["a", "b"], "text_2": ["x", "y", "z"]},
        400,
        "text_1 has 2 items and text_2 has 3",
        "text_2",
    ),  # fmt: skip
    # the sides by the names the body gives them (they were text_1 and text_2 whatever the body said)
    Bad(
        "/score",
        {"queries": ["a", "b"], "documents": ["x", "y", "z"]},
        400,
        "queries has 2 items and documents has 3",
        "documents",
    ),  # fmt: skip
    # SageMaker: the error of the request shape the body means (it said only "Cannot find suitable handler")
    Bad("/invocations", {"input": [True, False]}, 400, "'input' item 0 is a boolean, not a token id", "input"),
    Bad("/invocations", {"query": "q", "documents": 3.5}, 400, "documents", "documents"),
    Bad("/invocations", {"input": "x", "task": "bogus"}, 400, "invalid value \"bogus\" for field 'task'", "task"),
    Bad(
        "/detokenize", {"tokens": [101, 7592, 30522]}, 400, "'tokens' item 2 is 30522, outside the vocabulary", "tokens"
    ),
    Bad(
        "/v2/embed",
        {"texts": ["x"], "input_type": "search_query", "output_dimension": 256},
        400,
        "output_dimension=256 is not allowed",
        "output_dimension",
    ),
    Bad(
        "/pooling",
        {"input": ["x", "word " * 100], "task": ["embed", "token_embed"], "long_input": "window"},
        400,
        "'input' item 1 has 102 tokens, more than max_model_len: several tasks from one pass",
        "input",
        strict=True,
    ),
    # API keys
    Bad("/v1/embeddings", OK, 401, "missing or invalid API key", headers={"Authorization": ""}, strict=True),
    Bad("/v1/embeddings", OK, 401, "missing or invalid API key", headers={"Authorization": "Bearer x"}, strict=True),
    Bad("/pooling", OK, 401, "missing or invalid API key", headers={"Authorization": "sekret"}, strict=True),
    Bad("/rerank", OK, 401, "missing or invalid API key", headers={"Authorization": "Basic c2Vrcmv0"}, strict=True),
    Bad("/tokenize", OK, 401, "missing or invalid API key", headers={"Authorization": "Bearer"}, strict=True),
    Bad(
        "/v1/models", None, 401, "missing or invalid API key", method="GET", headers={"Authorization": ""}, strict=True
    ),
    Bad("/nowhere", OK, 401, "missing or invalid API key", headers={"Authorization": "Bearer sekret2"}, strict=True),
]


def _send(server, case: Bad) -> httpx.Response:
    headers = {"content-type": "application/json", **(AUTH if case.strict else {}), **(case.headers or {})}
    headers = {k: v for k, v in headers.items() if v}  # an empty value: leave the header out
    content = case.body if case.body is None or isinstance(case.body, bytes) else json.dumps(case.body).encode()
    return httpx.request(case.method, server.url + case.path, content=content, headers=headers, timeout=120)


def test_the_table_is_large_and_distinct():
    assert len(CASES) >= 80
    assert len({(c.method, c.path, repr(c.body), tuple((c.headers or {}).items())) for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[f"{c.method}{c.path}-{i}" for i, c in enumerate(CASES)])
def test_bad_input(request, case: Bad):
    server = request.getfixturevalue("strict_server" if case.strict else "server")
    r = _send(server, case)
    assert r.status_code == case.status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert case.words in err["message"], err
    assert err["code"] == case.status and err["type"] and "Traceback" not in r.text
    if case.param != UNCHECKED:
        assert err["param"] == case.param, err
    good = server.post("/v1/embeddings", OK, headers=AUTH if case.strict else None)
    assert good.status_code == 200 and len(good.json()["data"][0]["embedding"]) == 384


# Bodies whose parse differs between JSON decoders: a UTF-8 BOM, NaN, a number past float range, and broken ones.
PARSE_EDGES = [
    b'\xef\xbb\xbf{"%s": "a good request"}',
    b'{"%s": "a good request", "dimensions": NaN}',
    b'{"%s": "a good request", "dimensions": 1e400}',
    b'{"%s": "a good request", "dimensions": -Infinity}',
    b'{"%s": "a good',
    b'{"%s": "\xff"}',
    b"",
    NESTED,
]


@pytest.mark.parametrize("body", PARSE_EDGES, ids=range(len(PARSE_EDGES)))
@pytest.mark.parametrize(
    ("route", "field", "same_as"), [("/invocations", "input", "/v1/embeddings"), ("/", "inputs", "/embed")]
)
def test_routes_that_pick_their_shape_parse_as_the_others(server, body: bytes, route: str, field: str, same_as: str):
    """/invocations and TEI's / read the body themselves; they answer every body as the route they stand for."""
    content = body.replace(b"%s", field.encode())
    headers = {"content-type": "application/json"}
    mine, theirs = (
        httpx.post(server.url + path, content=content, headers=headers, timeout=60) for path in (route, same_as)
    )
    assert mine.status_code == theirs.status_code, (mine.text, theirs.text)
    if mine.status_code == 200:
        assert mine.json() == theirs.json() or route == "/invocations"  # /invocations' ids and times differ
        assert mine.json()["data"][0]["embedding"] if route == "/invocations" else mine.json()[0]
    else:
        assert mine.json() == theirs.json()


def test_empty_and_blank_strings_are_inputs(server, minilm_llm):
    """As in sentence-transformers and vLLM: an empty string embeds its special tokens; one blank item does not
    fail the batch."""
    r = server.post("/v1/embeddings", {"input": ["", "a real sentence", "   "]})
    assert r.status_code == 200, r.text
    got = [item["embedding"] for item in r.json()["data"]]
    ref = [o.outputs.embedding for o in minilm_llm.embed(["", "a real sentence", "   "], use_tqdm=False)]
    for a, b in zip(got, ref):
        assert sum(x * y for x, y in zip(a, b)) > 0.9999
    assert r.json()["usage"]["prompt_tokens"] == 2 + 5 + 2


def test_long_input_is_truncated_by_default(server):
    r = server.post("/v1/embeddings", {"input": LONG})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 256


def test_wrong_method_says_which_are_allowed(server):
    r = server.get("/v1/embeddings")
    assert r.status_code == 405 and r.json()["error"]["code"] == 405
    assert r.headers["allow"] == "POST"
    r = server.post("/health")
    assert r.status_code == 405 and "GET" in r.headers["allow"].split(", ")


def test_api_key(strict_server):
    s = strict_server
    assert s.get("/health").status_code == 200  # open even with a key
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
        r = s.post("/v1/embeddings", {"input": "x"}, headers=headers)
        assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
    assert s.get("/v1/models").status_code == 401 and s.get("/tokenize").status_code == 401
    # Prometheus scrapes /metrics without a key, as on vLLM; a CORS preflight carries none
    assert s.get("/metrics").status_code == 200 and "vllm:prompt_tokens_total" in s.get("/metrics").text
    assert httpx.options(s.url + "/v1/embeddings").status_code != 401
    ok = s.post("/v1/embeddings", {"input": "x"}, headers={"Authorization": "Bearer sekret"})
    assert ok.status_code == 200
    # a request refused before routing is counted under its route, not as "unmatched"
    assert 'polyvec_requests_total{endpoint="/v1/models",status="401"}' in s.get("/metrics").text


def test_several_api_keys_and_vllms_variable(monkeypatch):
    """vLLM's `--api-key` takes several keys and falls back to VLLM_API_KEY (it was ignored: no auth at all)."""
    import asyncio

    from polyvec.entrypoints.cli import build_parser, server_options
    from polyvec.entrypoints.server.app import ServerConfig, ServerMiddleware
    from polyvec.entrypoints.server.metrics import ServerMetrics

    monkeypatch.delenv("POLYVEC_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    assert server_options(build_parser().parse_args(["serve", "m"]))["api_key"] == ["from-env"]
    args = build_parser().parse_args(["serve", "m", "--api-key", "k1", "k2"])
    assert args.model == "m" and server_options(args)["api_key"] == ["k1", "k2"]

    async def ok(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    app = ServerMiddleware(ok, ServerConfig(api_key=["k1", "k2"]), ServerMetrics(lambda: 0, lambda: 0))

    async def statuses() -> list[int]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            keys = ("k1", "k2", "k3", "")
            return [
                (await client.get("/v1/models", headers={"Authorization": f"Bearer {k}"})).status_code for k in keys
            ]

    assert asyncio.run(statuses()) == [200, 200, 401, 401]


def test_truncation_error_mode_and_body_limit(strict_server):
    s, auth = strict_server, {"Authorization": "Bearer sekret"}
    r = s.post("/v1/embeddings", {"input": ["short", "word " * 100]}, headers=auth)
    assert r.status_code == 400
    assert "'input' item 1 has 102 tokens, more than the maximum input length of 64" in r.json()["error"]["message"]
    cut = s.post("/v1/embeddings", {"input": "word " * 100, "truncate_prompt_tokens": 32}, headers=auth)
    assert cut.status_code == 200 and cut.json()["usage"]["prompt_tokens"] == 32
    # a request's own long_input="truncate" cuts as its truncate_prompt_tokens does (as its "window" splits)
    asked = s.post("/v1/embeddings", {"input": ["short", "word " * 100], "long_input": "truncate"}, headers=auth)
    assert asked.status_code == 200 and asked.json()["usage"]["prompt_tokens"] == 3 + 64, asked.text
    same = s.post("/v1/embeddings", {"input": "word " * 100, "truncate_prompt_tokens": 64}, headers=auth).json()
    assert asked.json()["data"][1]["embedding"] == same["data"][0]["embedding"]
    big = s.post("/v1/embeddings", {"input": LONG * 2}, headers=auth)
    assert big.status_code == 413 and "larger than the limit of 200000 bytes" in big.json()["error"]["message"]
    assert s.post("/v1/embeddings", {"input": "still fine"}, headers=auth).status_code == 200


def test_a_list_of_one_task_is_keyed_by_task(server):
    """`task: ["embed"]` answers as any list of tasks does (a 500 before), with the vector of `task: "embed"`."""
    one = server.post("/pooling", {"input": "wing flutter", "task": ["embed"]})
    assert one.status_code == 200, one.text
    item = one.json()["data"][0]
    want = server.post("/pooling", {"input": "wing flutter", "task": "embed"}).json()["data"][0]["data"]
    assert set(item["data"]) == {"embed"} and item["data"]["embed"] == pytest.approx(want, abs=1e-6)


def test_score_and_rerank_honour_add_special_tokens(server):
    """add_special_tokens false reaches the engine on /score and /rerank as on /classify (it was dropped)."""
    body = {"text_1": "wing flutter", "text_2": ["heat transfer", "boundary layers"]}
    with_special = server.post("/score", body).json()
    without = server.post("/score", {**body, "add_special_tokens": False}).json()
    assert without["usage"]["prompt_tokens"] == with_special["usage"]["prompt_tokens"] - 2 * 3
    assert without["data"][0]["score"] != pytest.approx(with_special["data"][0]["score"], abs=1e-4)
    ranked = {"query": "wing flutter", "documents": ["heat transfer", "boundary layers"]}
    r0, r1 = (
        server.post("/rerank", ranked).json(),
        server.post("/rerank", {**ranked, "add_special_tokens": False}).json(),
    )
    assert r1["usage"]["prompt_tokens"] == r0["usage"]["prompt_tokens"] - 2 * 3


def test_openapi_lists_what_ping_answers(server):
    """POST /ping passes the body checks like every POST: its 408, 413 and 429 are documented."""
    doc = server.get("/openapi.json").json()
    assert {"408", "413", "429"} <= set(doc["paths"]["/ping"]["post"]["responses"])


def test_a_chat_template_that_raises_is_a_400(minilm_llm):
    """A request's chat_template_kwargs may set a template's variables (bos_token); one of another type made a
    template's `bos_token + ...` raise TypeError: a 500 with a logged traceback. A request's own template
    (--trust-request-chat-template) dividing by zero likewise. The template and its inputs are the client's,
    as vLLM answers them: 400."""
    from .conftest import in_process_server

    config = {"chat_template": "{{ bos_token + messages[0]['content'] }}", "trust_request_chat_template": True}
    messages = [{"role": "user", "content": "hi"}]
    with in_process_server(minilm_llm.engine, warmup=False, **config) as url:
        for path, body in (
            ("/v1/embeddings", {"messages": messages, "chat_template_kwargs": {"bos_token": 1}}),
            ("/tokenize", {"messages": messages, "chat_template_kwargs": {"bos_token": None}}),
            ("/tokenize", {"messages": messages, "chat_template": "{{ 1 / 0 }}"}),
            # a filter's own error (dictsort of a list: AttributeError) too
            ("/tokenize", {"messages": messages, "chat_template": "{% for k, v in opts|dictsort %}{% endfor %}",
                           "chat_template_kwargs": {"opts": [1, 2]}}),
        ):  # fmt: skip
            r = httpx.post(url + path, json=body)
            assert r.status_code == 400 and "the chat template failed" in r.json()["error"]["message"], r.text
        ok = httpx.post(url + "/tokenize", json={"messages": messages, "chat_template_kwargs": {"bos_token": "<s>"}})
        assert ok.status_code == 200, ok.text


def test_an_api_key_beyond_ascii_is_read_as_clients_send_it(minilm_llm):
    """Clients send a header's bytes as UTF-8; the key was compared with their Latin-1 reading, so a key such
    as 'clé' never authenticated (and '密钥' could not)."""
    from .conftest import in_process_server

    with in_process_server(minilm_llm.engine, warmup=False, api_key=["clé", "密钥"]) as url:
        for key in ("clé", "密钥"):
            headers = {"Authorization": b"Bearer " + key.encode("utf-8")}
            assert httpx.get(url + "/v1/models", headers=headers).status_code == 200, key
        assert httpx.get(url + "/v1/models", headers={"Authorization": b"Bearer cl\xe9"}).status_code == 401


def test_a_chat_template_renders_off_the_event_loop(minilm_llm):
    """Templates rendered on the event loop: a request's slow template (--trust-request-chat-template) held
    every other request, /health included, for as long as it ran. They render in a worker thread now."""
    import threading
    import time

    from .conftest import in_process_server

    slow = "{% for i in range(100000) %}{% for j in range(400) %}{% endfor %}{% endfor %}x"
    body = {"messages": [{"role": "user", "content": "hi"}], "chat_template": slow}
    with in_process_server(minilm_llm.engine, warmup=False, trust_request_chat_template=True) as url:
        done: dict[str, float] = {}

        def render() -> None:
            start = time.monotonic()
            assert httpx.post(url + "/tokenize", json=body, timeout=120).status_code == 200
            done["render"] = time.monotonic() - start

        thread = threading.Thread(target=render)
        thread.start()
        time.sleep(0.3)
        start = time.monotonic()
        assert httpx.get(url + "/health", timeout=120).status_code == 200
        health = time.monotonic() - start
        thread.join()
    assert done["render"] > 1.0 and health < done["render"] / 3, (health, done)
