"""The Python API (being written)."""
