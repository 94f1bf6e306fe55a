"""A CPU stand-in for `fused_gate_sigmoid_mul_add`, the one Triton kernel on the mixture-of-experts path of
SGLang 0.5.23's Qwen3-Next (and Qwen2-MoE, Qwen3.5-MoE) block on a CPU, for testing only.

Opt-in (DDTREE_SGLANG_CPU=1, through `ddtree.sglang.cpu`); on a GPU SGLang runs its own kernels and none of
this is imported. What `Qwen2MoeSparseMoeBlock.forward` (models/qwen2_moe.py) runs on a CPU without SGLang's CPU
engine (no AMX build of `sgl_kernel`), with no expert or data parallelism:

- the router `gate` (a torch linear) and `TopK`, whose dispatch falls back to `forward_native`: SGLang's torch
  `fused_topk_native` (softmax, the top k, renormalised when the config's `norm_topk_prob` says so);
- the routed experts: `FusedMoE` with `UnquantizedFusedMoEMethod`, whose dispatch falls back to `forward_native`
  (its `forward_cpu`), SGLang's torch `moe_forward_native` (SiLU-gated experts, weighted by the routing);
- the shared expert, separately (shared-expert fusion is CUDA or AITER only), a `Qwen2MoeMLP` whose `SiluAndMul`
  also falls back to torch;
- then its sigmoid gate, `sigmoid(x @ shared_expert_gate) * shared`, added to the routed output by
  `fused_gate_sigmoid_mul_add` (kernels/ops/elementwise/elementwise.py), a Triton kernel ("0 active drivers"
  with no GPU). The block imports it by name, so the stand-in is patched over `qwen2_moe`'s global.

`fused_gate_sigmoid_mul` (the same gate, out of place) is called only on the deferred-finalize (FlashInfer
TRTLLM) and dual-stream (CUDA graph capture) paths, which a CPU never takes: it is left alone.
"""

from __future__ import annotations

import torch


def gate_sigmoid_mul_add(
    hidden_states: torch.Tensor,
    gate_weight: torch.Tensor,
    shared_output: torch.Tensor,
    final_hidden_states: torch.Tensor,
) -> None:
    """Stand-in for `fused_gate_sigmoid_mul_add` (kernels/ops/elementwise/elementwise.py): add the shared
    expert's output `shared_output` `[tokens, hidden]`, scaled by each token's gate `sigmoid(hidden_states @
    gate_weight)` (`gate_weight` `[hidden]`), to `final_hidden_states` in place; in float32, as the kernel."""
    if gate_weight.shape != hidden_states.shape[-1:]:
        raise ValueError(f"the shared-expert gate is one row of {hidden_states.shape[-1]}, got {gate_weight.shape}")
    gate = torch.sigmoid(hidden_states.float() @ gate_weight.float())[:, None]
    final_hidden_states.copy_(final_hidden_states.float() + gate * shared_output.float())


def patch() -> None:
    """Patch the stand-in over the global `Qwen2MoeSparseMoeBlock.forward` looks it up by (Qwen3-Next's block)."""
    from sglang.srt.models import qwen2_moe

    qwen2_moe.fused_gate_sigmoid_mul_add = gate_sigmoid_mul_add
