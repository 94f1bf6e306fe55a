"""DDTree speculative decoding: a lossless draft-tree engine, with baselines ar and dflash.

The exports load on first use, so that torch-free modules (`ddtree.methods`) import without torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

__all__ = ["AcceptResult", "DraftTree", "accept", "ancestor_mask", "build_tree"]
__version__ = "0.1.0"

_HOMES = {
    "AcceptResult": "ddtree.accept",
    "accept": "ddtree.accept",
    "ancestor_mask": "ddtree.tree",
    "DraftTree": "ddtree.tree",
    "build_tree": "ddtree.tree",
}


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'ddtree' has no attribute {name!r}")
