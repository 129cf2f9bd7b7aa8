"""Evaluation helpers (retrieval quality on BEIR-style folders)."""
