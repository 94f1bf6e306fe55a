"""Opt-in patches that let SGLang 0.5.23 serve DFLASH and DDTREE on a CPU (DDTREE_SGLANG_CPU=1 only).

SGLang's own CPU mode (SGLANG_USE_CPU_ENGINE=1) needs a CPU build of `sgl_kernel`, which PyPI does not
have, and its DFlash path is CUDA/NPU/XPU only. These patches swap the few Triton/CUDA-only pieces on that
path for torch code, so that CI and laptops can run the real SGLang server against our own engine. They
are not a way to serve on CPU: attention loops over requests in Python.

Each patch names the SGLang function it replaces and why. `apply` refuses any SGLang other than 0.5.23,
whose code these patches were written against, and patches once per process.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

SGLANG_VERSION = "0.5.23"
_applied = False


def apply() -> None:
    """Apply every patch (idempotent)."""
    global _applied
    if _applied:
        return
    check_version()
    for patch in PATCHES:
        patch()
    _applied = True


def check_version(version: str | None = None) -> None:
    if version is None:
        import sglang

        version = str(sglang.__version__)
    if version != SGLANG_VERSION:
        raise RuntimeError(
            f"DDTREE_SGLANG_CPU=1: the CPU patches are written for sglang {SGLANG_VERSION}, found {version}; "
            f"unset DDTREE_SGLANG_CPU or install sglang=={SGLANG_VERSION}"
        )


def _patch_rotary() -> None:
    """`RotaryEmbedding.__init__` (layers/rotary_embedding/base.py) imports `vllm._custom_ops` unless the module
    flag `_is_cpu` is set (it is set only under SGLANG_USE_CPU_ENGINE). With it, the torch rotary runs."""
    from sglang.srt.layers.rotary_embedding import base

    base._is_cpu = True


def _patch_platform_check() -> None:
    """`_handle_dflash` (arg_groups/speculative_hook.py) refuses devices other than cuda/npu/xpu and resolves
    the draft attention backend through `current_platform`: answer as a platform that runs DFlash with the
    torch_native backend."""
    from sglang.srt.arg_groups import choices, speculative_hook

    if "torch_native" not in choices.DRAFT_ATTENTION_BACKEND_CHOICES:
        # `build_draft_tp_worker` (speculative/draft_worker_common.py) checks the same list object.
        choices.DRAFT_ATTENTION_BACKEND_CHOICES.append("torch_native")
    speculative_hook.current_platform = _CpuPlatform(speculative_hook.current_platform)


class _CpuPlatform:
    """The real platform, except for the three questions DFlash's argument handling asks."""

    def __init__(self, platform: Any) -> None:
        self._platform = platform

    def __getattr__(self, name: str) -> Any:
        return getattr(self._platform, name)

    def is_out_of_tree(self) -> bool:
        return True

    def supports_speculative_algorithm(self, algorithm: str) -> bool:
        return True

    def supports_speculative_draft_attention_backend(self, algorithm: str, backend: str) -> bool:
        return backend == "torch_native"

    def get_default_speculative_draft_attention_backend(self, algorithm: str) -> str:
        return "torch_native"


def _patch_kv_pool() -> None:
    """`MHATokenToKVPool._init_kv_copy_and_warmup` (mem_cache/memory_pool.py) warms up a Triton copy kernel,
    which fails with no GPU ("0 active drivers"); `move_kv_cache` then moves with torch indexing
    (SGLANG_NATIVE_MOVE_KV_CACHE, read when the pool is built)."""
    from sglang.srt.mem_cache import memory_pool

    os.environ["SGLANG_NATIVE_MOVE_KV_CACHE"] = "1"

    def no_warmup(self: Any) -> None:
        self._kv_copy_config = None

    memory_pool.MHATokenToKVPool._init_kv_copy_and_warmup = no_warmup


def _assign_req_to_token_pool(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    batch_size: int,
) -> None:
    """Torch `assign_req_to_token_pool_func`: row `req_pool_indices[i]`, columns start..end, gets the next
    `end - start` slots of `out_cache_loc`."""
    taken = 0
    for i, (start, end) in enumerate(zip(start_offset.tolist(), end_offset.tolist(), strict=True)):
        row = int(req_pool_indices[i])
        req_to_token[row, start:end] = out_cache_loc[taken : taken + end - start].to(req_to_token.dtype)
        taken += end - start


def _assign_extend_cache_locs(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    batch_size: int,
    draft_token_num: int,
    device: Any,
) -> torch.Tensor:
    """Torch `assign_extend_cache_locs_func`: the slots of columns start..end of each request's row, flat."""
    rows = [
        req_to_token[int(req_pool_indices[i]), start:end]
        for i, (start, end) in enumerate(zip(start_offset.tolist(), end_offset.tolist(), strict=True))
    ]
    return torch.cat(rows).to(torch.int64) if rows else torch.empty((0,), dtype=torch.int64, device=device)


def _patch_cache_locs() -> None:
    """`assign_req_to_token_pool_func` (mem_cache/allocation.py) launches a Triton kernel unless SGLang's CPU
    engine is on; `assign_extend_cache_locs_func` (kernels/ops/speculative/cache_locs.py) returns None on a
    CPU without it. Both are replaced where they are looked up (the modules that imported them by name)."""
    from sglang.srt.mem_cache import allocation
    from sglang.srt.speculative import dflash_worker_v2, spec_utils

    for module in (allocation, spec_utils, dflash_worker_v2):
        module.assign_req_to_token_pool_func = _assign_req_to_token_pool
    dflash_worker_v2.assign_extend_cache_locs_func = _assign_extend_cache_locs


def _patch_record_stream() -> None:
    """`Tensor.record_stream` (called by DFlashWorkerV2.forward_batch_generation on `seq_lens`) fails on CPU
    tensors ("unknown parameter type"); there are no streams to record on a CPU."""
    original: Callable[..., Any] = torch.Tensor.record_stream

    def record_stream(self: torch.Tensor, stream: Any) -> None:
        if self.device.type != "cpu":
            original(self, stream)

    torch.Tensor.record_stream = record_stream  # type: ignore[method-assign, assignment]


def _patch_dflash_attention() -> None:
    """`DFlashAttention.__init__` (models/dflash.py) picks a fused Triton qk-norm + rope kernel when the rotary
    has a cos/sin table; the eager norm and rope are torch."""
    from sglang.srt.models import dflash

    original = dflash.DFlashAttention.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self.use_table_qk_norm_rope = False

    dflash.DFlashAttention.__init__ = init


def _patch_input_embeds_dtype() -> None:
    """`ModelRunner._extend_forward_kwargs` (model_executor/model_runner.py) casts `input_embeds` to bfloat16
    whatever the model's dtype; the DFlash draft passes its block as embeddings, so a float32 run fails
    ("BFloat16 != float"). Cast to the model's dtype instead."""
    from sglang.srt.model_executor import model_runner

    original = model_runner.ModelRunner._extend_forward_kwargs

    def kwargs(self: Any, forward_batch: Any, pp_proxy_tensors: Any) -> dict[str, Any]:
        out: dict[str, Any] = original(self, forward_batch, pp_proxy_tensors)
        if "input_embeds" in out and forward_batch.input_embeds is not None:
            out["input_embeds"] = forward_batch.input_embeds.to(self.model_config.dtype)
        return out

    model_runner.ModelRunner._extend_forward_kwargs = kwargs


def _patch_torch_native_verify() -> None:
    """`TorchNativeAttnBackend.forward_extend` (layers/attention/torch_native_backend.py) has no TARGET_VERIFY
    path (it reads extend lengths that a verify batch does not have). Verify batches go to
    `ddtree.sglang.cpu_attention.target_verify`, which honours the tree mask."""
    from sglang.srt.layers.attention import torch_native_backend

    from ddtree.sglang.cpu_attention import target_verify

    original = torch_native_backend.TorchNativeAttnBackend.forward_extend

    def forward_extend(
        self: Any, q: Any, k: Any, v: Any, layer: Any, forward_batch: Any, save_kv_cache: bool = True
    ) -> Any:
        if forward_batch.forward_mode.is_target_verify():
            return target_verify(self, q, k, v, layer, forward_batch, save_kv_cache)
        return original(self, q, k, v, layer, forward_batch, save_kv_cache)

    torch_native_backend.TorchNativeAttnBackend.forward_extend = forward_extend


def _patch_gdn() -> None:
    """Gated-delta-net targets (Qwen3.5, Qwen3-Next): `ddtree.sglang.cpu_gdn`'s torch stand-ins for the Triton
    kernels on their path (convolution, gating, delta rule, tree verify and commit, the gated norm, Qwen3-Next's
    projection split)."""
    from ddtree.sglang import cpu_gdn

    cpu_gdn.patch()


def _patch_moe() -> None:
    """Mixture-of-experts targets (Qwen3-Next): `ddtree.sglang.cpu_moe`'s torch stand-in for the shared expert's
    fused sigmoid gate, the one Triton kernel of their expert block on a CPU (routing and experts run SGLang's
    own torch code there)."""
    from ddtree.sglang import cpu_moe

    cpu_moe.patch()


PATCHES: tuple[Callable[[], None], ...] = (
    _patch_rotary,
    _patch_platform_check,
    _patch_kv_pool,
    _patch_cache_locs,
    _patch_record_stream,
    _patch_dflash_attention,
    _patch_input_embeds_dtype,
    _patch_torch_native_verify,
    _patch_gdn,
    _patch_moe,
)
