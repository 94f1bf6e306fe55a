"""Observability for speculative decoding: hooks, names, and (when enabled) exporters."""
