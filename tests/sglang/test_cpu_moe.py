"""The CPU stand-in for the shared expert's gate of SGLang's mixture-of-experts block (`ddtree.sglang.cpu_moe`):
alone (pure torch), and inside SGLang 0.5.23's own `Qwen2MoeSparseMoeBlock` as Qwen3-Next builds it, on the CPU,
against transformers' `Qwen3NextSparseMoeBlock` with the same weights (loaded through SGLang's weight loaders)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from ddtree.sglang.cpu_moe import gate_sigmoid_mul_add
from tests.sglang.support import requires_sglang

HIDDEN, EXPERTS, TOP_K, INTERMEDIATE = 64, 4, 2, 32


def test_the_stand_in_adds_the_gated_shared_expert_in_place() -> None:
    gen = torch.Generator().manual_seed(0)
    x, shared, routed = (torch.randn((5, HIDDEN), generator=gen) for _ in range(3))
    weight = torch.randn(HIDDEN, generator=gen) * 0.3
    expected = routed + torch.sigmoid(x @ weight)[:, None] * shared
    out = routed
    gate_sigmoid_mul_add(x, weight, shared, out)
    assert out is routed
    assert torch.allclose(out, expected, atol=1e-6)
    with pytest.raises(ValueError, match="one row"):
        gate_sigmoid_mul_add(x, weight[None], shared, out)


@pytest.fixture(scope="module")
def sglang_layers() -> Iterator[None]:
    """World-1 gloo process groups and a published topology, which SGLang's layers need to be built; torn down
    after, with the environment they were set up from."""
    from sglang.srt.distributed import parallel_state
    from sglang.srt.runtime_context import reset_context
    from sglang.test.layer_ut_utils import init_single_process_dist

    with pytest.MonkeyPatch.context() as env:
        for name, value in (("MASTER_ADDR", "127.0.0.1"), ("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
            env.setenv(name, value)
        init_single_process_dist(_free_port())
        try:
            yield
        finally:
            parallel_state.destroy_model_parallel()
            parallel_state.destroy_distributed_environment()
            reset_context()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _config(norm_topk_prob: bool) -> Any:
    from transformers import Qwen3NextConfig

    config = Qwen3NextConfig(
        hidden_size=HIDDEN,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        moe_intermediate_size=INTERMEDIATE,
        shared_expert_intermediate_size=INTERMEDIATE,
        norm_topk_prob=norm_topk_prob,
    )
    config._experts_implementation = "eager"
    return config


def _transformers_block(config: Any, seed: int) -> Any:
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock

    torch.manual_seed(seed)
    block = Qwen3NextSparseMoeBlock(config)
    for param in block.parameters():
        torch.nn.init.normal_(param, std=0.2)
    return block.eval()


def _load(ours: Any, theirs: Any) -> None:
    """`theirs`' weights into SGLang's block, split per expert and projection as a checkpoint holds them, through
    the loaders SGLang's Qwen3-Next `load_weights` calls."""
    shared, experts = ours.shared_expert, ours.experts
    ours.gate.weight.data.copy_(theirs.gate.weight)
    ours.shared_expert_gate.weight.data.copy_(theirs.shared_expert_gate.weight)
    shared.gate_up_proj.weight_loader(shared.gate_up_proj.weight, theirs.shared_expert.gate_proj.weight.data, 0)
    shared.gate_up_proj.weight_loader(shared.gate_up_proj.weight, theirs.shared_expert.up_proj.weight.data, 1)
    shared.down_proj.weight_loader(shared.down_proj.weight, theirs.shared_expert.down_proj.weight.data)
    for e in range(EXPERTS):
        gate, up = theirs.experts.gate_up_proj.data[e].chunk(2, dim=0)
        down = theirs.experts.down_proj.data[e]
        for shard, loaded, name in (("w1", gate, "w13_weight"), ("w3", up, "w13_weight"), ("w2", down, "w2_weight")):
            param = getattr(experts, name)
            experts.weight_loader(param, loaded.contiguous(), f"experts.{e}.{name}", shard_id=shard, expert_id=e)


@requires_sglang
@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_sglangs_qwen3_next_block_on_cpu_is_transformers(
    sglang_layers: None, monkeypatch: pytest.MonkeyPatch, norm_topk_prob: bool
) -> None:
    """Routing (softmax, top 2, renormalised or not as the config says), the SiLU-gated experts and the shared
    expert with its sigmoid gate: SGLang's block on the CPU, through the stand-in, is transformers'."""
    from sglang.srt.models import qwen2_moe
    from sglang.srt.models.qwen2_moe import Qwen2MoeSparseMoeBlock

    from ddtree.sglang import cpu_moe

    monkeypatch.setattr(qwen2_moe, "fused_gate_sigmoid_mul_add", qwen2_moe.fused_gate_sigmoid_mul_add)  # undone after
    cpu_moe.patch()
    config = _config(norm_topk_prob)
    theirs = _transformers_block(config, seed=int(norm_topk_prob))
    # as Qwen3-Next's decoder layers build it
    ours = Qwen2MoeSparseMoeBlock(
        layer_id=0, config=config, support_shared_expert_fusion=True, enable_cuda_shared_expert_fusion=True,
        reduce_results=False,
    )  # fmt: skip
    assert ours.shared_expert is not None and ours.num_fused_shared_experts == 0, "the shared expert runs apart"
    _load(ours, theirs)
    x = torch.randn((9, HIDDEN), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = theirs(x[None])[0]
        _, _, chosen = theirs.gate(x)
        got = ours(x.clone())
    assert set(chosen.flatten().tolist()) == set(range(EXPERTS)), "every expert is routed to"
    assert torch.allclose(got, expected, atol=1e-5), (got - expected).abs().max()
