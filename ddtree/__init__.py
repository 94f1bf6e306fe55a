"""DDTree speculative decoding: a lossless draft-tree engine, with baselines ar and dflash."""

from ddtree.tree import DraftTree, build_tree
from ddtree.verify import AcceptResult, accept, ancestor_mask

__all__ = ["AcceptResult", "DraftTree", "accept", "ancestor_mask", "build_tree"]
__version__ = "0.1.0"
