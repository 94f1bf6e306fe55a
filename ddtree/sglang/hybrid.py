"""DDTREE on gated-delta-net (GDN) hybrid targets inside SGLang 0.5.23: Qwen3-Next and Qwen3.5.

SGLang verifies trees on these targets with its own linear-attention backend, but keys everything on the
server's EAGLE top-k, which DFlash (so DDTREE) runs at 1. Three things make it take our tree:

- `patch_pool_layout`: the per-node layout of the verify's convolution-window scratch. With top-k 1 the pool
  deduplicates the windows of consecutive draft steps (right for a chain: siblings would overwrite each
  other), so it is turned off for DDTREE before the target's pool is built.
- `tree_mode`: the backend's top-k lifted above 1 while a verify's metadata is made and its forward runs, so
  that it reads the tree's first-child / next-sibling links (`DDTreeVerifyInput.retrieve_next_*`) and each
  node's convolution and state start from its parent's.
- `commit`: after every verify, before any other target forward, each request's state and convolution
  window become those after the last node of its accepted path (SGLang's `commit_mamba_states_after_verify`
  with our path as the accept index; DFlash's own commit takes step `accepted` of a chain).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

TREE_TOPK = 2  # any top-k above 1 selects the backend's tree path; the links carry the tree itself


def patch_pool_layout(algorithm_name: str) -> None:
    """Make `conv_window_dedup_enabled` (mem_cache/memory_pool.py) false when the server runs
    `algorithm_name`; other algorithms keep SGLang's answer."""
    from sglang.srt.mem_cache import memory_pool

    original: Callable[..., bool] = memory_pool.conv_window_dedup_enabled
    if getattr(original, "ddtree_wrapped", False):
        return

    def dedup_enabled(*args: Any, **kwargs: Any) -> bool:
        if serving(algorithm_name):
            return False  # one window per tree node: siblings must not share columns
        return original(*args, **kwargs)

    dedup_enabled.ddtree_wrapped = True  # type: ignore[attr-defined]
    memory_pool.conv_window_dedup_enabled = dedup_enabled


def serving(algorithm_name: str) -> bool:
    """Whether this process's published server configuration runs `algorithm_name` (False before SGLang
    publishes one)."""
    from sglang.srt.runtime_context import get_context, get_spec

    if not get_context().is_config_namespace_published("spec"):
        return False
    return str(get_spec().speculative_algorithm).upper() == algorithm_name


def linear_backend(attn_backend: Any) -> Any:
    """The linear-attention half of SGLang's hybrid backend, or None for a target without one."""
    return getattr(attn_backend, "linear_attn_backend", None)


def full_attention_backend(attn_backend: Any) -> Any:
    """The backend the full-attention layers run on (inside the hybrid wrapper, when there is one)."""
    return getattr(attn_backend, "full_attn_backend", attn_backend)


@contextmanager
def tree_mode(backend: Any) -> Iterator[None]:
    """The linear backend `backend` (None: nothing to do) in tree mode for one verify."""
    if backend is None:
        yield
        return
    saved = backend.topk
    backend.topk = max(int(saved or 0), TREE_TOPK)
    try:
        yield
    finally:
        backend.topk = saved


def accept_index(path: torch.Tensor, width: int) -> torch.Tensor:
    """SGLang's accept index for a verify of `width` nodes per request: the accepted path `path` `[bs, p]`
    as flat node rows `b * width + node` (the tree-layout logits' rows)."""
    return path + width * torch.arange(path.shape[0], device=path.device)[:, None]


def commit(target_worker: Any, batch: Any, path: torch.Tensor, accepted: torch.Tensor, width: int) -> None:
    """Commit each request's recurrent state and convolution window after the last node of its accepted path
    (`path` `[bs, N]`, `accepted` `[bs]` drafts); `batch.seq_lens` must still be the pre-verify lengths (the
    radix cache's state tracking reads them)."""
    from sglang.srt.speculative.spec_utils import commit_mamba_states_after_verify

    commit_mamba_states_after_verify(
        target_worker,
        batch,
        accept_lens=(accepted + 1).to(torch.int32),
        accept_index=accept_index(path, width),
        draft_token_num=width,
    )
