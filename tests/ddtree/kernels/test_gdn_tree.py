"""The Triton gated delta rule over a tree, and its commit, against the torch steps of `ddtree.models`.

On CPU the kernels run in Triton's interpreter; with DDTREE_TEST_DEVICE=cuda the same tests run on the GPU.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("triton", reason="triton is not installed (it is in the dev extra)")

from ddtree.kernels.gdn_tree import branch_points, commit_delta_fused, tree_delta_rule_fused
from ddtree.models.gdn import commit_delta, delta_step, l2norm, tree_delta_rule
from ddtree.models.recurrent import NodeInputs, commit_path

DEVICE = torch.device(os.environ.get("DDTREE_TEST_DEVICE", "cpu"))


def random_tree(gen: torch.Generator, batch: int, n: int, padding: int) -> tuple[torch.Tensor, torch.Tensor]:
    """parents and depths `[batch, n]`: node 0 the root, each later node under a random earlier one, the last
    `padding` nodes padding (parent -1, depth 0)."""
    parents = torch.full((batch, n), -1, dtype=torch.long)
    depths = torch.zeros((batch, n), dtype=torch.long)
    for b in range(batch):
        for i in range(1, n - padding):
            parents[b, i] = int(torch.randint(0, i, (1,), generator=gen))
            depths[b, i] = depths[b, parents[b, i]] + 1
    return parents, depths


def random_inputs(
    gen: torch.Generator, batch: int, n: int, heads: int, k_dim: int, v_dim: int
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], torch.Tensor]:
    """query, (key, value, decay, beta) and a committed state, float32, as a GDN layer makes them."""
    query = l2norm(torch.randn((batch, n, heads, k_dim), generator=gen)) / k_dim**0.5
    key = l2norm(torch.randn((batch, n, heads, k_dim), generator=gen))
    value = torch.randn((batch, n, heads, v_dim), generator=gen)
    decay = -torch.rand((batch, n, heads), generator=gen)
    beta = torch.rand((batch, n, heads), generator=gen)
    state = torch.randn((batch, heads, k_dim, v_dim), generator=gen)
    return query, (key, value, decay, beta), state


def test_branch_points_are_the_nodes_a_later_node_returns_to() -> None:
    parents = torch.tensor([[-1, 0, 1, 0, 3, 1, 5], [-1, 0, 1, 2, 3, 4, 5], [-1, 0, 0, 1, 2, 3, -1]])
    expected = [[1, 1, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0, 0]]  # the chain needs none
    assert branch_points(parents).int().tolist() == expected


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    batch=st.integers(1, 3),
    n=st.integers(1, 20),
    heads=st.integers(1, 3),
    dims=st.sampled_from([(16, 16), (12, 20), (32, 48)]),  # not powers of two; values over two blocks
)
def test_the_fused_tree_rule_equals_the_torch_steps(
    seed: int, batch: int, n: int, heads: int, dims: tuple[int, int]
) -> None:
    gen = torch.Generator().manual_seed(seed)
    parents, depths = random_tree(gen, batch, n, padding=seed % 3 if n > 3 else 0)
    query, steps, state = random_inputs(gen, batch, n, heads, *dims)
    inputs = NodeInputs(torch.zeros((batch, n, 1)), steps)
    ref = tree_delta_rule(query, inputs, parents, depths, state, int(depths.max()))
    moved = [t.to(DEVICE) for t in (query, *steps, parents, state)]
    out = tree_delta_rule_fused(moved[0], tuple(moved[1:5]), moved[5], moved[6])
    assert out.shape == ref.shape and out.dtype == torch.float32
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-5, atol=1e-5)


def test_the_fused_rule_keeps_float64_states_in_float64() -> None:
    gen = torch.Generator().manual_seed(3)
    parents, depths = random_tree(gen, 2, 9, padding=1)
    query, steps, state = random_inputs(gen, 2, 9, 2, 16, 16)
    state = state.double()
    ref = tree_delta_rule(query, NodeInputs(torch.zeros((2, 9, 1)), steps), parents, depths, state, int(depths.max()))
    moved = [t.to(DEVICE) for t in (query, *steps, parents, state)]
    out = tree_delta_rule_fused(moved[0], tuple(moved[1:5]), moved[5], moved[6])
    assert out.dtype == torch.float64
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-6, atol=1e-6)  # float32 inputs: their rounding only


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_fused_commit_equals_the_torch_commit(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    batch, n, heads, k_dim, v_dim, kernel = 3, 11, 2, 12, 40, 4
    _, steps, state = random_inputs(gen, batch, n, heads, k_dim, v_dim)
    path = torch.stack([torch.randperm(n, generator=gen)[:5] for _ in range(batch)])  # [batch, 5]
    advance = torch.tensor([5, 0, 3])
    conv_in = torch.randn((batch, n, 6), generator=gen)
    conv = torch.randn((batch, 6, kernel - 1), generator=gen)
    states, convs = (state.clone(), state.clone().to(DEVICE)), (conv.clone(), conv.clone().to(DEVICE))
    commit_path(delta_step, convs[0], states[0], NodeInputs(conv_in, steps), path, advance)
    on_device = NodeInputs(conv_in.to(DEVICE), tuple(t.to(DEVICE) for t in steps))
    commit_path(delta_step, convs[1], states[1], on_device, path.to(DEVICE), advance.to(DEVICE), commit_delta)
    torch.testing.assert_close(states[1].cpu(), states[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(convs[1].cpu(), convs[0])
    assert torch.equal(states[0][1], state[1])  # advance 0: untouched


def test_the_commit_refuses_a_strided_state() -> None:
    gen = torch.Generator().manual_seed(4)
    _, steps, _ = random_inputs(gen, 2, 4, 2, 16, 16)
    wide = torch.zeros((2, 2, 16, 32))
    path, advance = torch.zeros((2, 1), dtype=torch.long), torch.ones(2, dtype=torch.long)
    with pytest.raises(ValueError, match="must be contiguous"):
        commit_delta_fused(wide[..., :16], steps, path, advance)  # it would write past each row's columns
