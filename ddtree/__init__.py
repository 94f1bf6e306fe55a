"""DDTree speculative decoding: a lossless draft-tree engine, with baselines ar and dflash.

    pair = ddtree.load_pair()  # the Python API (`ddtree.api`): load_pair, Pair, Completion
    print(pair.generate("Write a haiku about trees.").text)

The exports load on first use, so that `import ddtree` and torch-free modules (`ddtree.methods`) import
without torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the real types for type checkers; at run time `__getattr__` imports them on first use
    from ddtree.accept import AcceptResult, accept
    from ddtree.api import Completion, Pair, load_pair
    from ddtree.tree import DraftTree, ancestor_mask, build_tree

__all__ = ["AcceptResult", "Completion", "DraftTree", "Pair", "accept", "ancestor_mask", "build_tree", "load_pair"]
__version__ = "0.1.0"

_HOMES = {
    "AcceptResult": "ddtree.accept",
    "accept": "ddtree.accept",
    "ancestor_mask": "ddtree.tree",
    "DraftTree": "ddtree.tree",
    "build_tree": "ddtree.tree",
    "Completion": "ddtree.api",
    "Pair": "ddtree.api",
    "load_pair": "ddtree.api",
}


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'ddtree' has no attribute {name!r}")
