"""A Markov head over a DFlash drafter: each depth's draft distribution conditioned on the token drafted at the
depth above.

A block drafter computes every depth in one pass, so depth d+1's distribution never saw the token a branch
chose at depth d. The head corrects it with a low-rank bigram over the target's input embeddings E:
the log-potential of child token c under parent token t is `(E[t] A) . (E[c] C)`, A and C `[hidden, rank]`
(`ddtree.tree.Transition`, which the tree build applies to each depth's candidates). It is small (2 x hidden
x rank numbers: 0.3 MB at rank 64 for a 576-wide target), trained on the drafter's own teacher-forced
candidates (`ddtree.train.markov`), and lives beside the drafter's weights as `markov_head.safetensors`. A
drafter without one builds the marginal tree.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from ddtree.errors import UserError
from ddtree.tree import Transition

HEAD_NAME = "markov_head.safetensors"


class MarkovHead(nn.Module):
    def __init__(self, hidden: int, rank: int) -> None:
        super().__init__()
        if hidden < 1 or rank < 1:
            raise ValueError(f"a Markov head needs a hidden size and rank >= 1, got {hidden} and {rank}")
        self.parent = nn.Parameter(torch.zeros(hidden, rank))  # [hidden, rank]: zero, the marginal tree
        self.child = nn.Parameter(torch.randn(hidden, rank) / hidden**0.5)  # [hidden, rank]

    @property
    def rank(self) -> int:
        return int(self.parent.shape[1])

    def transition(self, embeddings: torch.Tensor) -> Transition:
        """The tree build's correction for a target whose input embeddings are `embeddings` `[vocab, hidden]`:
        per token, its factors as a parent and as a child, `[vocab, rank]` float32 each."""
        e = embeddings.float()
        return Transition(e @ self.parent.float(), e @ self.child.float())


def save_head(head: MarkovHead, drafter_dir: str | Path) -> Path:
    """Write the head beside a drafter's weights; returns its path."""
    path = Path(drafter_dir) / HEAD_NAME
    state = {name: p.detach().float().cpu().contiguous() for name, p in head.named_parameters()}
    save_file(state, str(path), metadata={"format": "pt"})
    return path


def load_head(drafter_dir: str | Path, device: torch.device) -> MarkovHead | None:
    """A drafter directory's Markov head, or None where it has none; UserError naming the file where it is
    not one."""
    path = Path(drafter_dir) / HEAD_NAME
    if not path.is_file():
        return None
    try:
        state = load_file(str(path))
        parent, child = state["parent"], state["child"]
        if parent.dim() != 2 or parent.shape != child.shape:
            raise ValueError(f"parent {tuple(parent.shape)} and child {tuple(child.shape)} must be one [hidden, rank]")
    except (OSError, KeyError, ValueError, SafetensorError) as exc:
        raise UserError(f"cannot load the Markov head {str(path)!r}: {exc}") from exc
    head = MarkovHead(int(parent.shape[0]), int(parent.shape[1]))
    head.load_state_dict({"parent": parent, "child": child})
    return head.to(device).eval()
