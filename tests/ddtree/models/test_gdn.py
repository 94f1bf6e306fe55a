"""The gated delta-net over a tree (`ddtree.models.gdn`) against transformers' reference kernels run along
each node's own path: every node's output is the one a chain of its ancestors would give, and the commit
leaves the states of the accepted path's last node."""

from __future__ import annotations

import torch
from transformers.models.qwen3_next.modeling_qwen3_next import (
    causal_conv1d_update,
    torch_recurrent_gated_delta_rule,
)

from ddtree.models.gdn import delta_step, gdn_inputs, l2norm, tree_delta_rule
from ddtree.models.recurrent import NodeInputs, commit_path, tree_conv, tree_windows

# two requests' trees: parents, -1 for the root and padding (request 1's last slot is padding)
PARENTS = torch.tensor([[-1, 0, 0, 1, 3, 3, 2], [-1, 0, 1, 2, 3, 0, -1]])
DEPTHS = torch.tensor([[0, 1, 1, 2, 3, 3, 2], [0, 1, 2, 3, 4, 1, 0]])
HEADS, DK, DV, CHANNELS, KERNEL = 2, 4, 3, 5, 4


def _path(batch: int, node: int) -> list[int]:
    """The nodes from the root down to `node`."""
    path = [node]
    while PARENTS[batch, path[0]] >= 0:
        path.insert(0, int(PARENTS[batch, path[0]]))
    return path


def _inputs(gen: torch.Generator) -> tuple[torch.Tensor, NodeInputs, torch.Tensor]:
    batch, n = PARENTS.shape
    query = torch.randn(batch, n, HEADS, DK, generator=gen, dtype=torch.float64)
    inputs = gdn_inputs(
        conv_in=torch.randn(batch, n, CHANNELS, generator=gen, dtype=torch.float64),
        key=l2norm(torch.randn(batch, n, HEADS, DK, generator=gen, dtype=torch.float64)),
        value=torch.randn(batch, n, HEADS, DV, generator=gen, dtype=torch.float64),
        decay=-torch.rand(batch, n, HEADS, generator=gen, dtype=torch.float64),
        beta=torch.rand(batch, n, HEADS, generator=gen, dtype=torch.float64),
    )
    state = torch.randn(batch, HEADS, DK, DV, generator=gen, dtype=torch.float64)
    return query, inputs, state


def _reference(query: torch.Tensor, x: NodeInputs, state: torch.Tensor, b: int, path: list[int]) -> torch.Tensor:
    """transformers' token-by-token kernel along `path`: the last token's output `[heads, v_dim]`."""
    index = torch.tensor(path)
    key, value, decay, beta = (t[b, index][None] for t in x.steps)
    q = l2norm(query[b, index])[None]  # the kernel scales the query by 1/sqrt(k_dim)
    out, _ = torch_recurrent_gated_delta_rule(
        q, key, value, decay, beta, initial_state=state[b : b + 1].clone(), output_final_state=True
    )
    return out[0, -1]


def test_every_node_reads_the_state_of_its_own_path() -> None:
    query, inputs, state = _inputs(torch.Generator().manual_seed(0))
    normed = l2norm(query) / DK**0.5
    out = tree_delta_rule(normed, inputs, PARENTS, DEPTHS, state, max_depth=4)
    for b in range(PARENTS.shape[0]):
        for node in range(PARENTS.shape[1]):
            expected = _reference(query, inputs, state, b, _path(b, node))
            torch.testing.assert_close(out[b, node], expected, msg=f"request {b} node {node}")
    short = tree_delta_rule(normed, inputs, PARENTS, DEPTHS, state, max_depth=2)
    assert not torch.allclose(short[0, 4], out[0, 4]), "a depth past the bound is not stepped"


def test_each_node_convolves_its_ancestors_then_the_committed_inputs() -> None:
    gen = torch.Generator().manual_seed(1)
    _, inputs, _ = _inputs(gen)
    conv_state = torch.randn(2, CHANNELS, KERNEL - 1, generator=gen, dtype=torch.float64)
    weight = torch.randn(CHANNELS, KERNEL, generator=gen, dtype=torch.float64)
    out = tree_conv(inputs.conv_in, conv_state, weight, tree_windows(PARENTS, DEPTHS, KERNEL))
    for b in range(2):
        for node in range(PARENTS.shape[1]):
            running = conv_state[b : b + 1].clone()
            for step in _path(b, node):  # transformers' one-token update along the path
                last = causal_conv1d_update(inputs.conv_in[b, step][None, :, None], running, weight, None, "silu")
            torch.testing.assert_close(out[b, node], last[0, :, 0], msg=f"request {b} node {node}")


def test_the_commit_keeps_the_last_accepted_nodes_states() -> None:
    gen = torch.Generator().manual_seed(2)
    _, inputs, state = _inputs(gen)
    conv_state = torch.randn(2, CHANNELS, KERNEL - 1, generator=gen, dtype=torch.float64)
    path = torch.tensor([[0, 1, 3, 4, 4], [0, 1, 2, 2, 2]])  # padded by repeating the last node, as `accept` does
    advance = torch.tensor([4, 0])  # request 1 finished: nothing commits
    states, convs = state.clone(), conv_state.clone()
    commit_path(delta_step, convs, states, inputs, path, advance)
    expected = state[0:1].clone()
    for node in (0, 1, 3, 4):
        expected = _step(expected, *(t[0, node][None] for t in inputs.steps))
    torch.testing.assert_close(states[0], expected[0])
    torch.testing.assert_close(states[1], state[1])
    torch.testing.assert_close(convs[0], inputs.conv_in[0, [1, 3, 4]].T)
    torch.testing.assert_close(convs[1], conv_state[1])
    commit_path(delta_step, convs, states, inputs, path[:, :2], torch.tensor([1, 2]))
    torch.testing.assert_close(convs[1], torch.cat([conv_state[1][:, 2:], inputs.conv_in[1, [0, 1]].T], dim=1))


def _step(
    state: torch.Tensor, key: torch.Tensor, value: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor
) -> torch.Tensor:
    """The reference recurrence's one step (decay, read, correct), written out."""
    state = state * decay.exp()[..., None, None]
    delta = (value - (state * key[..., None]).sum(-2)) * beta[..., None]
    return state + key[..., None] * delta[..., None, :]
