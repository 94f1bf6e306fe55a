"""Zero sync: no telemetry hook reads device data on the host or waits for the device, whoever calls.

`tests.telemetry.sync_guard` watches every hook call while the real engine runs. Observers that dodge in
every way a reviewer found (a stdlib function iterating a tensor, a blocking copy, a sync behind
`torch.cuda.is_available()`, a tensor kept for a later hook, a read from a module outside `telemetry`)
must all be caught, and the real collector, with every sink, must not be.
"""

from __future__ import annotations

import json
import os
import statistics
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ddtree.engine.engine import Engine
from ddtree.kernels.clock import stamps_available
from ddtree.observer import StepObserver
from ddtree.settings import GenerationConfig
from telemetry import TelemetryConfig, start_telemetry
from telemetry import semconv as sc
from telemetry.collector import Collector
from tests.helpers import random_prompts, tiny_hybrid_pair, tiny_pair
from tests.telemetry.helpers import captured_telemetry
from tests.telemetry.sync_guard import GuardedObserver, SyncGuard

DEVICE = os.environ.get("DDTREE_TEST_DEVICE", "cpu")
HOOKS = {
    "on_session",
    "on_generate_start",
    "on_step_start",
    "on_stage_start",
    "on_stage_end",
    "on_tree",
    "on_probe",
    "on_accept",
    "on_step_end",
    "on_generate_end",
}


def _run(
    observer: StepObserver,
    method: str = "ddtree",
    depth: int = 1,
    temperature: float = 0.0,
    wrap: type[GuardedObserver] = GuardedObserver,
    hybrid: str | None = None,
) -> SyncGuard:
    """Decode a small batch with `observer` behind a guard (`wrap`), on a tiny Llama or a tiny hybrid of that
    kind; return the guard."""
    if hybrid:
        target, drafter = tiny_hybrid_pair(hybrid, 0, vocab=16, block_size=5)
    else:
        target, drafter = tiny_pair(0, vocab=16, block_size=5)
    guard = SyncGuard()
    engine = Engine(target, drafter, observer=wrap(observer, guard), pipeline_depth=depth)
    config = GenerationConfig(method=method, budget=8, temperature=temperature, seed=3, max_new_tokens=12)
    engine.generate(random_prompts(0, 3, vocab=16), config)
    return guard


@pytest.mark.parametrize(
    ("method", "depth", "temperature"),
    [("ddtree", 1, 0.0), ("ddtree", 2, 0.0), ("dflash", 1, 0.8), ("ar", 2, 0.0), ("ddtree", 1, 1.5)],
)
def test_the_collector_and_its_sinks_make_no_host_reads(method: str, depth: int, temperature: float) -> None:
    captured = captured_telemetry()
    guard = _run(captured.collector, method, depth, temperature)
    assert guard.violations == []
    assert set(guard.calls) == HOOKS, "every hook ran under the guard"
    assert captured.log_lines() and captured.spans.get_finished_spans(), "the sinks ran"
    steps = [line for line in captured.log_lines() if line["event"] == sc.EVENT_STEP]
    assert all(sc.FIELD_ACCEPTED_RANKS in s for s in steps), "the accepted ranks rode the readback, unguarded"


@pytest.mark.parametrize("kind", ["qwen3_5", "bamba"])
def test_on_hybrid_targets_the_hooks_make_no_host_reads(kind: str) -> None:
    """The state commit is part of the accept stage; no hook reads what it commits."""
    captured = captured_telemetry()
    guard = _run(captured.collector, "ddtree", 1, 0.0, hybrid=kind)
    assert guard.violations == [] and set(guard.calls) == HOOKS


def test_with_a_handoff_thread_the_hooks_make_no_host_reads() -> None:
    """The hooks only post records; the thread resolves them outside every hook."""
    captured = captured_telemetry(handoff=True)
    guard = _run(captured.collector, "ddtree", 2, 0.0)
    assert captured.collector.flush(timeout_s=30)
    captured.collector.close()
    assert guard.violations == []
    assert set(guard.calls) == HOOKS, "every hook ran under the guard"
    assert captured.log_lines() and captured.spans.get_finished_spans(), "the sinks ran"


class _WithoutProbes(GuardedObserver):
    """A loop that reads back no probe, as SGLang's worker drives the collector: it calls neither `on_session`
    nor `on_probe`, so the collector copies the tree's arrays itself in `on_tree`."""

    def on_session(self, stamped: bool) -> None:
        pass

    def on_probe(self, step: int, probe: Any) -> None:
        pass


def test_the_collector_copies_the_tree_itself_without_host_reads() -> None:
    captured = captured_telemetry()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        guard = _run(captured.collector, wrap=_WithoutProbes)
    assert guard.violations == []
    assert not [w for w in caught if "ddtree telemetry" in str(w.message)], "a sink failed and was dropped"
    assert guard.calls["on_tree"] > 0 and "on_probe" not in guard.calls
    steps = [line for line in captured.log_lines() if line["event"] == sc.EVENT_STEP]
    assert steps and any(sum(s["nodes_per_depth"]) > 0 for s in steps), "the tree reached the step logs"
    assert not any(sc.FIELD_ACCEPTED_RANKS in s for s in steps), "no probe, no ranks: none made up"


def test_the_deployed_observer_makes_no_host_reads(tmp_path: Path) -> None:
    """As `DDTREE_DEBUG_METRICS=1` runs it: the collector hands records to the exporter process."""
    log = tmp_path / "steps.jsonl"
    telemetry = start_telemetry(
        TelemetryConfig(enabled=True, traces_exporter="none", metrics_exporter="none", log_file=str(log))
    )
    try:
        guard = _run(telemetry.observer, depth=2)
    finally:
        telemetry.shutdown()
    assert guard.violations == []
    steps = [json.loads(line) for line in log.read_text().splitlines()]
    assert any(s["event"] == sc.EVENT_STEP for s in steps)


def _blocking_copy(t: torch.Tensor) -> object:
    return torch.empty(t.shape, dtype=t.dtype).copy_(t)


def _sync_if_cuda(_: torch.Tensor) -> object:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return None


DODGES: dict[str, tuple[Callable[[torch.Tensor], object], str]] = {
    "item": (lambda t: t[0, 0].item(), "scalar read"),
    "int": (lambda t: int(t[0, 1]), "scalar read"),
    "float": (lambda t: float(t[0, 1]), "scalar read"),
    "bool": (lambda t: bool((t > 0).any()), "scalar read"),
    "index-a-list": (lambda t: list(range(99))[t[0, 1]], "scalar read"),
    "statistics-fmean": (lambda t: statistics.fmean(t[0]), "scalar read"),
    "torch-equal": (lambda t: torch.equal(t, t), "scalar read"),
    "mask": (lambda t: t[t > 0], "data-dependent shape"),
    "nonzero": (lambda t: t.nonzero(), "data-dependent shape"),
    "tolist": (lambda t: t.tolist(), "Tensor.tolist"),
    "numpy": (lambda t: t.numpy(), "Tensor.numpy"),
    "np-asarray": (lambda t: np.asarray(t), "Tensor.__array__"),
    "cpu": (lambda t: t.cpu(), "Tensor.cpu"),
    "to-cpu": (lambda t: t.to("cpu"), "blocking device-to-host aten::to"),
    "to-a-host-tensor": (lambda t: t.to(torch.zeros(1)), "blocking device-to-host aten::to"),
    "blocking-copy": (_blocking_copy, "blocking device-to-host aten::copy_"),
    "f-string": (lambda t: f"{t}", "Tensor.__format__"),
    "synchronize-behind-is-available": (_sync_if_cuda, "synchronize"),
}


class _Dodger(Collector):
    """The real collector plus one host read of the tree's depths, in `on_tree` or, on a tensor kept from
    `on_tree`, in `on_step_end`."""

    def __init__(self, dodge: Callable[[torch.Tensor], object], later: bool) -> None:
        super().__init__([], "cpu")
        self.dodge, self.later = dodge, later
        self.kept: torch.Tensor | None = None

    def on_tree(self, tree: Any) -> None:
        super().on_tree(tree)
        if self.later:
            self.kept = tree.depths
        else:
            self.dodge(tree.depths)

    def on_step_end(self, step: int, emitted: list[int]) -> None:
        if self.kept is not None:
            self.dodge(self.kept)
            self.kept = None
        super().on_step_end(step, emitted)


@pytest.mark.parametrize("later", [False, True], ids=["in-the-hook", "kept-for-a-later-hook"])
@pytest.mark.parametrize("name", list(DODGES))
def test_every_dodge_is_caught(name: str, later: bool) -> None:
    if name == "numpy" and DEVICE != "cpu":
        pytest.skip("a device tensor has no numpy view: reading it takes .cpu() first, the `cpu` dodge")
    dodge, expected = DODGES[name]
    guard = _run(_Dodger(dodge, later))
    assert guard.violations, f"{name} was not caught"
    if DEVICE == "cpu":  # on a GPU the dispatch mode sees .cpu(), .tolist() or np.asarray as the copy they make
        assert any(expected in v for v in guard.violations), guard.violations[:3]
    assert all("test_zero_sync.py" in v for v in guard.violations), "the report names the line that read"


def test_a_sink_that_syncs_is_caught() -> None:
    """Sinks run inside hooks (the collector hands records on from them), so they are watched too."""

    class Syncing:
        def start_requests(self, info: Any) -> None:
            pass

        def step(self, stats: Any) -> None:
            _sync_if_cuda(torch.zeros(1))

        def end_requests(self, info: Any, results: Any) -> None:
            pass

    guard = _run(Collector([Syncing()], "cpu"))
    assert any("synchronize" in v for v in guard.violations)


@pytest.mark.parametrize("owner", [torch.cuda.Event, torch.cuda.Stream])
def test_event_and_stream_synchronize_are_caught(owner: Any) -> None:
    guard = SyncGuard()
    with guard.watch("on_step_end"):
        if guard.cuda:
            owner().synchronize()
        else:  # no CUDA: the patched method is all there is to call
            owner.synchronize(None)
    assert len(guard.violations) == 1 and f"{owner.__name__}.synchronize" in guard.violations[0]


def test_nothing_is_flagged_outside_hooks_or_for_host_buffers() -> None:
    guard = SyncGuard()
    tagged = guard.tag(torch.arange(4))
    assert tagged.tolist() == [0, 1, 2, 3]  # outside a hook: the engine's own reads are not telemetry's
    with guard.watch("on_tree"):
        host = torch.empty(4, dtype=torch.long)
        host.copy_(tagged, non_blocking=True)  # the collector's way
        assert host.numpy().sum() == 6  # a host buffer, read on the host
    assert guard.violations == []


@pytest.mark.skipif(DEVICE != "cuda", reason="the graphed decode path needs CUDA (torch.cuda.CUDAGraph)")
def test_the_graphed_path_makes_no_host_reads() -> None:
    captured = captured_telemetry()
    target, drafter = tiny_pair(0, vocab=16, block_size=5)
    guard = SyncGuard()
    engine = Engine(target, drafter, observer=GuardedObserver(captured.collector, guard), cuda_graphs="on")
    for _ in range(2):  # the first call captures, the second replays
        engine.generate(random_prompts(0, 3, vocab=16), GenerationConfig(budget=8, max_new_tokens=12))
    assert guard.violations == []
    assert set(guard.calls) == HOOKS
    if stamps_available(target.device):  # one graph a step, its stages timed on the device: no stage hooks
        steps, stages = guard.calls["on_step_start"], guard.calls["on_stage_start"]
        assert stages < len(sc.STAGES) * steps, "replayed steps got stage hooks"
        steps_logged = [line for line in captured.log_lines() if line["event"] == sc.EVENT_STEP]
        assert steps_logged and all(set(line[sc.FIELD_STAGE_MS]) == set(sc.STAGES) for line in steps_logged)
        assert all(ms >= 0 for line in steps_logged for ms in line[sc.FIELD_STAGE_MS].values())
