"""The CPU stand-ins for SGLang's GDN kernels (`ddtree.sglang.cpu_gdn`; pure torch, run without SGLang) against
references that walk each node's path from the root explicitly, and Qwen3-Next's projection split and gated norm
against transformers' Qwen3-Next."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from ddtree.models.gdn import delta_step, l2norm
from ddtree.models.tiny import tiny_hybrid_config
from ddtree.sglang.cpu_gdn import conv_update, fused_gated_rms_norm, gating_rule_update, qkvzba_split, tree_parents
from ddtree.sglang.tree_step import draft_tree, tree_links
from tests.sglang.support import requires_sglang

# A tree in our order (parents before children, siblings by rank) and a padding node (-1) at the end.
PARENTS = [-1, 0, 0, 1, 1, 3, 2, -1]


def _links(parents: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    p = torch.tensor(parents)
    return (p, *tree_links(p))


def _path(parents: list[int], node: int) -> list[int]:
    """Root first, `node` last; a padding node hangs from the root, as SGLang's kernels place it."""
    path = [node]
    while path[-1] != 0:
        parent = parents[path[-1]]
        path.append(0 if parent < 0 else parent)
    return path[::-1]


@pytest.mark.parametrize(("seed", "topk"), [(0, None), (1, 2), (2, 1), (3, 3)])
def test_parents_from_our_links_are_the_trees(seed: int, topk: int | None) -> None:
    logits = torch.randn((3, 5, 6), generator=torch.Generator().manual_seed(seed)) * 3
    parents = draft_tree(logits, 12, topk).parents  # top-k 1: a chain padded to the budget
    got = tree_parents(*tree_links(parents))
    assert torch.equal(got[:, 1:], parents[:, 1:].clamp(min=0))


def test_tree_convolution_reads_each_nodes_ancestors_then_the_committed_inputs() -> None:
    gen = torch.Generator().manual_seed(0)
    kernel, channels, n = 4, 3, len(PARENTS)
    parents, first, sibling = _links([PARENTS, [-1, 0, 1, 2, 3, 4, 5, 6]])  # a tree and a chain
    pool = torch.randn((4, channels, kernel - 1), generator=gen)
    committed = pool.clone()
    x = torch.randn((2, channels, n), generator=gen)
    weight, bias = torch.randn((channels, kernel), generator=gen), torch.randn(channels, generator=gen)
    scratch = torch.zeros((3, n, channels, kernel - 1))
    found = torch.full((2, n), -7, dtype=torch.int32)
    slots = torch.tensor([2, 0])
    out = conv_update(
        x, pool, weight, bias, "silu", conv_state_indices=slots, intermediate_conv_window=scratch,
        intermediate_state_indices=torch.tensor([1, 0]), retrieve_next_token=first, retrieve_next_sibling=sibling,
        retrieve_parent_token=found,
    )  # fmt: skip
    for b, (slot, row) in enumerate([(2, 1), (0, 0)]):
        tree = parents[b].tolist()
        for i in range(n):
            inputs = [committed[slot, :, j] for j in range(kernel - 1)] + [x[b, :, j] for j in _path(tree, i)]
            window = torch.stack(inputs[-kernel:], dim=1)  # [channels, kernel], oldest first
            assert torch.allclose(out[b, :, i], F.silu((window * weight).sum(dim=1) + bias), atol=1e-6)
            assert torch.allclose(scratch[row, i], window[:, 1:])
        assert found[b, 1:].tolist() == [max(p, 0) for p in tree[1:]]
        assert torch.equal(pool[slot], x[b, :, -(kernel - 1) :]), "the verify leaves the last inputs, as SGLang's"
    assert torch.equal(pool[[1, 3]], committed[[1, 3]])


def test_tree_delta_rule_starts_each_node_from_its_parents_state() -> None:
    gen = torch.Generator().manual_seed(1)
    n, k_heads, v_heads, k_dim, v_dim = len(PARENTS), 1, 2, 4, 3
    _, first, sibling = _links([PARENTS, PARENTS])
    found = torch.zeros((2, n), dtype=torch.int32)
    conv_update(torch.zeros((2, 1, n)), torch.zeros((2, 1, 3)), torch.zeros((1, 4)), None, "silu",
                retrieve_next_token=first, retrieve_next_sibling=sibling, retrieve_parent_token=found)  # fmt: skip
    q, k = (torch.randn((1, 2 * n, k_heads, k_dim), generator=gen) for _ in range(2))
    v = torch.randn((1, 2 * n, v_heads, v_dim), generator=gen)
    a, b = (torch.randn((2 * n, v_heads), generator=gen) for _ in range(2))
    a_log, dt_bias = torch.randn(v_heads, generator=gen), torch.randn(v_heads, generator=gen)
    pool = torch.randn((3, v_heads, v_dim, k_dim), generator=gen)  # SGLang's layout
    committed = pool.clone()
    scratch = torch.zeros((2, n, v_heads, v_dim, k_dim))
    out = gating_rule_update(
        a_log, a, dt_bias, 1.0, 20.0, q, k, v, b, pool, torch.tensor([2, 0]), use_qk_l2norm_in_kernel=True,
        cu_seqlens=torch.tensor([0, n, 2 * n]), disable_state_update=True, intermediate_states_buffer=scratch,
        intermediate_state_indices=torch.tensor([0, 1]), cache_steps=n, retrieve_parent_token=found,
    )  # fmt: skip
    assert torch.equal(pool, committed), "a verify leaves the committed states alone"
    decay = -a_log.exp() * F.softplus(a + dt_bias)
    for req, slot in enumerate([2, 0]):
        for i in range(n):
            state = committed[slot].transpose(-1, -2)
            for node in _path(PARENTS, i):
                t = req * n + node
                key = l2norm(k[0, t]).repeat_interleave(2, dim=0)
                state = delta_step(state, key, v[0, t], decay[t], torch.sigmoid(b[t]))
            query = l2norm(q[0, req * n + i]).repeat_interleave(2, dim=0) * k_dim**-0.5
            assert torch.allclose(out[0, req * n + i], (state * query[..., None]).sum(dim=-2), atol=1e-5)
            assert torch.allclose(scratch[req, i], state.transpose(-1, -2), atol=1e-5)


def test_qwen3_next_projection_split_is_transformers() -> None:
    """`fused_qkvzba_split_reshape_cat`'s stand-in against transformers' Qwen3-Next layer's own split (two key
    heads of four value heads each, so each key head's group holds two)."""
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    config = tiny_hybrid_config("qwen3_next", 10)
    layer = Qwen3NextGatedDeltaNet(config, layer_idx=0)
    heads = (layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim)
    assert heads[1] // heads[0] > 1
    gen = torch.Generator().manual_seed(2)
    qkvz = torch.randn((5, layer.in_proj_qkvz.out_features), generator=gen)
    ba = torch.randn((5, layer.in_proj_ba.out_features), generator=gen)
    mixed_qkv, z, b, a = qkvzba_split(qkvz, ba, *heads)
    query, key, value, z_ref, b_ref, a_ref = layer.fix_query_key_value_ordering(qkvz[None], ba[None])
    qkv_ref = torch.cat([t.reshape(1, 5, -1) for t in (query, key, value)], dim=-1)[0]
    assert torch.equal(mixed_qkv, qkv_ref)
    assert torch.equal(z, z_ref[0]) and torch.equal(b, b_ref[0]) and torch.equal(a, a_ref[0])


@requires_sglang
def test_qwen3_next_gated_norm_is_transformers() -> None:
    """`rms_norm_gated`'s stand-in (`FusedRMSNormGated`, Qwen3-Next's GDN output norm) against transformers'."""
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNormGated

    gen = torch.Generator().manual_seed(3)
    norm = Qwen3NextRMSNormGated(8, eps=1e-6)
    norm.weight.data = torch.randn(8, generator=gen)
    x, gate = torch.randn((6, 8), generator=gen), torch.randn((3, 2, 8), generator=gen)
    got = fused_gated_rms_norm(x, gate, norm.weight, None, "silu", eps=1e-6)
    assert torch.allclose(got, norm(x, gate.reshape(6, 8)), atol=1e-6)
    with pytest.raises(NotImplementedError, match="residual"):
        fused_gated_rms_norm(x, gate, norm.weight, None, "silu", residual=x)
