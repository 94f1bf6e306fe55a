"""Run a decode step's stages eagerly or as CUDA graph replays.

A step is a list of stages, each a function that reads and writes a dict of tensors (the "bag"), then a
`finish` that assembles what the host reads back. All state that lives across steps sits in the session's own
preallocated tensors, which the stages update in place, so a graph captured once per step shape replays any
later step of that shape.

The first step of a shape runs eagerly, between the observer's stage hooks: it is a real step and the warm-up
that capture needs. The graphs are captured right after it (capture records kernels without running them, so
the state stays as the eager step left it) and replayed from the next step on. An unobserved step is one
graph. An observed step is one graph too when it is `stamped`: the graph writes the GPU clock into the bag's
`stamps` ([stages + 1] int64) before the first stage and after each one (`ddtree.kernels.clock`), `finish`
reads them after the last, and a replay calls no stage hooks. Without stamps (no Triton) an observed step is
one graph per stage, so that the observer's host-side stage marks fall between replays.
"""

from __future__ import annotations

import gc
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from ddtree.kernels.clock import stamp
from telemetry import semconv
from telemetry.hooks import NOOP, StepObserver

Bag = dict[str, Any]
Stage = Callable[[Bag], None]


@dataclass
class _Captured:
    graphs: list[Any]  # torch.cuda.CUDAGraph, one for the step or one per stage
    bag: Bag  # the graphs' static inputs and outputs
    per_stage: bool  # one graph per stage, replayed between the observer's stage hooks


class StepRunner:
    """Runs `stages` (name, function) and then `finish` for a step shape `key`, with the observer's stage hooks
    around the stages (`finish` counts as part of the last stage) unless the step replays a stamped graph."""

    def __init__(
        self,
        stages: list[tuple[str, Stage]],
        observer: StepObserver,
        cuda_graphs: bool,
        finish: Stage,
        stamped: bool = False,
        device: torch.device | str = "cuda",
    ) -> None:
        self.stages = stages
        self.device = device  # where the stamps live
        self.observer = observer
        self.cuda_graphs = cuda_graphs
        self.finish = finish
        self.stamped = stamped and cuda_graphs  # graphs time their stages on the device
        self.per_stage = observer is not NOOP and not self.stamped
        self.captured: dict[tuple[Any, ...], _Captured] = {}
        self.shapes: set[tuple[Any, ...]] = set()  # every key run so far

    def is_new(self, key: tuple[Any, ...]) -> bool:
        """Whether no step of shape `key` has run yet: the next one runs eagerly (compiling what is compiled
        per shape) and, with graphs, captures."""
        return key not in self.shapes

    def run(self, key: tuple[Any, ...], constants: Bag) -> Bag:
        """One step. `constants` (host values baked into the shape, part of `key`) seed the bag."""
        self.shapes.add(key)
        entry = self.captured.get(key) if self.cuda_graphs else None
        if entry is None:
            bag = self._eager(dict(constants))
            if self.cuda_graphs:
                self.captured[key] = self._capture(dict(constants))
            return bag
        if not entry.per_stage:
            entry.graphs[0].replay()
            return entry.bag
        return self._observed(entry.bag, [_replay(graph) for graph in entry.graphs])

    def _eager(self, bag: Bag) -> Bag:
        runs = [stage for _, stage in self.stages]
        return self._observed(bag, [*runs[:-1], _then(runs[-1], self.finish)])

    def _observed(self, bag: Bag, runs: list[Stage]) -> Bag:
        """Run each stage (`runs[i]` does stage i's work on `bag`) between the observer's stage hooks."""
        obs = self.observer
        for (name, _), run in zip(self.stages, runs, strict=True):
            obs.on_stage_start(name)
            run(bag)
            if name == semconv.STAGE_TREE_BUILD:
                obs.on_tree(bag["tree"])
            obs.on_stage_end(name)
        return bag

    def _groups(self) -> list[list[Stage]]:
        """What each graph runs: a stage each, or the whole step (with its stamps when stamped)."""
        runs = [stage for _, stage in self.stages]
        if self.per_stage:
            return [[run] for run in runs[:-1]] + [[runs[-1], self.finish]]
        if not self.stamped:
            return [[*runs, self.finish]]
        timed = [_stamper(0)]  # the step's start, then each stage's end
        for i, run in enumerate(runs):
            timed += [run, _stamper(i + 1)]
        return [[*timed, self.finish]]

    def _capture(self, bag: Bag) -> _Captured:
        if self.stamped:
            self._prepare_stamps(bag)
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
                            stage(bag)
                graphs.append(graph)
        return _Captured(graphs=graphs, bag=bag, per_stage=self.per_stage)

    def _prepare_stamps(self, bag: Bag) -> None:
        """The stamps' static buffer, and the stamp kernel compiled before capture. Where it cannot run (a GPU
        without NVIDIA's PTX), observed steps fall back to a graph per stage: telemetry never stops decoding."""
        try:
            bag["stamps"] = torch.zeros(len(self.stages) + 1, dtype=torch.int64, device=self.device)  # [stages + 1]
            for i in range(len(self.stages) + 1):
                stamp(bag["stamps"], i)
        except Exception as exc:  # any failure of the clock kernel means: no device stamps
            message = f"ddtree: no device clock stamps ({exc}); stage times come from events between graphs"
            warnings.warn(message, RuntimeWarning, stacklevel=2)
            bag.pop("stamps", None)
            self.stamped, self.per_stage = False, True


def _replay(graph: Any) -> Stage:
    """A stage that replays `graph` (its bag is the one it was captured on)."""

    def run(_: Bag) -> None:
        graph.replay()

    return run


def _then(first: Stage, second: Stage) -> Stage:
    """`first`, then `second`, as one stage."""

    def run(bag: Bag) -> None:
        first(bag)
        second(bag)

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


def _stamper(index: int) -> Stage:
    """A stage that writes the GPU clock into `bag["stamps"][index]`."""

    def run(bag: Bag) -> None:
        stamp(bag["stamps"], index)

    return run


class GraphCache:
    """Runs a function of a few input tensors: eagerly the first time per key, as a CUDA graph replay after.

    `fn` reads its inputs from a bag and writes its outputs into it. The first call of a key runs it eagerly
    on the caller's inputs (the warm-up), then captures it on clones of them, which become the graph's input
    buffers: later calls copy their inputs in and replay. The graphs share one memory pool, so a call's
    outputs are valid until the next call.
    """

    def __init__(self, cuda_graphs: bool) -> None:
        self.cuda_graphs = cuda_graphs
        self.captured: dict[tuple[Any, ...], tuple[Any, Bag]] = {}
        self.pool: Any = None

    def run(self, key: tuple[Any, ...], fn: Stage, inputs: dict[str, torch.Tensor]) -> Bag:
        entry = self.captured.get(key) if self.cuda_graphs else None
        if entry is not None:
            graph, static = entry
            for name, value in inputs.items():
                static[name].copy_(value)
            graph.replay()
            return static
        bag: Bag = dict(inputs)
        fn(bag)
        if self.cuda_graphs:
            self.captured[key] = self._capture(fn, {name: value.clone() for name, value in inputs.items()})
        return bag

    def _capture(self, fn: Stage, static: Bag) -> tuple[Any, Bag]:
        torch.cuda.synchronize()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with _no_collection(), torch.cuda.graph(graph, pool=self.pool):
            fn(static)
        return graph, static
