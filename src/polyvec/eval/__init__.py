"""Evaluation helpers (retrieval quality on BEIR-style folders)."""

from __future__ import annotations

import json
from typing import Any


def document_text(row: dict[str, Any]) -> str:
    """A BEIR corpus row as one text: title and text joined, as sentence-transformers' BEIR scripts do."""
    return " ".join(x for x in (row.get("title", ""), row.get("text", "")) if x).strip()


def titled_texts(titles: list[Any], texts: list[Any], text_column: str = "text") -> list[str]:
    """A table's title and text columns as BEIR's one text per row (`document_text`), as its JSONL reads: a
    null in one of them is an empty one; ValueError naming the row for a value that is not a string, or a row
    with neither."""
    for i, (title, text) in enumerate(zip(titles, texts)):
        for name, value in (("title", title), (text_column, text)):
            if value is not None and not isinstance(value, str):
                raise ValueError(f"row {i} has {type(value).__name__} {value!r:.40} in column {name!r}, not a string")
        if title is None and text is None:
            raise ValueError(f"row {i} has no title or text")
    return [document_text({"title": a or "", "text": b or ""}) for a, b in zip(titles, texts)]


def json_line(line: str, where: str) -> Any:
    """One JSONL line parsed; ValueError saying `where` it is ("line 4") when it is not JSON."""
    try:
        return json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where} is not valid JSON ({exc.msg}, column {exc.colno})") from None


def row_id(row: dict[str, Any]) -> str | None:
    """A JSONL row's id (`_id`, else `id`; a string or an integer), None when it has neither; ValueError when it
    is of another JSON type (null, a list, ...)."""
    key = "_id" if "_id" in row else "id" if "id" in row else None
    if key is None:
        return None
    value = row[key]
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        from ..entrypoints.server.errors import json_type  # the server's words for JSON types (on error only)

        raise ValueError(f"has {json_type(value)} in field {key!r}, not a string")
    return str(value)


def row_text(row: Any, text_column: str = "text") -> str:
    """The text of one JSONL corpus row, as `polyvec embed` reads it with or without --ray: BEIR's title and text
    joined, or the field `text_column`. ValueError when the row is not an object or that field holds no text."""
    if not isinstance(row, dict):
        raise ValueError("is not a JSON object")
    if text_column == "text" and "title" not in row and "text" not in row:  # an empty text for every row, silently
        raise ValueError("has no 'title' or 'text' field (give --text-column)")
    if text_column == "text":
        for name in ("title", "text"):
            value = row.get(name)
            if value is not None and not isinstance(value, str):
                from ..entrypoints.server.errors import json_type  # the server's words for JSON types (on error only)

                raise ValueError(f"has {json_type(value)} in field {name!r}, not a string")
        if not isinstance(row.get("title"), str) and not isinstance(row.get("text"), str):
            # a missing document, not an empty one: it would be a vector of the empty text, found by searches
            raise ValueError("has null in field 'text' and no title" if "text" in row else "has null in field 'title'")
        return _text(document_text(row))
    if not isinstance(row.get(text_column), str):
        raise ValueError(f"has no text in field {text_column!r}")
    return _text(row[text_column])


def _text(value: str) -> str:
    """A JSON string that is text: JSON can escape a lone surrogate (\\ud800), which no tokenizer reads."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"has a lone surrogate (U+{ord(value[exc.start]):04X}) at character {exc.start}, not text"
        ) from None
    return value
