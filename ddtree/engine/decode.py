"""The embedded engine: `generate` decodes a batch of prompts on a `DecodeSession` until all are done;
`stream` decodes any number of prompts through a fixed number of slots, each joining when one frees
(continuous batching, as the server's requests do).

The loop returns tokens; it never counts for telemetry. Observers see each stage through `StepObserver`.
Sessions (and the CUDA graphs captured in them) are kept between calls with the same shape, so repeated
calls at one batch size pay for capture once.
"""

from __future__ import annotations

import copy
import time
from collections import OrderedDict, deque
from dataclasses import dataclass

import torch

from ddtree.engine.requests import Request, RequestOutput, cache_tokens, round_up
from ddtree.engine.session import DecodeSession
from ddtree.kernels.tree_attention import resolve_attention
from ddtree.methods import get_method
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

    def session(self, config: GenerationConfig, slots: int, tokens: int) -> DecodeSession:
        """A free session for `slots` requests of up to `tokens` tokens each (prompt and new tokens)."""
        facts = get_method(config.method)
        budget, topk = facts.tree_shape(config.budget, config.topk, self.drafter.depth if self.drafter else 0)
        key = (config.method, budget, topk, slots)
        session = self.sessions.get(key)
        block = self.drafter.block_size if self.drafter is not None and facts.needs_drafter else 1
        needed = cache_tokens(tokens, 1 + budget, block)
        if session is None or needed > session.capacity:
            self.sessions.pop(key, None)
            while len(self.sessions) >= KEPT_SESSIONS:
                self.sessions.popitem(last=False)
            capacity = round_up(needed, CAPACITY_BUCKET)
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
