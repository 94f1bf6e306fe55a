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
import time
from collections import OrderedDict, deque
from dataclasses import dataclass

from ddtree.engine.capacity import ModelDims, check_context, check_session, plan_session
from ddtree.engine.graphs import use_cuda_graphs
from ddtree.engine.requests import Request, RequestOutput, check_filters
from ddtree.engine.session import DecodeSession
from ddtree.methods import TreeShape, get_method
from ddtree.models.dflash import DFlashDrafter
from ddtree.models.target import Target
from ddtree.observer import NOOP, StepObserver
from ddtree.schedule import BudgetSchedule, ShapeSchedule

KEPT_SESSIONS = 4  # sessions kept for reuse, least recently used dropped first


@dataclass(frozen=True)
class GenerationConfig:
    method: str = "ddtree"
    budget: int = 32
    topk: int | None = None
    temperature: float = 0.0
    seed: int = 0  # request i of a batch samples with seed + i
    max_new_tokens: int = 128
    eos_token_ids: tuple[int, ...] = ()
    schedule: BudgetSchedule | None = None  # ddtree only: the tree follows the load (budget and topk unused)
    top_p: float = 1.0  # in (0, 1]: nucleus sampling of the target's tokens at T > 0 (1: off)
    top_k: int = 0  # the target samples among its k most probable tokens at T > 0 (0: off)
    logprobs: int | None = None  # None: no log-probabilities; 0: the emitted tokens'; N: and N alternatives each


@dataclass(frozen=True)
class GenerationResult:
    outputs: list[RequestOutput]
    steps: int
    seconds: float  # prefill and decode, wall clock

    @property
    def new_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)


def check_generation(config: GenerationConfig) -> None:
    """ValueError for settings no session can run (the CLI checks its flags before this)."""
    if not (math.isfinite(config.temperature) and config.temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0, got {config.temperature}")
    if config.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {config.max_new_tokens}")
    check_filters(config.top_p, config.top_k, config.logprobs)
    if config.budget < 1 and get_method(config.method).tuned_by_budget:
        raise ValueError(f"budget must be >= 1, got {config.budget}")
    if config.topk is not None and config.topk < 1:
        raise ValueError(f"topk must be >= 1, got {config.topk}")
    if config.schedule is not None and config.method != "ddtree":
        raise ValueError(f"a budget schedule chooses ddtree trees; method {config.method!r} has no budget to follow")


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
        self.attention = attention  # resolved by each session
        self.pipeline_depth = pipeline_depth  # None: the session's default (2 with CUDA graphs, else 1)
        self.drafter = drafter
        self.observer = observer
        self.cuda_graphs = use_cuda_graphs(cuda_graphs, target.device)
        if self.cuda_graphs:
            target.compile_layers()  # fewer kernels per layer; compiled on the eager first step of each shape
            if drafter is not None:
                drafter.compile_layers()
        self.sessions: OrderedDict[tuple[ShapeSchedule, int], DecodeSession] = OrderedDict()

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

    def shape(self, config: GenerationConfig) -> TreeShape:
        """The tree `config` verifies on this engine's drafter (with a schedule, the widest it can take):
        resolved here once, and passed down."""
        return self.shapes(config).widest

    def shapes(self, config: GenerationConfig) -> ShapeSchedule:
        """The trees `config` verifies, by the rows a step runs: one shape, or its schedule's."""
        dims = self.dims
        if config.schedule is None:
            return ShapeSchedule.fixed(dims.shape(config.method, config.budget, config.topk))
        return config.schedule.resolve(dims.shape)

    def session(self, config: GenerationConfig, slots: int, tokens: int) -> DecodeSession:
        """A free session for `slots` requests of up to `tokens` tokens each (prompt and new tokens).
        CapacityError, before anything is allocated, where that does not fit (`check_session`)."""
        check_generation(config)
        dims = self.dims
        shapes = self.shapes(config)
        key = (shapes, slots)
        session = self.sessions.get(key)
        plan = plan_session(dims, shapes.widest, slots, tokens)
        check_context(dims, plan)
        if session is None or plan.needed > session.capacity:
            self.sessions.pop(key, None)
            while len(self.sessions) >= KEPT_SESSIONS:
                self.sessions.popitem(last=False)
            session = None  # the replaced session's buffers are free before the check counts what is free
            check_session(dims, plan, self.target.device)
            session = DecodeSession(
                self.target,
                self.drafter,
                shapes if shapes.switching else shapes.widest,
                slots,
                plan.capacity,
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
        prompt,
        config.max_new_tokens,
        config.temperature,
        config.seed + index,
        config.eos_token_ids,
        request_id,
        top_p=config.top_p,
        top_k=config.top_k,
        logprobs=config.logprobs,
    )
