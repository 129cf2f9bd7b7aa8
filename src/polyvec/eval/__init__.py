"""Evaluation helpers (retrieval quality on BEIR-style folders)."""

from __future__ import annotations

from typing import Any


def document_text(row: dict[str, Any]) -> str:
    """A BEIR corpus row as one text: title and text joined, as sentence-transformers' BEIR scripts do."""
    return " ".join(x for x in (row.get("title", ""), row.get("text", "")) if x).strip()
