"""The embedded engine: `generate` decodes a batch of prompts on a `DecodeSession` until all are done;
`stream` decodes any number of prompts through a fixed number of slots, each joining when one frees
(continuous batching, as the server's requests do).

The loop returns tokens; it never counts for telemetry. Observers see each stage through `StepObserver`.
Sessions (and the CUDA graphs captured in them) are kept between calls with the same shape, so repeated
calls at one batch size pay for capture once. Before a session is made, its shape is checked against the
model's context length and its buffers against the device's free memory (`check_session`): values that do not
fit raise `CapacityError` before anything is allocated.
"""

from __future__ import annotations

import copy
import math
import os
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, replace
from typing import Any

import torch

from ddtree.engine.requests import Request, RequestOutput, cache_tokens, round_up
from ddtree.engine.session import DecodeSession
from ddtree.errors import CapacityError
from ddtree.kernels.tree_attention import resolve_attention
from ddtree.methods import get_method, method_label
from ddtree.models.dflash import DFlashDrafter
from ddtree.models.target import Target
from telemetry.hooks import NOOP, StepObserver

CAPACITY_BUCKET = 256  # session capacities are rounded up to this, so nearby lengths share a session
KEPT_SESSIONS = 4  # sessions kept for reuse, least recently used dropped first
CUDA_GRAPHS = ("auto", "on", "off")


@dataclass(frozen=True)
class GenerationConfig:
    method: str = "ddtree"
    budget: int = 32
    topk: int | None = None
    temperature: float = 0.0
    seed: int = 0  # request i of a batch samples with seed + i
    max_new_tokens: int = 128
    eos_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class GenerationResult:
    outputs: list[RequestOutput]
    steps: int
    seconds: float  # prefill and decode, wall clock

    @property
    def new_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)


def use_cuda_graphs(mode: str, device: torch.device) -> bool:
    """`auto`: on for CUDA devices; `on`: required (an error elsewhere); `off`: never."""
    if mode not in CUDA_GRAPHS:
        raise ValueError(f"cuda_graphs must be one of {', '.join(CUDA_GRAPHS)}, got {mode!r}")
    if mode == "on" and device.type != "cuda":
        raise ValueError(f"CUDA graphs need a CUDA device; the target is on {device}")
    return mode == "on" or (mode == "auto" and device.type == "cuda")


def check_generation(config: GenerationConfig) -> None:
    """ValueError for settings no session can run (the CLI checks its flags before this)."""
    if not (math.isfinite(config.temperature) and config.temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0, got {config.temperature}")
    if config.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {config.max_new_tokens}")
    if config.budget < 1 and get_method(config.method).tuned_by_budget:
        raise ValueError(f"budget must be >= 1, got {config.budget}")
    if config.topk is not None and config.topk < 1:
        raise ValueError(f"topk must be >= 1, got {config.topk}")


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


def plan_session(dims: ModelDims, config: GenerationConfig, slots: int, tokens: int) -> SessionPlan:
    facts = get_method(config.method)
    block = dims.block if facts.needs_drafter else 1
    budget, _ = facts.tree_shape(config.budget, config.topk, block - 1)
    needed = cache_tokens(tokens, 1 + budget, block)
    label = method_label(config.method, config.budget if facts.tuned_by_budget else None)
    return SessionPlan(label, slots, tokens, 1 + budget, needed, round_up(needed, CAPACITY_BUCKET), block > 1)


def session_bytes(dims: ModelDims, plan: SessionPlan) -> tuple[int, int]:
    """(KV cache, tree buffers): the bytes of target's and drafter's caches, and what one step makes per slot:
    the ancestor matrix and attention mask (bools), the verify's activations, its logits (in the model's dtype
    and a float32 copy), the drafter's context features, its block's activations and its logits."""
    slots, width, capacity, size = plan.slots, plan.width, plan.capacity, dims.dtype_bytes
    per_token = 2 * dims.hidden + 2 * dims.intermediate  # activations of one token in a layer
    kv = 2 * slots * capacity * size * dims.layers * dims.kv_heads * dims.head_dim
    tree = slots * width * (width + capacity + (per_token + dims.vocab) * size + 4 * dims.vocab)
    if plan.drafting:
        kv += 2 * slots * capacity * size * dims.draft_layers * dims.draft_kv_heads * dims.draft_head_dim
        tree += slots * width * dims.features * dims.hidden * size
        tree += slots * dims.block * (per_token * size + 2 * dims.vocab * (size + 4))
    return kv, tree


def check_session(dims: ModelDims, plan: SessionPlan, device: torch.device) -> None:
    """CapacityError where the plan exceeds the model's context length or the device's free memory."""
    check_context(dims, plan)
    kv, tree = session_bytes(dims, plan)
    free = free_memory(device)
    if kv + tree > free:
        slots = f"{plan.slots} request slot{'s' if plan.slots > 1 else ''}"
        raise CapacityError(
            f"{plan.label} with {slots} of up to {plan.tokens} tokens needs {_size(kv + tree)} "
            f"({_size(kv)} of KV cache, {_size(tree)} of tree buffers); {_size(free)} are free on {device}"
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


class Engine:
    def __init__(
        self,
        target: Target,
        drafter: DFlashDrafter | None = None,
        observer: StepObserver = NOOP,
        cuda_graphs: str = "auto",
        tree_kernel: str = "auto",
        pipeline_depth: int | None = None,
        attention: str = "auto",
    ) -> None:
        self.target = target
        self.tree_kernel = tree_kernel
        self.attention = resolve_attention(attention, target.device, target.dtype)
        self.pipeline_depth = pipeline_depth  # None: the session's default (2 with CUDA graphs, else 1)
        self.drafter = drafter
        self.observer = observer
        self.cuda_graphs = use_cuda_graphs(cuda_graphs, target.device)
        if self.cuda_graphs:
            target.compile_layers()  # fewer kernels per layer; compiled on the eager first step of each shape
            if drafter is not None:
                drafter.compile_layers()
        self.sessions: OrderedDict[tuple[object, ...], DecodeSession] = OrderedDict()

    def generate(
        self, prompts: list[list[int]], config: GenerationConfig, request_ids: list[str] | None = None
    ) -> GenerationResult:
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        started = time.perf_counter()
        session = self.session(config, len(prompts), max(len(p) for p in prompts) + config.max_new_tokens)
        ids = request_ids or [""] * len(prompts)
        slots = session.join([_request(p, config, i, rid) for i, (p, rid) in enumerate(zip(prompts, ids, strict=True))])
        steps = 0  # steps in which some request decoded (one launched ahead at the end does not count)
        while session.has_active():
            steps += any(session.step())
        steps += sum(any(emitted) for emitted in session.drain())
        outputs = [session.leave(slot) for slot in slots]
        seconds = time.perf_counter() - started
        return GenerationResult(outputs=outputs, steps=steps, seconds=seconds)

    def sibling(self) -> Engine:
        """An engine on the same models and settings with a session cache of its own, empty: for callers that
        alternate between more session shapes than one engine keeps (`KEPT_SESSIONS`)."""
        twin = copy.copy(self)
        twin.sessions = OrderedDict()
        return twin

    def stream(
        self, prompts: list[list[int]], config: GenerationConfig, slots: int, request_ids: list[str] | None = None
    ) -> GenerationResult:
        """Continuous batching: the prompts, in order, join a session of `slots` slots as slots free up between
        steps. Outputs come in prompt order and equal `generate`'s (a slot's output never depends on the
        others); request i samples with seed + i, as in `generate`."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        started = time.perf_counter()
        session = self.session(config, slots, max(len(p) for p in prompts) + config.max_new_tokens)
        ids = request_ids or [""] * len(prompts)
        waiting = deque(enumerate(prompts))
        held: dict[int, int] = {}  # slot -> index of the prompt it decodes
        outputs: dict[int, RequestOutput] = {}
        steps = 0
        while waiting or held:
            joining = [waiting.popleft() for _ in range(min(len(waiting), len(session.free_slots())))]
            if joining:
                requests = [_request(p, config, i, ids[i]) for i, p in joining]
                held.update(zip(session.join(requests), (i for i, _ in joining), strict=True))
            if session.has_active():
                steps += any(session.step())
            for slot in [s for s in held if session.output(s).finished]:
                outputs[held.pop(slot)] = session.leave(slot)
        steps += sum(any(emitted) for emitted in session.drain())
        seconds = time.perf_counter() - started
        return GenerationResult(outputs=[outputs[i] for i in range(len(prompts))], steps=steps, seconds=seconds)

    @property
    def dims(self) -> ModelDims:
        return ModelDims.of(self.target.config, self.target.dtype, getattr(self.drafter, "config", None))

    def session(self, config: GenerationConfig, slots: int, tokens: int) -> DecodeSession:
        """A free session for `slots` requests of up to `tokens` tokens each (prompt and new tokens).
        CapacityError, before anything is allocated, where that does not fit (`check_session`)."""
        check_generation(config)
        facts = get_method(config.method)
        budget, topk = facts.tree_shape(config.budget, config.topk, self.drafter.depth if self.drafter else 0)
        key = (config.method, budget, topk, slots)
        session = self.sessions.get(key)
        dims = self.dims
        plan = plan_session(dims, config, slots, tokens)
        check_context(dims, plan)
        if session is None or plan.needed > session.capacity:
            self.sessions.pop(key, None)
            while len(self.sessions) >= KEPT_SESSIONS:
                self.sessions.popitem(last=False)
            session = None  # the replaced session's buffers are free before the check counts what is free
            check_session(dims, plan, self.target.device)
            capacity = plan.capacity
            session = DecodeSession(
                self.target,
                self.drafter,
                config.method,
                config.budget,
                config.topk,
                slots,
                capacity,
                self.observer,
                self.cuda_graphs,
                tree_kernel=self.tree_kernel,
                pipeline_depth=self.pipeline_depth,
                attention=self.attention,
            )
            self.sessions[key] = session
        self.sessions.move_to_end(key)
        return session


def _request(prompt: list[int], config: GenerationConfig, index: int, request_id: str) -> Request:
    return Request(
        prompt, config.max_new_tokens, config.temperature, config.seed + index, config.eos_token_ids, request_id
    )
