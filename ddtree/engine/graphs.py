"""The stage runner: it runs a decode step's stages eagerly or as CUDA graph replays, and decides nothing else
(the step itself, top to bottom, is `ddtree.engine.step.decode_step`).

A step is a list of stages, each a function of the step's state (`ddtree.engine.step.StepState`), then a
`finish` that assembles what the host reads back. The runner knows the stages by name only: it calls them in
order, between the observer's stage hooks, and never reads what they write. All state that lives across
steps sits in the session's own preallocated tensors, which the stages update in place, so a graph captured
once per step shape replays any later step of that shape on the state it was captured on.

The first step of a shape runs eagerly, between the observer's stage hooks: it is a real step and the warm-up
that capture needs. The graphs are captured right after it (capture records kernels without running them, so
the state stays as the eager step left it) and replayed from the next step on. An unobserved step is one
graph. An observed step is one graph too when it is `stamped`: the graph writes the GPU clock into the
state's `stamps` ([stages + 1] int64) before the first stage and after each one (`ddtree.kernels.clock`),
`finish` reads them after the last, and a replay calls no stage hooks. Without stamps (no Triton) an observed
step is one graph per stage, so that the observer's host-side stage marks fall between replays.
"""

from __future__ import annotations

import gc
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import torch

from ddtree.kernels.clock import stamp
from ddtree.observer import NOOP, StepObserver

CUDA_GRAPHS = ("auto", "on", "off")


class Stamped(Protocol):
    stamps: torch.Tensor | None  # [stages + 1] int64, the device clock; the runner's, when it stamps


S = TypeVar("S", bound=Stamped)


def use_cuda_graphs(mode: str, device: torch.device) -> bool:
    """`auto`: on for CUDA devices; `on`: required (an error elsewhere); `off`: never."""
    if mode not in CUDA_GRAPHS:
        raise ValueError(f"cuda_graphs must be one of {', '.join(CUDA_GRAPHS)}, got {mode!r}")
    if mode == "on":
        require_cuda(device)
    return mode == "on" or (mode == "auto" and device.type == "cuda")


def require_cuda(device: torch.device) -> None:
    """ValueError unless `device` is a CUDA device: graphs capture CUDA kernels only."""
    if device.type != "cuda":
        raise ValueError(f"CUDA graphs need a CUDA device; the target is on {device}")


@dataclass
class _Captured(Generic[S]):
    graphs: list[Any]  # torch.cuda.CUDAGraph, one for the step or one per stage
    state: S  # the graphs' static inputs and outputs
    per_stage: bool  # one graph per stage, replayed between the observer's stage hooks


class StepRunner(Generic[S]):
    """Runs `stages` (name, function) and then `finish` for a step shape `key`, with the observer's stage hooks
    around the stages (`finish` counts as part of the last stage) unless the step replays a stamped graph.
    `after_stage(name, state)` runs after each stage that ran or replayed between the hooks, before its end
    hook: where the caller shows the observer a stage's output."""

    def __init__(
        self,
        stages: list[tuple[str, Callable[[S], None]]],
        observer: StepObserver,
        cuda_graphs: bool,
        finish: Callable[[S], None],
        stamped: bool = False,
        device: torch.device | str = "cuda",
        after_stage: Callable[[str, S], None] | None = None,
    ) -> None:
        self.stages = stages
        self.device = device  # where the stamps live
        self.observer = observer
        self.cuda_graphs = cuda_graphs
        self.finish = finish
        self.after_stage = after_stage
        self.stamped = stamped and cuda_graphs  # graphs time their stages on the device
        self.per_stage = observer is not NOOP and not self.stamped
        self.captured: dict[tuple[Any, ...], _Captured[S]] = {}
        self.shapes: set[tuple[Any, ...]] = set()  # every key run so far

    def is_new(self, key: tuple[Any, ...]) -> bool:
        """Whether no step of shape `key` has run yet: the next one runs eagerly (compiling what is compiled
        per shape) and, with graphs, captures."""
        return key not in self.shapes

    def run(self, key: tuple[Any, ...], make: Callable[[], S], make_captured: Callable[[], S] | None = None) -> S:
        """One step of shape `key`; `make` makes a fresh state of that shape (for the eager step and, once,
        for the graphs to own; `make_captured`, where given, makes the graphs' one instead)."""
        self.shapes.add(key)
        entry = self.captured.get(key) if self.cuda_graphs else None
        if entry is None:
            state = self._eager(make())
            if self.cuda_graphs:
                self.captured[key] = self._capture((make_captured or make)())
            return state
        if not entry.per_stage:
            entry.graphs[0].replay()
            return entry.state
        return self._observed(entry.state, [_replay(graph) for graph in entry.graphs])

    def captured_state(self, key: tuple[Any, ...]) -> S | None:
        """The state the graphs of `key` replay on, once captured."""
        entry = self.captured.get(key)
        return None if entry is None else entry.state

    def _eager(self, state: S) -> S:
        runs = [stage for _, stage in self.stages]
        return self._observed(state, [*runs[:-1], _then(runs[-1], self.finish)])

    def _observed(self, state: S, runs: list[Callable[[S], None]]) -> S:
        """Run each stage (`runs[i]` does stage i's work on `state`) between the observer's stage hooks."""
        obs = self.observer
        for (name, _), run in zip(self.stages, runs, strict=True):
            obs.on_stage_start(name)
            run(state)
            if self.after_stage is not None:
                self.after_stage(name, state)
            obs.on_stage_end(name)
        return state

    def _groups(self) -> list[list[Callable[[S], None]]]:
        """What each graph runs: a stage each, or the whole step (with its stamps when stamped)."""
        runs = [stage for _, stage in self.stages]
        if self.per_stage:
            return [[run] for run in runs[:-1]] + [[runs[-1], self.finish]]
        if not self.stamped:
            return [[*runs, self.finish]]
        timed: list[Callable[[S], None]] = [_stamper(0)]  # the step's start, then each stage's end
        for i, run in enumerate(runs):
            timed += [run, _stamper(i + 1)]
        return [[*timed, self.finish]]

    def _capture(self, state: S) -> _Captured[S]:
        if self.stamped:
            self._prepare_stamps(state)
        torch.cuda.synchronize()  # the warm-up step has finished before capture starts
        pool = torch.cuda.graph_pool_handle()
        graphs = []
        with _no_collection():
            for group in self._groups():
                graph = torch.cuda.CUDAGraph()
                with warnings.catch_warnings():  # a stage with no device work (ar's draft) makes an empty graph
                    warnings.filterwarnings("ignore", message="The CUDA Graph is empty")
                    with torch.cuda.graph(graph, pool=pool):
                        for stage in group:
                            stage(state)
                graphs.append(graph)
        return _Captured(graphs=graphs, state=state, per_stage=self.per_stage)

    def _prepare_stamps(self, state: S) -> None:
        """The stamps' static buffer, and the stamp kernel compiled before capture. Where it cannot run (a GPU
        without NVIDIA's PTX), observed steps fall back to a graph per stage: telemetry never stops decoding."""
        try:
            stamps = torch.zeros(len(self.stages) + 1, dtype=torch.int64, device=self.device)  # [stages + 1]
            for i in range(len(self.stages) + 1):
                stamp(stamps, i)
            state.stamps = stamps
        except Exception as exc:  # any failure of the clock kernel means: no device stamps
            message = f"ddtree: no device clock stamps ({exc}); stage times come from events between graphs"
            warnings.warn(message, RuntimeWarning, stacklevel=2)
            state.stamps = None
            self.stamped, self.per_stage = False, True


def _replay(graph: Any) -> Callable[[Any], None]:
    """A stage that replays `graph` (its state is the one it was captured on)."""

    def run(_: Any) -> None:
        graph.replay()

    return run


def _then(first: Callable[[S], None], second: Callable[[S], None]) -> Callable[[S], None]:
    """`first`, then `second`, as one stage."""

    def run(state: S) -> None:
        first(state)
        second(state)

    return run


@contextmanager
def _no_collection() -> Iterator[None]:
    """No collection of Python's garbage until the block ends (around a capture). A graph that a dropped
    session left in a reference cycle is destroyed when the collector frees it, and destroying a graph while a
    stream captures is an error that fails the capture. (torch's own capture no longer collects first.)"""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _stamper(index: int) -> Callable[[Stamped], None]:
    """A stage that writes the GPU clock into `state.stamps[index]`."""

    def run(state: Stamped) -> None:
        assert state.stamps is not None, "stamps are prepared before a stamped capture"
        stamp(state.stamps, index)

    return run


Tensors = dict[str, torch.Tensor]


class GraphCache:
    """Runs a function of a few input tensors: eagerly the first time per key, as a CUDA graph replay after.

    `fn` reads its inputs from a dict of tensors and writes its outputs into it. The first call of a key runs it eagerly
    on the caller's inputs (the warm-up), then captures it on clones of them, which become the graph's input
    buffers: later calls copy their inputs in and replay. The graphs share one memory pool, so a call's
    outputs are valid until the next call.
    """

    def __init__(self, cuda_graphs: bool) -> None:
        self.cuda_graphs = cuda_graphs
        self.captured: dict[tuple[Any, ...], tuple[Any, Tensors]] = {}
        self.pool: Any = None

    def run(self, key: tuple[Any, ...], fn: Callable[[Tensors], None], inputs: Tensors) -> Tensors:
        entry = self.captured.get(key) if self.cuda_graphs else None
        if entry is not None:
            graph, static = entry
            for name, value in inputs.items():
                static[name].copy_(value)
            graph.replay()
            return static
        tensors = dict(inputs)
        fn(tensors)
        if self.cuda_graphs:
            self.captured[key] = self._capture(fn, {name: value.clone() for name, value in inputs.items()})
        return tensors

    def _capture(self, fn: Callable[[Tensors], None], static: Tensors) -> tuple[Any, Tensors]:
        torch.cuda.synchronize()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with _no_collection(), torch.cuda.graph(graph, pool=self.pool):
            fn(static)
        return graph, static
