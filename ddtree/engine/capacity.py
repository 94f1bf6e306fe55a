"""What a session costs before it is made: its shape (`plan_session`), its buffers' bytes (`session_bytes`),
and the checks against the model's context length and the device's free memory (`check_session`), which
raise `CapacityError` before anything is allocated.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from typing import Any

import torch

from ddtree.engine.requests import cache_tokens, round_up
from ddtree.errors import CapacityError
from ddtree.methods import TreeShape
from ddtree.models.hybrid import LINEAR, MixerShape
from ddtree.models.target import HYBRID_MODEL_TYPES

CAPACITY_BUCKET = 256  # session capacities are rounded up to this, so nearby lengths share a session


@dataclass(frozen=True)
class RecurrentDims:
    """A hybrid target's recurrent layers (`ddtree.models.hybrid`): how many, and one's sizes."""

    layers: int
    mixer: MixerShape

    @classmethod
    def of(cls, config: Any, dtype: torch.dtype) -> RecurrentDims | None:
        """From a hybrid's HF config; None for a dense one."""
        if getattr(config, "model_type", None) not in HYBRID_MODEL_TYPES:
            return None
        return cls(list(config.layer_types).count(LINEAR), MixerShape.of(config, dtype))

    def committed_bytes(self, dtype_bytes: int) -> int:
        """One request's states in every layer: the convolution's last inputs and the recurrent state."""
        m = self.mixer
        return self.layers * (m.channels * (m.kernel - 1) * dtype_bytes + self._state_bytes)

    def node_bytes(self, dtype_bytes: int) -> int:
        """What one tree node of a verify holds: its inputs to every layer's steps, kept for the commit, and
        its share of one layer's node states (three of them at once: the state, its parent's and the step)."""
        m = self.mixer
        return self.layers * (m.channels * dtype_bytes + m.node_input_bytes(dtype_bytes)) + 3 * self._state_bytes

    @property
    def _state_bytes(self) -> int:
        return math.prod(self.mixer.state) * self.mixer.state_dtype.itemsize


@dataclass(frozen=True)
class ModelDims:
    """What a session's buffers scale with: the target's shapes, its dtype's size, and the drafter's shapes
    (zeros and a block of 1 without a drafter)."""

    layers: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int
    context: int | None  # max_position_embeddings; None where the config gives none
    dtype_bytes: int
    features: int = 0  # target layers the drafter reads
    draft_layers: int = 0
    draft_kv_heads: int = 0
    draft_head_dim: int = 0
    block: int = 1  # the drafter's block size
    recurrent: RecurrentDims | None = None  # a hybrid's gated delta-net layers (`layers` counts them too)

    @property
    def kv_layers(self) -> int:
        """The target's layers with a KV cache (all but a hybrid's recurrent ones)."""
        return self.layers - (self.recurrent.layers if self.recurrent else 0)

    @classmethod
    def of(cls, target: Any, dtype: torch.dtype, drafter: Any | None = None) -> ModelDims:
        """From a target's HF config, the dtype it runs in and a DFlash drafter's config (None: no drafter)."""
        heads, hidden = int(target.num_attention_heads), int(target.hidden_size)
        limit = getattr(target, "max_position_embeddings", None)
        dims = cls(
            layers=int(target.num_hidden_layers),
            kv_heads=int(getattr(target, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(target, "head_dim", None) or hidden // heads),
            hidden=hidden,
            intermediate=int(getattr(target, "intermediate_size", None) or 4 * hidden),
            vocab=int(target.vocab_size),
            context=int(limit) if limit else None,
            dtype_bytes=dtype.itemsize,
            recurrent=RecurrentDims.of(target, dtype),
        )
        if drafter is None:
            return dims
        return replace(
            dims,
            features=len(drafter.dflash_config["target_layer_ids"]),
            draft_layers=int(drafter.num_hidden_layers),
            draft_kv_heads=int(drafter.num_key_value_heads),
            draft_head_dim=int(drafter.head_dim),
            block=int(drafter.block_size),
        )


@dataclass(frozen=True)
class SessionPlan:
    """The shape of the session `Engine.session` would make: slots, tokens per slot, tree width, cache."""

    label: str  # the method and budget, as tables name them
    slots: int
    tokens: int  # prompt and new tokens per request
    width: int  # tree nodes per request, root included
    needed: int  # cache tokens a request of `tokens` tokens needs
    capacity: int  # cache tokens per slot, `needed` rounded up to the bucket
    drafting: bool


def plan_session(dims: ModelDims, shape: TreeShape, slots: int, tokens: int) -> SessionPlan:
    block = dims.block if shape.drafting else 1
    needed = cache_tokens(tokens, shape.width, block)
    return SessionPlan(shape.label, slots, tokens, shape.width, needed, round_up(needed, CAPACITY_BUCKET), block > 1)


def session_bytes(dims: ModelDims, plan: SessionPlan) -> tuple[int, int]:
    """(KV cache, tree buffers): the bytes of target's and drafter's caches, and what one step makes per slot:
    the ancestor matrix and attention mask (bools), the verify's activations, its logits (in the model's dtype
    and a float32 copy), the drafter's context features, its block's activations and its logits."""
    slots, width, capacity, size = plan.slots, plan.width, plan.capacity, dims.dtype_bytes
    per_token = 2 * dims.hidden + 2 * dims.intermediate  # activations of one token in a layer
    kv = 2 * slots * capacity * size * dims.kv_layers * dims.kv_heads * dims.head_dim
    tree = slots * width * (width + capacity + (per_token + dims.vocab) * size + 4 * dims.vocab)
    if plan.drafting:
        kv += 2 * slots * capacity * size * dims.draft_layers * dims.draft_kv_heads * dims.draft_head_dim
        tree += slots * width * dims.features * dims.hidden * size
        tree += slots * dims.block * (per_token * size + 2 * dims.vocab * (size + 4))
    return kv, tree


def recurrent_bytes(dims: ModelDims, plan: SessionPlan) -> int:
    """A hybrid target's recurrent states: every slot's committed ones, and what a step's nodes hold until
    the commit (0 for a dense target)."""
    r = dims.recurrent
    if r is None:
        return 0
    return plan.slots * (r.committed_bytes(dims.dtype_bytes) + plan.width * r.node_bytes(dims.dtype_bytes))


def check_session(dims: ModelDims, plan: SessionPlan, device: torch.device) -> None:
    """CapacityError where the plan exceeds the model's context length or the device's free memory."""
    check_context(dims, plan)
    kv, tree = session_bytes(dims, plan)
    states = recurrent_bytes(dims, plan)
    free = free_memory(device)
    if kv + tree + states > free:
        slots = f"{plan.slots} request slot{'s' if plan.slots > 1 else ''}"
        parts = f"{_size(kv)} of KV cache, {_size(tree)} of tree buffers"
        if states:
            per_slot = _size(states // plan.slots)
            parts += f", {_size(states)} of recurrent states ({per_slot} a slot at {plan.width} tree nodes)"
        raise CapacityError(
            f"{plan.label} with {slots} of up to {plan.tokens} tokens needs {_size(kv + tree + states)} "
            f"({parts}); {_size(free)} are free on {device}"
        )


def check_context(dims: ModelDims, plan: SessionPlan) -> None:
    limit = dims.context
    if limit is None:
        return
    if plan.tokens > limit:
        raise CapacityError(
            f"requests of up to {plan.tokens} tokens (prompt and new tokens) exceed the model's context length "
            f"of {limit} tokens"
        )
    if plan.width > limit:
        raise CapacityError(
            f"{plan.label}: a tree of {plan.width} tokens (verified in one forward) exceeds the model's context "
            f"length of {limit} tokens"
        )


def free_memory(device: torch.device) -> int:
    """Bytes a new session can take: on CUDA what the driver has free plus what torch's allocator holds
    unused; elsewhere the RAM available (MemAvailable, or the free pages where /proc is missing)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _size(n: int) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n / 1e3:.1f} kB"
