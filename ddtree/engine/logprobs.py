"""Log-probabilities of the emitted tokens, on their way from the target's logits to a request's output.

A token's log-probability is the log-softmax of the target's raw logits at the node where the target chose it:
before temperature, top-k or top-p (vLLM's default "raw" logprobs). The emitted tokens of a step are the
target's choices at the accepted path's nodes (an accepted draft is the choice at its parent, the bonus the
choice at the last node), so the values are computed at every node beside the choice (`node_logprobs`) and
gathered along the path (`path_columns`). They ride in the step's one readback as extra int64 columns:

    | chosen | alternative ids | alternative log-probs |
    | path   | path * k        | path * k              |

with the float values as their float64 bit patterns (exact), the alternatives the k = min(MAX_TOP_LOGPROBS,
vocab) most probable tokens, most probable first. `read_row` takes one row apart on the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from ddtree.settings import MAX_TOP_LOGPROBS


@dataclass(frozen=True)
class NodeLogprobs:
    """The target's log-probabilities at every node of a step (or at a prefill's last position)."""

    chosen: torch.Tensor  # [batch, nodes] of the token the target chose there
    ids: torch.Tensor  # [batch, nodes, k] the k most probable tokens, most probable first
    values: torch.Tensor  # [batch, nodes, k] their log-probabilities


@dataclass(frozen=True)
class LogprobLayout:
    """Where the log-probabilities sit in the readback columns `path_columns` makes."""

    nodes: int  # path slots per row
    alternatives: int  # k

    @property
    def columns(self) -> int:
        return self.nodes * (1 + 2 * self.alternatives)


def alternatives(vocab: int) -> int:
    """The alternatives computed per token for a vocabulary of `vocab` tokens (k)."""
    return min(MAX_TOP_LOGPROBS, vocab)


def node_logprobs(logits: torch.Tensor, choice: torch.Tensor) -> NodeLogprobs:
    """Log-softmax of `logits` `[batch, nodes, vocab]` (16-bit ones in float32) at `choice` `[batch, nodes]`,
    and the top `alternatives(vocab)` tokens."""
    x = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()
    total = torch.logsumexp(x, dim=-1, keepdim=True)  # [batch, nodes, 1]
    chosen = x.gather(-1, choice[..., None]) - total  # [batch, nodes, 1]
    top = x.topk(alternatives(x.shape[-1]), dim=-1)  # [batch, nodes, k], most probable first
    return NodeLogprobs(chosen.squeeze(-1), top.indices, top.values - total)


def path_columns(scores: NodeLogprobs, path: torch.Tensor) -> tuple[torch.Tensor, LogprobLayout]:
    """The readback columns `[batch, layout.columns]` int64 of the nodes on `path` `[batch, width]` (column j:
    the token emitted j-th in the step), and their layout."""
    batch, width = path.shape
    k = scores.ids.shape[-1]
    at = path[:, :, None].expand(-1, -1, k)  # [batch, width, k]
    parts = [
        _bits(scores.chosen.gather(1, path)),  # [batch, width]
        scores.ids.gather(1, at).reshape(batch, width * k),
        _bits(scores.values.gather(1, at)).reshape(batch, width * k),
    ]
    return torch.cat(parts, dim=1), LogprobLayout(width, k)


def _bits(values: torch.Tensor) -> torch.Tensor:
    """Float values as the int64 bit patterns of their float64 values (exact)."""
    return values.double().view(torch.int64)


def read_row(
    row: npt.NDArray[np.int64], layout: LogprobLayout, count: int, top: int
) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """The first `count` tokens' log-probabilities from a host row of `path_columns`, each with its `top` most
    probable alternatives (at most `layout.alternatives`): `(logprobs, alternatives)`."""
    n, k = layout.nodes, layout.alternatives
    chosen = row[:count].view(np.float64).tolist()
    ids = row[n : n + n * k].reshape(n, k)[:count, :top].tolist()
    values = row[n + n * k : n + 2 * n * k].reshape(n, k)[:count, :top].view(np.float64).tolist()
    return chosen, [list(zip(i, v, strict=True)) for i, v in zip(ids, values, strict=True)]
