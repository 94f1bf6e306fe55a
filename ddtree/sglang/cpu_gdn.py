"""CPU stand-ins for the Triton kernels on a gated-delta-net (GDN) target's path in SGLang 0.5.23.

Opt-in (DDTREE_SGLANG_CPU=1, through `ddtree.sglang.cpu`), for testing only: on a GPU SGLang runs its own
kernels and none of this is imported. Each function here is a torch stand-in with the signature of the SGLang
function it replaces (named in its docstring), patched over the global that SGLang's module looks it up by.
The per-token arithmetic is our own (`ddtree.models.gdn`, `ddtree.models.recurrent`); what they reproduce of
SGLang's kernels is the layout and the side effects the rest of SGLang relies on:

- a verify's convolution and recurrent steps read each node's parent (from the first-child / next-sibling
  links, as SGLang's tree kernels do; with no links, the previous token), store every node's convolution
  window and recurrent state in the per-request scratch (`intermediate_*`), and overwrite the committed
  convolution window with the last inputs of the flattened batch, as SGLang's kernel does: the commit after
  the verify (`scatter_after_verify`) must restore it from the accepted node's scratch;
- recurrent states are laid out `[slot, v_heads, v_dim, k_dim]` (SGLang's), where ours are
  `[..., v_heads, k_dim, v_dim]`.

They loop over requests and tokens in Python: tiny models only.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch.nn import functional as F

from ddtree.models.gdn import delta_step, l2norm
from ddtree.models.recurrent import chain_conv, tree_conv, tree_windows

PAD_SLOT_ID = -1  # SGLang's padding slot in cache indices
SILU = ("silu", "swish")


def _check_silu(activation: Any) -> None:
    if activation not in SILU and activation is not True:
        raise NotImplementedError(f"the CPU convolution stand-in applies SiLU only, got activation={activation!r}")


def conv_prefill(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens_cpu: list[int],
    cache_indices: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    activation: str | None = "silu",
    **unused: Any,
) -> torch.Tensor:
    """Stand-in for `causal_conv1d_fn` (kernels/ops/mamba/causal_conv1d_triton.py): the prefill convolution of
    each sequence of `x` `[channels, tokens]` (concatenated), from its slot of `conv_states`
    `[slots, channels, kernel - 1]` when `has_initial_state`, which then holds the sequence's last inputs."""
    _check_silu(activation)
    out = torch.empty_like(x)
    starts = [int(s) for s in query_start_loc.tolist()]
    for i, (start, end) in enumerate(itertools.pairwise(starts)):
        slot = int(cache_indices[i]) if cache_indices is not None else i
        if slot == PAD_SLOT_ID or end == start:
            continue
        state = conv_states[slot : slot + 1]  # a view: chain_conv updates it in place
        if has_initial_state is not None and not bool(has_initial_state[i]):
            state.zero_()
        lengths = torch.tensor([end - start], device=x.device)
        out[:, start:end] = chain_conv(x[None, :, start:end].transpose(1, 2), lengths, state, weight, bias)[0].T
    return out


def tree_parents(next_token: torch.Tensor, next_sibling: torch.Tensor) -> torch.Tensor:
    """`[bs, n]` each node's parent from first-child / next-sibling links (-1: none), as SGLang's tree
    convolution derives them: a node's first child and its next sibling come after it, and a node no link
    reaches (padding) gets parent 0, the root."""
    bs, n = next_token.shape
    parents = torch.zeros((bs, n), dtype=torch.long, device=next_token.device)
    rows = torch.arange(bs, device=next_token.device)
    for i in range(n):
        child, sibling = next_token[:, i].long(), next_sibling[:, i].long()
        has_child, has_sibling = child >= 0, sibling >= 0
        parents[rows[has_child], child[has_child]] = i
        parents[rows[has_sibling], sibling[has_sibling]] = parents[rows[has_sibling], i]
    return parents


def _depths(parents: torch.Tensor) -> torch.Tensor:
    """`[bs, n]` depth of each node below the root (node 0), from `parents` (each smaller than its node)."""
    depths = torch.zeros_like(parents)
    for i in range(1, parents.shape[1]):
        depths[:, i] = depths.gather(1, parents[:, i : i + 1]).squeeze(1) + 1
    return depths


def _verify_parents(bs: int, n: int, links: tuple[Any, Any], device: torch.device) -> torch.Tensor:
    """Parents `[bs, n]` (-1 for the root): the tree's from `links`, or a chain's when there are none."""
    next_token, next_sibling = links
    if next_token is None:
        return (torch.arange(n, device=device) - 1).expand(bs, n).clone()
    parents = tree_parents(next_token[:, :n], next_sibling[:, :n])
    parents[:, 0] = -1
    return parents


def conv_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: Any = None,
    cache_seqlens: torch.Tensor | None = None,
    conv_state_indices: torch.Tensor | None = None,
    num_accept_tokens: torch.Tensor | None = None,
    intermediate_conv_window: torch.Tensor | None = None,
    intermediate_state_indices: torch.Tensor | None = None,
    retrieve_next_token: torch.Tensor | None = None,
    retrieve_next_sibling: torch.Tensor | None = None,
    retrieve_parent_token: torch.Tensor | None = None,
    pad_slot_id: int = PAD_SLOT_ID,
    **unused: Any,
) -> torch.Tensor:
    """Stand-in for `causal_conv1d_update` (kernels/ops/mamba/causal_conv1d_triton.py): a decode step
    (`x` `[bs, channels]`) or a verify (`[bs, channels, n]`, a tree when the links are given, else a chain)
    from each request's slot of `conv_state` `[slots, channels, kernel - 1]`. A verify stores every node's
    window in `intermediate_conv_window` `[rows, steps, channels, kernel - 1]` and the tree's parents in
    `retrieve_parent_token`."""
    _check_silu(activation)
    if cache_seqlens is not None or num_accept_tokens is not None:
        raise NotImplementedError("the CPU convolution stand-in has no circular buffer (cache_seqlens)")
    single = x.dim() == 2
    tokens = x[..., None] if single else x  # [bs, channels, n]
    bs, _, n = tokens.shape
    kernel = weight.shape[-1]
    slots = conv_state_indices.long() if conv_state_indices is not None else torch.arange(bs, device=x.device)
    live = (slots != pad_slot_id).nonzero().flatten()
    parents = _verify_parents(bs, n, (retrieve_next_token, retrieve_next_sibling), x.device)
    if retrieve_parent_token is not None:
        retrieve_parent_token[:, :n] = parents.clamp(min=0).to(retrieve_parent_token.dtype)
    windows = tree_windows(parents, _depths(parents.clamp(min=0)), kernel)  # [bs, n, kernel]
    conv_in = tokens.transpose(1, 2)  # [bs, n, channels]
    state = conv_state[slots[live]]  # [live, channels, kernel - 1]
    out = torch.zeros_like(conv_in)
    out[live] = tree_conv(conv_in[live], state, weight, windows[live], bias)
    table = torch.cat([state.transpose(1, 2), conv_in[live].to(state.dtype)], dim=1)  # [live, K-1+n, channels]
    if intermediate_conv_window is not None:
        rows = intermediate_state_indices.long()[live] if intermediate_state_indices is not None else live
        kept = windows[live, :, 1:].reshape(len(live), -1)  # each node's last K-1 inputs, oldest first
        picked = table.gather(1, kept[:, :, None].expand(-1, -1, table.shape[2]))
        intermediate_conv_window[rows, :n] = picked.view(len(live), n, kernel - 1, -1).transpose(2, 3)
    conv_state[slots[live]] = table[:, -(kernel - 1) :].transpose(1, 2)  # as SGLang's kernel leaves it
    result = out.transpose(1, 2)
    return result[..., 0] if single else result


def gdn_gating(
    A_log: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    dt_bias: torch.Tensor,
    beta: float = 1.0,
    threshold: float = 20.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stand-in for `fused_gdn_gating` (kernels/ops/attention/linear/fused_gdn_gating.py): the decay
    `-exp(A_log) * softplus(a + dt_bias)` and `sigmoid(b)`, each `[1, tokens, heads]` float32."""
    decay = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float(), beta=beta, threshold=threshold)
    return decay[None], torch.sigmoid(b.float()).to(b.dtype).float()[None]


def _sequence(
    state: torch.Tensor, inputs: tuple[torch.Tensor, ...], parents: list[int], store_dtype: torch.dtype | None
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One sequence's gated delta rule: token t starts from its parent's state (`state` for a root, parent
    -1). `inputs`: query and key (normed, the query scaled) `[t, v_heads, k_dim]`, value `[t, v_heads,
    v_dim]`, decay and beta `[t, v_heads]`. States are ours (`[v_heads, k_dim, v_dim]`), kept in `store_dtype`
    when a scratch buffer holds them. Returns the outputs `[t, v_heads, v_dim]` and every token's state."""
    query, key, value, decay, beta = inputs
    states: list[torch.Tensor] = []
    outs = []
    for t, parent in enumerate(parents):
        before = state if parent < 0 else states[parent]
        after = delta_step(before, key[t], value[t], decay[t], beta[t])
        outs.append((after * query[t][..., None]).sum(dim=-2))
        states.append(after.to(store_dtype).float() if store_dtype is not None else after)
    return torch.stack(outs), states


def _heads(q: torch.Tensor, k: torch.Tensor, v_heads: int, scale: float, l2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Query and key `[tokens, heads, k_dim]` repeated to the value heads, normed, the query scaled."""
    q, k = (x.float().repeat_interleave(v_heads // x.shape[1], dim=1) for x in (q, k))
    if l2:
        q, k = l2norm(q), l2norm(k)
    return q * scale, k


def chunk_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    initial_state_indices: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    head_first: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    inplace_update: bool = True,
) -> tuple[torch.Tensor, None, None]:
    """Stand-in for `chunk_gated_delta_rule` (kernels/ops/attention/fla/chunk.py), the prefill: each sequence
    of `q`, `k` `[1, tokens, heads, k_dim]`, `v` `[1, tokens, v_heads, v_dim]`, `g`, `beta` `[1, tokens,
    v_heads]`, from and (in place) back to its slot of `initial_state` `[slots, v_heads, v_dim, k_dim]`."""
    if head_first or initial_state is None or cu_seqlens is None or not inplace_update:
        raise NotImplementedError("the CPU chunk stand-in takes SGLang's varlen prefill with in-place states only")
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    v_heads = v.shape[2]
    query, key = _heads(q[0], k[0], v_heads, scale, use_qk_l2norm_in_kernel)
    out = torch.zeros((1, *v.shape[1:]), dtype=q.dtype, device=q.device)
    starts = [int(s) for s in cu_seqlens.tolist()]
    for i, (start, end) in enumerate(itertools.pairwise(starts)):
        slot = int(initial_state_indices[i]) if initial_state_indices is not None else i
        span = slice(start, end)
        inputs = (query[span], key[span], v[0, span].float(), g[0, span].float(), beta[0, span].float())
        state = initial_state[slot].float().transpose(-1, -2)
        outs, states = _sequence(state, inputs, list(range(-1, end - start - 1)), None)
        out[0, span] = outs.to(q.dtype)
        if states:
            initial_state[slot] = states[-1].transpose(-1, -2).to(initial_state.dtype)
    return out, None, None


def _step_inputs(
    args: dict[str, torch.Tensor], span: slice, scale: float, l2: bool, softplus: tuple[float, float]
) -> tuple[torch.Tensor, ...]:
    """One sequence's inputs to `_sequence` from the recurrent update's arguments (gates made here)."""
    v = args["v"][0, span].float()
    query, key = _heads(args["q"][0, span], args["k"][0, span], v.shape[1], scale, l2)
    decay, beta = gdn_gating(args["A_log"], args["a"][span], args["b"][span], args["dt_bias"], *softplus)
    return query, key, v, decay[0], beta[0]


def gating_rule_update(
    A_log: torch.Tensor,
    a: torch.Tensor,
    dt_bias: torch.Tensor,
    softplus_beta: float,
    softplus_threshold: float,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    b: torch.Tensor,
    initial_state_source: torch.Tensor,
    initial_state_indices: torch.Tensor,
    scale: float | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    is_kda: bool = False,
    lower_bound: float | None = None,
    disable_state_update: bool = False,
    intermediate_states_buffer: torch.Tensor | None = None,
    intermediate_state_indices: torch.Tensor | None = None,
    cache_steps: int | None = None,
    retrieve_parent_token: torch.Tensor | None = None,
    cache_ring: bool = False,
    **unused: Any,
) -> torch.Tensor:
    """Stand-in for `fused_sigmoid_gating_delta_rule_update` (kernels/ops/attention/linear/
    fused_sigmoid_gating_recurrent.py), GDN only: decode steps, or a verify that keeps every token's state in
    `intermediate_states_buffer` `[rows, steps, v_heads, v_dim, k_dim]` and, given `retrieve_parent_token`
    `[bs, n]`, starts each token from its parent's. Returns `[1, tokens, v_heads, v_dim]`."""
    if is_kda or lower_bound is not None or cache_ring or cu_seqlens is None:
        raise NotImplementedError("the CPU recurrent stand-in covers GDN's varlen decode and verify only")
    softplus = (softplus_beta, softplus_threshold)
    args = {"q": q, "k": k, "v": v, "a": a, "b": b, "A_log": A_log, "dt_bias": dt_bias}
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    out = torch.zeros((1, *v.shape[1:]), dtype=q.dtype, device=q.device)
    buffer = intermediate_states_buffer if intermediate_state_indices is not None else None
    starts = [int(s) for s in cu_seqlens.tolist()]
    for i, (start, end) in enumerate(itertools.pairwise(starts)):
        slot = int(initial_state_indices[i])
        row = (
            int(intermediate_state_indices[i]) if buffer is not None and intermediate_state_indices is not None else -1
        )
        parents = list(range(-1, end - start - 1))
        if retrieve_parent_token is not None and row >= 0:  # a tree: a token starts from its parent's state
            parents = [-1, *(int(p) for p in retrieve_parent_token[i, 1 : end - start].tolist())]
        inputs = _step_inputs(args, slice(start, end), scale, use_qk_l2norm_in_kernel, softplus)
        states = _update_sequence(out[0, start:end], inputs, parents, initial_state_source, slot, buffer, row)
        if not disable_state_update and slot >= 0 and states:
            initial_state_source[slot] = states[-1].transpose(-1, -2).to(initial_state_source.dtype)
    return out


def _update_sequence(
    out: torch.Tensor,
    inputs: tuple[torch.Tensor, ...],
    parents: list[int],
    pool: torch.Tensor,
    slot: int,
    buffer: torch.Tensor | None,
    row: int,
) -> list[torch.Tensor]:
    """One sequence of `gating_rule_update`: from slot `slot` of `pool` (zeros for a padding slot), outputs
    into `out` `[tokens, v_heads, v_dim]` and every token's state into row `row` of `buffer` (when >= 0)."""
    state = torch.zeros(pool.shape[1:], dtype=torch.float32, device=pool.device).transpose(-1, -2)
    if slot >= 0:
        state = pool[slot].float().transpose(-1, -2)
    store = buffer.dtype if buffer is not None and row >= 0 else None
    outs, states = _sequence(state, inputs, parents, store)
    out.copy_(outs.to(out.dtype))
    if buffer is not None and row >= 0:
        buffer[row, : len(states)] = torch.stack(states).transpose(-1, -2).to(buffer.dtype)
    return states


def scatter_after_verify(
    mamba_caches: Any,
    state_indices_tensor: torch.Tensor,
    last_correct_step_indices: torch.Tensor,
    mamba_track_indices: torch.Tensor | None,
    mamba_steps_to_track: torch.Tensor | None,
    src_indices_raw: torch.Tensor | None = None,
) -> None:
    """Stand-in for `scatter_mamba_states_after_mtp_verify` (kernels/ops/mamba/mamba_state_scatter_triton.py):
    each request's state and convolution window after its step `last_correct_step_indices` (from the
    verify's scratch) become its committed ones (and its tracking slot's, when tracked), through the torch
    path of SGLang's own `HybridLinearAttnBackend._scatter_speculative_state_with_mask`."""
    from sglang.srt.layers.attention.hybrid_linear_attn_backend import HybridLinearAttnBackend

    scatter = HybridLinearAttnBackend._scatter_speculative_state_with_mask
    pairs = [(mamba_caches.temporal, mamba_caches.intermediate_ssm)]
    pairs += list(zip(mamba_caches.conv, mamba_caches.intermediate_conv_window, strict=True))
    for committed, scratch in pairs:
        scatter(committed, scratch, state_indices_tensor, last_correct_step_indices, src_indices_raw)
        if mamba_track_indices is not None and mamba_steps_to_track is not None:
            scatter(committed, scratch, mamba_track_indices, mamba_steps_to_track, src_indices_raw)


def gated_rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    z: torch.Tensor | None = None,
    eps: float = 1e-6,
    group_size: int | None = None,
    norm_before_gate: bool = True,
    is_rms_norm: bool = False,
    activation: str = "swish",
) -> torch.Tensor:
    """Stand-in for `layernorm_fn` (kernels/ops/attention/fla/layernorm_gated.py) in its RMS form with a SiLU
    gate: SGLang's own torch reference, `rms_norm_ref`, of the same module."""
    from sglang.kernels.ops.attention.fla.layernorm_gated import rms_norm_ref

    if not is_rms_norm or activation not in SILU:
        raise NotImplementedError(
            f"the CPU gated-norm stand-in is the RMS norm with a SiLU gate, got is_rms_norm={is_rms_norm}, "
            f"activation={activation!r}"
        )
    out: torch.Tensor = rms_norm_ref(x, weight, bias, z, eps, group_size, norm_before_gate)
    return out


def sigmoid_mul(
    attn_output: torch.Tensor, gate: torch.Tensor, inplace: bool = False, quant: bool = False
) -> torch.Tensor:
    """Stand-in for `fused_sigmoid_mul` (kernels/ops/elementwise/elementwise.py): `attn_output * sigmoid(gate)`,
    `gate` flat or `[tokens, heads, head_dim]` against `attn_output` `[tokens, heads * head_dim]`."""
    if quant:
        raise NotImplementedError("the CPU sigmoid-mul stand-in does not quantize")
    product = attn_output * torch.sigmoid(gate.reshape(attn_output.shape).to(attn_output.dtype))
    return attn_output.copy_(product) if inplace else product


def fused_gated_rms_norm(
    x: torch.Tensor,
    g: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str = "swish",
    residual: torch.Tensor | None = None,
    prenorm: bool = False,
    residual_in_fp32: bool = False,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Stand-in for `rms_norm_gated` (kernels/ops/attention/fla/fused_norm_gate.py), which Qwen3-Next's
    `FusedRMSNormGated` calls: the RMS norm of `x` over its last dimension, times `weight`, times SiLU of the
    gate `g` (of `x`'s size), as `gated_rms_norm`."""
    if residual is not None or prenorm:
        raise NotImplementedError("the CPU fused gated-norm stand-in takes no residual")
    return gated_rms_norm(x, weight, bias, g.reshape(x.shape), eps, is_rms_norm=True, activation=activation)


def qkvzba_split(
    mixed_qkvz: torch.Tensor,
    mixed_ba: torch.Tensor,
    num_heads_qk: int,
    num_heads_v: int,
    head_qk: int,
    head_v: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stand-in for `fused_qkvzba_split_reshape_cat` (kernels/ops/attention/triton_gdn_fused_proj.py), Qwen3-Next's
    projection split: `mixed_qkvz` `[tokens, qk_heads * (q, k, v, z)]` and `mixed_ba` `[tokens, qk_heads * (b, a)]`,
    each key head's group holding its `num_heads_v // num_heads_qk` value heads, to the convolution's input
    `[tokens, (all q, all k, all v)]`, `z` `[tokens, v_heads, head_v]`, and `b`, `a` `[tokens, v_heads]`."""
    tokens, group = mixed_qkvz.shape[0], num_heads_v // num_heads_qk
    qkvz = mixed_qkvz.view(tokens, num_heads_qk, -1)
    q, k, v, z = torch.split(qkvz, [head_qk, head_qk, group * head_v, group * head_v], dim=-1)
    b, a = torch.split(mixed_ba.view(tokens, num_heads_qk, 2 * group), [group, group], dim=-1)
    mixed_qkv = torch.cat([part.reshape(tokens, -1) for part in (q, k, v)], dim=-1)
    z = z.reshape(tokens, num_heads_v, head_v).contiguous()
    return mixed_qkv, z, b.reshape(tokens, num_heads_v).contiguous(), a.reshape(tokens, num_heads_v).contiguous()


class TorchOnCpu:
    """`torch` for Qwen3-Next's model module, except that `get_device_module()` with no device is `torch.cpu`:
    `Qwen3GatedDeltaNet.__init__` (models/qwen3_next.py) builds its gated norm on
    `torch.get_device_module().current_device()`, which is CUDA's in a CUDA build of torch, and fails there with
    no GPU."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def get_device_module(device: Any = None) -> Any:
        return torch.get_device_module("cpu" if device is None else device)


def patch() -> None:
    """Patch the stand-ins over the globals SGLang's GDN backend, kernels and Qwen3.5 / Qwen3-Next models look
    up."""
    from sglang.kernels.ops.attention.fla import fused_norm_gate, layernorm_gated
    from sglang.srt.layers.attention import hybrid_linear_attn_backend
    from sglang.srt.layers.attention.linear import gdn_backend
    from sglang.srt.layers.attention.linear.kernels import gdn_triton
    from sglang.srt.models import qwen3_5, qwen3_next

    gdn_backend.causal_conv1d_fn = conv_prefill
    gdn_backend.causal_conv1d_update = conv_update
    gdn_backend.fused_gdn_gating = gdn_gating
    gdn_triton.chunk_gated_delta_rule = chunk_rule
    gdn_triton.fused_sigmoid_gating_delta_rule_update = gating_rule_update
    gdn_triton.TritonGDNKernel.supports_packed_decode = False  # its packed decode is one more Triton kernel
    hybrid_linear_attn_backend.scatter_mamba_states_after_mtp_verify = scatter_after_verify
    layernorm_gated.layernorm_fn = gated_rms_norm
    qwen3_5.fused_sigmoid_mul = sigmoid_mul
    qwen3_5._GDN_FUSED_QKVZBA_RATIOS = ()  # the model's own torch split of its fused projections
    fused_norm_gate.rms_norm_gated = fused_gated_rms_norm
    qwen3_next.fused_qkvzba_split_reshape_cat = qkvzba_split
    qwen3_next.torch = TorchOnCpu()
