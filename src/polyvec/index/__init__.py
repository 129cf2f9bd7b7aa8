"""Search over token vectors on a real multivector engine (Qdrant): `polyvec index` / `polyvec search` and
`Index` in Python. Needs `pip install 'polyvec[index]'`."""

from .config import IndexConfig
from .index import Index
from .qdrant import Hit

__all__ = ["Hit", "Index", "IndexConfig"]
