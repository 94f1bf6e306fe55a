"""The Triton Mamba2 scan over a tree, and its commit, against the torch steps of `ddtree.models.mamba2`.

On CPU the kernels run in Triton's interpreter; with DDTREE_TEST_DEVICE=cuda the same tests run on the GPU.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("triton", reason="triton is not installed (it is in the dev extra)")

from ddtree.kernels.ssm_tree import commit_ssm_fused, tree_ssm_fused
from ddtree.models.mamba2 import ssm_commit, ssm_step, tree_ssm
from ddtree.models.recurrent import NodeInputs, commit_path
from tests.ddtree.kernels.test_gdn_tree import random_tree

DEVICE = torch.device(os.environ.get("DDTREE_TEST_DEVICE", "cpu"))


def random_scan(
    gen: torch.Generator, batch: int, n: int, heads: int, head_dim: int, size: int, dtype: torch.dtype
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, B, dt), C, the decay rates a, the skip D (in `dtype`, a in float32) and a committed state in the
    state's dtype (float32, float64 for float64), as a Mamba2 layer makes them."""
    x = torch.randn((batch, n, heads, head_dim), generator=gen).to(dtype)
    b = torch.randn((batch, n, heads, size), generator=gen).to(dtype)
    c = torch.randn((batch, n, heads, size), generator=gen).to(dtype)
    dt = (torch.rand((batch, n, heads), generator=gen) * 0.5 + 0.01).to(dtype)
    a = -torch.rand(heads, generator=gen) * 4
    d = torch.randn(heads, generator=gen).to(dtype)
    state = torch.randn((batch, heads, head_dim, size), generator=gen).to(torch.promote_types(dtype, torch.float32))
    return (x, b, dt), c, a, d, state


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    batch=st.integers(1, 3),
    n=st.integers(1, 20),
    heads=st.integers(1, 3),
    dims=st.sampled_from([(16, 16), (12, 20), (40, 8)]),  # not powers of two; head_dim over two blocks
)
def test_the_fused_tree_scan_equals_the_torch_steps(
    seed: int, batch: int, n: int, heads: int, dims: tuple[int, int]
) -> None:
    gen = torch.Generator().manual_seed(seed)
    parents, depths = random_tree(gen, batch, n, padding=seed % 3 if n > 3 else 0)
    steps, c, a, d, state = random_scan(gen, batch, n, heads, *dims, torch.float32)
    inputs = NodeInputs(torch.zeros((batch, n, 1)), steps)
    ref = tree_ssm(inputs, c, a, d, (parents, depths, int(depths.max())), state)
    moved = [t.to(DEVICE) for t in (*steps, c, a, d, parents, state)]
    out = tree_ssm_fused(tuple(moved[:3]), *moved[3:])
    assert out.shape == ref.shape and out.dtype == torch.float32
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-5, atol=1e-5)


def test_the_fused_scan_keeps_float64_states_in_float64() -> None:
    gen = torch.Generator().manual_seed(3)
    parents, depths = random_tree(gen, 2, 9, padding=1)
    steps, c, a, d, state = random_scan(gen, 2, 9, 2, 16, 16, torch.float64)
    ref = tree_ssm(NodeInputs(torch.zeros((2, 9, 1)), steps), c, a, d, (parents, depths, int(depths.max())), state)
    moved = [t.to(DEVICE) for t in (*steps, c, a, d, parents, state)]
    out = tree_ssm_fused(tuple(moved[:3]), *moved[3:])
    assert out.dtype == torch.float64
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-5, atol=1e-6)  # the decay in float32: its rounding only


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_fused_commit_equals_the_torch_commit(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    batch, n, heads, head_dim, size, kernel = 3, 11, 2, 40, 12, 4
    steps, _, a, _, state = random_scan(gen, batch, n, heads, head_dim, size, torch.float32)
    path = torch.stack([torch.randperm(n, generator=gen)[:5] for _ in range(batch)])  # [batch, 5]
    advance = torch.tensor([5, 0, 3])
    conv_in = torch.randn((batch, n, 6), generator=gen)
    conv = torch.randn((batch, 6, kernel - 1), generator=gen)
    states, convs = (state.clone(), state.clone().to(DEVICE)), (conv.clone(), conv.clone().to(DEVICE))
    commit_path(ssm_step(a), convs[0], states[0], NodeInputs(conv_in, steps), path, advance)
    on_device = NodeInputs(conv_in.to(DEVICE), tuple(t.to(DEVICE) for t in steps))
    a_on = a.to(DEVICE)
    commit_path(ssm_step(a_on), convs[1], states[1], on_device, path.to(DEVICE), advance.to(DEVICE), ssm_commit(a_on))
    torch.testing.assert_close(states[1].cpu(), states[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(convs[1].cpu(), convs[0])
    assert torch.equal(states[0][1], state[1])  # advance 0: untouched


def test_the_commit_refuses_a_strided_state() -> None:
    gen = torch.Generator().manual_seed(4)
    steps, _, a, _, _ = random_scan(gen, 2, 4, 2, 16, 16, torch.float32)
    wide = torch.zeros((2, 2, 16, 32))
    path, advance = torch.zeros((2, 1), dtype=torch.long), torch.ones(2, dtype=torch.long)
    with pytest.raises(ValueError, match="must be contiguous"):
        commit_ssm_fused(wide[..., :16], steps, path, advance, a)
