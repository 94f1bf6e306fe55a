"""The slot-based decode session: the one decode core under `generate`, `bench` and the server.

A session has a fixed number of slots. A request joins the lowest free slot between steps (its prompt is
prefilled into that slot's rows of the caches) and leaves when its caller is done with it. A step runs the
first slots up to the last one decoding, rounded up to a power of two: finished and free slots among them
are masked (they commit nothing), not compacted away, so steps come in a few shapes and a CUDA graph
captured once replays every later step of its shape. Slots are
independent: a request's tokens depend only on its prompt, its settings and its seed.

A step: draft -> tree_build -> verify -> accept, the plain functions of `ddtree.engine.step` over a typed
`StepState`, run eagerly or as graph replays by `ddtree.engine.graphs.StepRunner`; `ddtree.engine.step.
decode_step` is the whole step as the session runs it, launch to commit, in one function. It makes one
device-to-host transfer, the accepted tokens, which the caller needs anyway. With an observer, what telemetry
needs of the device (the tree, and on a graphed GPU the stages' device clock stamps) rides along in the same
rows (`ddtree.engine.probe`) and reaches the observer as `on_probe`; without one the rows are the tokens alone.
A step in which some request asks for log-probabilities carries them at the end of the same rows
(`ddtree.engine.logprobs`); the prefill's readback of the first tokens carries the first tokens' alike.

What a step computes follows its requests, as flags known at launch that key its graphs: `sampled` (some
request samples), `filtered` (some sampling request uses top-p or top-k) and `logprobs` (some request asks);
a request's settings (temperature, top-p, top-k, seed) sit in per-slot tensors, set at its prefill.
"""

from __future__ import annotations

import time
import uuid
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from functools import partial
from typing import NamedTuple

import torch

from ddtree import observer as stages
from ddtree.engine import step, warmup
from ddtree.engine.adaptive import AdaptiveSteps, Decision
from ddtree.engine.graphs import GraphCache, StepRunner, require_cuda
from ddtree.engine.logprobs import LogprobLayout, alternatives
from ddtree.engine.prefill import PrefillFlags, PrefillInto, prefill_inputs, prefill_stage
from ddtree.engine.proposers import Proposer, make_proposer
from ddtree.engine.readback import Readback, to_device
from ddtree.engine.requests import (
    FirstTokens,
    Request,
    RequestOutput,
    Slot,
    cache_tokens,
    check_request,
    decoding,
    group_sizes,
    round_up,
    row_bucket,
    row_counts,
)
from ddtree.engine.step import Launched, Rows, StepModels, StepPlan, StepState, decode_step
from ddtree.kernels.clock import stamps_available
from ddtree.kernels.tree_attention import resolve_attention
from ddtree.methods import TreeShape
from ddtree.models.dflash import DFlashDrafter
from ddtree.models.target import Target
from ddtree.observer import NOOP, GenerateInfo, RequestResult, StepObserver
from ddtree.schedule import ShapeSchedule

SPAN_BUCKET = 256  # on CUDA, the attended key span is rounded up to a multiple of this
PREFILL_BUCKET = 64  # on CUDA, prompts are padded to a multiple of this


class InFlight(NamedTuple):
    """A launched step whose tokens have not been read yet."""

    finishing: Launched  # resumed, it reads the step back and commits it
    state: StepState


class DecodeSession:
    """`slots` requests decoded together, in caches of `capacity` tokens, with one tree shape (method, budget,
    top-k) or a `ShapeSchedule`: then each step verifies the shape scheduled for its row count, or with an
    adaptive schedule the width its own tree predicts pays most (`ddtree.engine.adaptive`), and the caches
    and buffers are sized for the widest (`self.shape`). A tree step in a session whose schedule also
    holds `ar` drafts from the whole context: its `ar` steps still feed the drafter the accepted tokens'
    features (`ddtree.engine.proposers.ContextOnly`)."""

    def __init__(
        self,
        target: Target,
        drafter: DFlashDrafter | None,
        shape: TreeShape | ShapeSchedule,
        slots: int,
        capacity: int,
        observer: StepObserver = NOOP,
        cuda_graphs: bool = False,
        pipeline_depth: int | None = None,
        tree_kernel: str = "auto",
        fused: bool | None = None,
        attention: str = "auto",
    ) -> None:
        if slots < 1:
            raise ValueError(f"a session needs at least one slot, got {slots}")
        if cuda_graphs:
            require_cuda(target.device)
        self.target = target
        self.schedule = shape if isinstance(shape, ShapeSchedule) else ShapeSchedule.fixed(shape)
        self.shape = shape = self.schedule.widest
        self.method = shape.method
        self.proposers = {
            s: make_proposer(s, target, drafter, tree_kernel, feeds_drafter=shape.drafting)
            for s in self.schedule.shapes
        }
        self.proposer = self.proposers[shape]  # the widest: the buffers' and the drafter cache's sizes
        self.attention = resolve_attention(attention, target.device, target.dtype)  # target and drafter: sdpa or triton
        self.observer = observer
        self.capacity = capacity
        self.cuda_graphs = cuda_graphs
        self.fused = cuda_graphs if fused is None else fused  # use the models' compiled regions
        width, device = self.proposer.width, target.device
        self.cache = target.new_cache(slots, capacity)
        self.draft_cache = self.proposer.new_cache(slots, capacity)
        features = len(target.feature_layers) * target.hidden_size
        self.root = torch.zeros(slots, dtype=torch.long, device=device)  # [slots] the next tree's root token
        self.context = (  # [slots, width, features] target features of the last accepted path
            torch.zeros((slots, width, features), dtype=target.dtype, device=device) if shape.drafting else None
        )
        self.counts = torch.zeros(slots, dtype=torch.long, device=device)  # [slots] real rows of `context`
        self.active = torch.zeros(slots, dtype=torch.bool, device=device)  # [slots] still decoding
        self.temperature = torch.zeros(slots, dtype=torch.float32, device=device)  # [slots]
        self.top_p = torch.ones(slots, dtype=torch.float32, device=device)  # [slots] 1: off
        self.top_k = torch.zeros(slots, dtype=torch.long, device=device)  # [slots] 0: off
        self.seed = torch.zeros(slots, dtype=torch.long, device=device)  # [slots]
        self.draw = torch.zeros(slots, dtype=torch.long, device=device)  # [slots] sampling draws so far
        self.slots: list[Slot | None] = [None] * slots
        self.steps = 0
        self._prefills = GraphCache(cuda_graphs)
        self.grouped_prefill = cuda_graphs  # joins run in groups of a row count each (`_prefill`)
        settings = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed}
        self._prefill_into = PrefillInto(
            target,
            self.proposer,
            self.cache,
            self.draft_cache,
            settings,
            self.draw,
            self.root,
            self.counts,
            self.fused,
            self.attention,
        )
        # Fixed for the session's life (graphs are captured with it, `warm_up` included): with an observer every
        # step reads back a probe, stamped by the device when its graph is one that can stamp.
        self.probed = observer is not NOOP
        # An adaptive step is two graphs around a readback: its stages are timed between them, not stamped.
        stamped = self.probed and cuda_graphs and stamps_available(device) and not self.schedule.adaptive
        self.runners = {s: self._runner(self.proposers[s], stamped) for s in self.schedule.shapes}
        self.runner = self.runners[shape]

        def proposer(s: TreeShape) -> Proposer:  # an adaptive cap's or width's, made here
            if s not in self.proposers:
                self.proposers[s] = make_proposer(s, target, drafter, tree_kernel, feeds_drafter=True)
            return self.proposers[s]

        def models(s: TreeShape) -> StepModels:
            return self._models(proposer(s))

        def fixed(s: TreeShape) -> StepRunner[StepState]:  # a committed width's fixed step, its runner made here
            if s not in self.runners:
                self.runners[s] = self._runner(proposer(s), stamped)
            return self.runners[s]

        self.adaptive = (
            AdaptiveSteps(models, shape, observer, cuda_graphs, self._show_tree, fixed)
            if self.schedule.adaptive
            else None
        )
        self.pipeline_depth = pipeline_depth or (2 if cuda_graphs else 1)
        self.readback = Readback(target.device, self.pipeline_depth)
        self._inflight: deque[InFlight] = deque()
        self._last_finish: float | None = None  # when the last step's tokens were read (None: a join since)
        self.shapes_made = 0  # steps that compiled or captured a step shape (warm-up's too): one-off costs
        self._views: dict[int, Rows] = {}
        if self.probed:
            observer.on_session(stamped)

    def _models(self, proposer: Proposer) -> StepModels:
        return StepModels(self.target, proposer, self.fused, self.attention, self.probed)

    def _runner(self, proposer: Proposer, stamped: bool) -> StepRunner[StepState]:
        m = self._models(proposer)
        return StepRunner(
            [
                (stages.STAGE_DRAFT, partial(step.draft, m)),
                (stages.STAGE_TREE_BUILD, partial(step.build, m)),
                (stages.STAGE_VERIFY, partial(step.verify, m)),
                (stages.STAGE_ACCEPT, partial(step.accept_step, m)),
            ],
            self.observer,
            self.cuda_graphs,
            finish=partial(step.finish, m),
            stamped=stamped,
            device=self.target.device,
            after_stage=self._show_tree,
        )

    @property
    def few_shapes(self) -> bool:
        """Whether key spans are rounded up to `SPAN_BUCKET` (on CUDA: graphs and compiled regions are made per
        shape, so few shapes are made)."""
        return self.target.device.type == "cuda"

    @property
    def compiles_per_shape(self) -> bool:
        """Whether the first step of each shape compiles regions or captures graphs (so its time is start-up)."""
        return self.cuda_graphs or self.fused

    @property
    def num_slots(self) -> int:
        return len(self.slots)

    @property
    def width(self) -> int:
        """Tree slots per request, root included."""
        return self.proposer.width

    def tokens_needed(self, prompt_tokens: int, max_new_tokens: int) -> int:
        """Cache capacity a request needs in this session."""
        return cache_tokens(prompt_tokens + max_new_tokens, self.proposer.width, self.proposer.block)

    def free_slots(self) -> list[int]:
        return [i for i, s in enumerate(self.slots) if s is None]

    def has_active(self) -> bool:
        return any(decoding(s) for s in self.slots)

    def output(self, slot: int) -> RequestOutput:
        """The tokens read so far: a request that has just joined has none until the next step's are read."""
        return self._entry(slot).output

    def _entry(self, slot: int) -> Slot:
        entry = self.slots[slot]
        if entry is None:
            raise ValueError(f"slot {slot} is free")
        return entry

    # -- joining and leaving ------------------------------------------------------------------------------

    @torch.inference_mode()
    def join(self, requests: list[Request]) -> list[int]:
        """Prefill `requests` into free slots (lowest first) and return their slot indices. A pipelined session
        reads nothing back here: each request's first token (the prefill's) reaches its output at the end of
        the first `step` after which its copy has reached the host (checked without waiting), at the latest
        with the tokens of the first step launched after the join, or at `leave`, so a join never drains the
        steps in flight. Without pipelining nothing is in flight, and the first tokens are read at once."""
        if self.adaptive is not None and not self.adaptive.measured:
            self.measure_costs()
        self._last_finish = None  # the step that ends next carries the prefill: not a steady step
        free = self.free_slots()
        if len(requests) > len(free):
            raise ValueError(f"{len(requests)} requests but only {len(free)} free slots")
        for r in requests:
            check_request(r, self.tokens_needed(len(r.prompt), r.max_new_tokens), self.capacity)
        ids = free[: len(requests)]
        if self.observer is not NOOP:
            requests = [r if r.request_id else replace(r, request_id=uuid.uuid4().hex) for r in requests]
        firsts = self._prefill(ids, requests)
        for slot, request, first in zip(ids, requests, firsts, strict=True):
            entry = Slot(request, RequestOutput(), len(request.prompt), first)
            if self.pipeline_depth == 1:
                entry.take_first()
            self.slots[slot] = entry
            if self.observer is not NOOP:
                self.observer.on_generate_start(self._info(request, slot))
        self.refresh_active()
        return ids

    def warm_up(self, prompt_tokens: int = 16, new_tokens: int = 4) -> None:
        """Run dummy requests through every row count a step can have (1, 2, 4, ... slots), each with the
        shape its steps take (a schedule's for that row count; an adaptive session's every cap and width), in
        every kind of step a batch can make (`ddtree.engine.warmup.WARM_UP_KINDS`), so that compiling and
        capturing happen now rather than in the first real requests' steps; then an adaptive session measures
        its costs. The observer sees none of it. Call it on an empty session."""
        warmup.warm_up(self, prompt_tokens, new_tokens)

    def measure_costs(self, repeats: int = 6, prompt_tokens: int = 16, unwaited: bool | None = None) -> None:
        """An adaptive session's cost model: the time of a greedy step of each (cap, width) it chooses between,
        at each row count a step can have, on this device and dtype (after `warm_up` on CUDA, the graphs'
        replays), and with `unwaited` (default: on CUDA, where the device runs ahead of the host) also each
        width's fixed step, what a committed row count runs without deciding. `join` runs it before the
        session's first request where it has not run. The observer sees none of it. Call it on an empty session."""
        warmup.measure_costs(self, repeats, prompt_tokens, unwaited)

    @contextmanager
    def unobserved(self) -> Iterator[None]:
        """The observer sees nothing of the steps run inside (warm-up's and measuring's dummy requests)."""
        observer = self.observer
        self._set_observer(NOOP)
        try:
            yield
        finally:
            self._set_observer(observer)

    def _set_observer(self, observer: StepObserver) -> None:
        self.observer = observer
        adaptive = () if self.adaptive is None else self.adaptive.runners
        for runner in (*self.runners.values(), *adaptive):
            runner.observer = observer

    def leave(self, slot: int, reason: str = "cancelled") -> RequestOutput:
        """Free `slot` and return its request's output. `reason` is the finish reason telemetry reports for a
        request that leaves before it finished (a stop string matched, the client went away)."""
        entry = self._entry(slot)
        entry.take_first()
        self.slots[slot] = None
        self.refresh_active()
        if self.observer is not NOOP:
            out, rid = entry.output, entry.request.request_id
            result = RequestResult(rid, out.token_ids, out.acceptance_lengths, out.finish_reason or reason)
            self.observer.on_generate_end([result])
        return entry.output

    def _info(self, request: Request, slot: int) -> GenerateInfo:
        """What telemetry is told of a request that joins."""
        fixed = not self.schedule.switching  # a switching session's budget is each step's (`on_step_start`)
        return GenerateInfo(
            method=self.method,
            budget=self.shape.budget if fixed else None,
            topk=self.shape.topk if fixed else None,
            temperature=request.temperature,
            max_new_tokens=request.max_new_tokens,
            seed=request.seed,
            request_ids=[request.request_id],
            prompt_tokens=[request.prompt],
            slots=[slot],
            trace_parents=[request.trace_parent],
        )

    def _prefill(self, ids: list[int], requests: list[Request]) -> list[tuple[FirstTokens, int]]:
        """Run the prompts into their slots' rows; return each one's first token, on its way to the host (its
        group's, and its index there). On CUDA the prompts run in groups of a row count each (largest first:
        47 requests as 32, 8, 4, 2 and 1), padded to a multiple of `PREFILL_BUCKET`, each group a graph replay
        per shape: warm-up captures every row count's, so requests that join in any number capture nothing."""
        grouped = self.grouped_prefill
        sizes = group_sizes(len(requests), row_counts(self.num_slots)) if grouped else [len(requests)]
        firsts: list[tuple[FirstTokens, int]] = []
        for size in sizes:
            start = len(firsts)
            group = self._prefill_group(ids[start : start + size], requests[start : start + size])
            firsts += [(group, i) for i in range(size)]
        return firsts

    def _prefill_group(self, ids: list[int], requests: list[Request]) -> FirstTokens:
        device = self.target.device
        width = max(len(r.prompt) for r in requests)
        if self.cuda_graphs:
            width = min(self.capacity, round_up(width, PREFILL_BUCKET))
        inputs = prefill_inputs(ids, requests, width, device)
        flags = PrefillFlags.of(requests)
        tensors = self._prefills.run((len(requests), width, flags), prefill_stage(self._prefill_into, flags), inputs)
        reader = Readback(device, 1)  # the copy is queued before any later group's replay reuses the pool
        layout = LogprobLayout(1, alternatives(self.target.vocab_size)) if flags.scored else None
        return FirstTokens(reader.start(tensors["first"]), reader.wait, layout, reader.ready)

    def refresh_active(self) -> None:
        flags = [decoding(s) for s in self.slots]
        self.active.copy_(to_device(flags, self.target.device))

    # -- the step -----------------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[int]:
        """One decode step for every slot (`ddtree.engine.step.decode_step`); returns how many tokens each
        slot's request kept.

        With a pipeline depth of 2 the next step is launched before this one's tokens are read, so the
        host's work overlaps the device's. Its results are the same: a step's inputs live on the device,
        and a slot that finished or left while a step was in flight just has that step's tokens ignored.
        """
        while len(self._inflight) < self.pipeline_depth:
            launched = decode_step(self)
            self._inflight.append(InFlight(launched, next(launched)))
        emitted = _finished(self._inflight.popleft())
        self._hand_over_firsts()
        return emitted

    def _hand_over_firsts(self) -> None:
        """Requests that joined while a step was in flight get their prefill's token as soon as its copy has
        reached the host (checked without waiting), not with the next step's tokens: a step earlier."""
        finished = False
        for entry in self.slots:
            if entry is not None and entry.first_arrived():
                finished |= entry.take_first()
        if finished:
            self.refresh_active()

    def drain(self) -> list[list[int]]:
        """Finish the steps still in flight (their tokens go to slots that are still decoding, if any);
        returns what each kept, as `step` does."""
        return [_finished(self._inflight.popleft()) for _ in range(len(self._inflight))]

    def plan_step(self) -> StepPlan:
        """The next step's rows (the first slots up to the last one decoding, in a row bucket), key span, flags
        and tree, from the slots' requests."""
        occupied = [s.request for s in self.slots if s is not None and not s.output.finished]
        # Each step in flight may commit up to one tree's depth that the host has not read yet.
        ahead = (1 + len(self._inflight)) * self.proposer.width
        span = max((s.length for s in self.slots if s is not None), default=0) + ahead + self.proposer.block
        if self.few_shapes:
            span = min(self.capacity, round_up(span, SPAN_BUCKET))
        rows = self._rows(row_bucket(self.slots, self.num_slots))
        sampled = any(r.temperature > 0 for r in occupied)
        filtered = any(r.filtered for r in occupied)
        scored = any(r.logprobs is not None for r in occupied)
        return StepPlan(rows, span, sampled, filtered, scored, self._scheduled(rows.n))

    def run_stages(self, number: int, plan: StepPlan) -> tuple[StepState, TreeShape, Decision | None]:
        """Step `number`'s stages after the observer hears it start: eagerly or as graph replays, by the
        runner of its tree, or by an adaptive session's two parts. Returns its state, the tree it verified and
        an adaptive step's decision."""
        key = plan.key
        if self.adaptive is not None:
            warmup = self.compiles_per_shape and self.adaptive.is_new(key)
            self.shapes_made += warmup
            self.observer.on_step_start(number, plan.rows.n, warmup, plan.shape)
            return self.adaptive.run(key, plan.state)
        runner = self.runners[plan.shape]
        warmup = self.compiles_per_shape and runner.is_new(key)  # this step compiles or captures
        self.shapes_made += warmup
        self.observer.on_step_start(number, plan.rows.n, warmup, plan.shape)
        return runner.run(key, plan.state), plan.shape, None

    def _scheduled(self, rows: int) -> TreeShape:
        """The shape for a step over `rows` rows (its row bucket). The bucket, not the number of requests
        decoding in it, sets what the step costs; and tokens/s = decoding x tau / step time, so the tree
        with the most tokens/s for a bucket is the same however many of its rows decode."""
        if not self.schedule.switching:
            return self.shape
        return self.schedule.shape_for(rows)

    def adapt(
        self, number: int, shape: TreeShape, decision: Decision, entries: list[Slot | None], host: list[list[int]]
    ) -> float:
        """An adaptive step, read: the observer hears its width and predicted gain (returned); where it was the
        session's own choice, its prediction is set against the drafts its rows (those decoding when it
        launched, `entries`) accepted, and it times its cost, waited for or not (from the last step read; none
        since a join)."""
        now = time.perf_counter()
        seen, gain = decision.read()
        self.observer.on_width(number, shape, gain)
        if self.adaptive is not None:
            if seen is not None:
                self.adaptive.observe(seen, sum(row[0] for row, s in zip(host, entries, strict=False) if decoding(s)))
            if self._last_finish is not None:
                self.adaptive.timed(decision, seen, now - self._last_finish)
        self._last_finish = now
        return gain

    def _rows(self, n: int) -> Rows:
        """Views of the first `n` slots (made once per `n`: graphs captured on them replay on them)."""
        rows = self._views.get(n)
        if rows is None:
            rows = Rows(
                n,
                self.root[:n],
                None if self.context is None else self.context[:n],
                self.counts[:n],
                self.active[:n],
                self.temperature[:n],
                self.top_p[:n],
                self.top_k[:n],
                self.seed[:n],
                self.draw[:n],
                self.cache.narrow(n),
                None if self.draft_cache is None else self.draft_cache.narrow(n),
            )
            self._views[n] = rows
        return rows

    def _show_tree(self, stage: str, state: StepState) -> None:
        """The tree, to the observer, once built (in steps that run between the stage hooks)."""
        if stage == stages.STAGE_TREE_BUILD:
            self.observer.on_tree(state.tree)


def _finished(flight: InFlight) -> list[int]:
    """Resume a launched step to its end: what each slot kept."""
    try:
        next(flight.finishing)
    except StopIteration as done:
        emitted: list[int] = done.value
        return emitted
    raise RuntimeError("a decode step yields once, after its launch")
