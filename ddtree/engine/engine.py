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
import time
from collections import OrderedDict, deque
from dataclasses import dataclass

from ddtree.engine.capacity import ModelDims, check_context, check_session, plan_session
from ddtree.engine.graphs import use_cuda_graphs
from ddtree.engine.requests import Request, RequestOutput
from ddtree.engine.session import DecodeSession
from ddtree.methods import TreeShape
from ddtree.models.dflash import DFlashDrafter
from ddtree.models.target import Target
from ddtree.observer import NOOP, StepObserver
from ddtree.schedule import ShapeSchedule
from ddtree.settings import GenerationConfig, check_generation, check_prompt, tree_shapes

KEPT_SESSIONS = 4  # sessions kept for reuse, least recently used dropped first


@dataclass(frozen=True)
class GenerationResult:
    outputs: list[RequestOutput]
    steps: int
    seconds: float  # prefill and decode, wall clock
    new_shapes: int = 0  # steps that compiled or captured a step shape (CUDA): one-off costs inside `seconds`

    @property
    def new_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)


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
        _check_prompts(prompts)
        started = time.perf_counter()
        session = self.session(config, len(prompts), max(len(p) for p in prompts) + config.max_new_tokens)
        made = session.shapes_made
        ids = request_ids or [""] * len(prompts)
        slots = session.join([_request(p, config, i, rid) for i, (p, rid) in enumerate(zip(prompts, ids, strict=True))])
        steps = 0  # steps in which some request decoded (one launched ahead at the end does not count)
        while session.has_active():
            steps += any(session.step())
        steps += sum(any(emitted) for emitted in session.drain())
        outputs = [session.leave(slot) for slot in slots]
        seconds = time.perf_counter() - started
        return GenerationResult(outputs, steps, seconds, session.shapes_made - made)

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
        _check_prompts(prompts)
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        started = time.perf_counter()
        session = self.session(config, slots, max(len(p) for p in prompts) + config.max_new_tokens)
        made = session.shapes_made
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
        ordered = [outputs[i] for i in range(len(prompts))]
        return GenerationResult(ordered, steps, seconds, session.shapes_made - made)

    @property
    def dims(self) -> ModelDims:
        return ModelDims.of(self.target.config, self.target.dtype, getattr(self.drafter, "config", None))

    def shape(self, config: GenerationConfig) -> TreeShape:
        """The tree `config` verifies on this engine's drafter (with a schedule, the widest it can take):
        resolved here once, and passed down."""
        return self.shapes(config).widest

    def shapes(self, config: GenerationConfig) -> ShapeSchedule:
        """The trees `config` verifies, by the rows a step runs: one shape, or its schedule's."""
        return tree_shapes(config, self.dims.block - 1)

    def session(self, config: GenerationConfig, slots: int, tokens: int) -> DecodeSession:
        """A free session for `slots` requests of up to `tokens` tokens each (prompt and new tokens).
        CapacityError, before anything is allocated, where that does not fit (`check_session`)."""
        check_generation(config, int(self.target.config.vocab_size))
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


def _check_prompts(prompts: list[list[int]]) -> None:
    """ValueError for no prompts, SettingsError for a prompt without tokens (`ddtree.settings.check_prompt`)."""
    if not prompts:
        raise ValueError("no prompts were given")
    for prompt in prompts:
        check_prompt(prompt)
