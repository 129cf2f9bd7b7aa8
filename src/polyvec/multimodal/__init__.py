"""Image inputs: decoding and checking them (`image.py`) and each model family's pixel preprocessing."""
