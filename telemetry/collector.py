"""The zero-sync collector: a `StepObserver` that turns hook calls into per-step statistics.

Values already on the host (accepted counts, emitted counts) are used as they are. Device values (the
tree's node depths) are copied with `non_blocking=True` into pinned buffers behind a recorded event, and
stage times are CUDA events; a step's record is resolved only once its last event has completed, at a
later hook call. Nothing here calls `.item()`, `.tolist()`, `.cpu()` or a synchronize during a step.
Resolved `StepStats` go to sinks (metrics, logs, traces), which never touch the device.

Where the host time goes: records are resolved and handed to the sinks eight at a time, once a verify
stage has been launched, so on a GPU that is busy verifying that work overlaps the verify forward instead
of adding to the idle time between steps. Consecutive stages share their boundary mark (5 marks a step),
and events and pinned buffers are reused.

A decode session (`on_session`) reads back a probe with each step's tokens (`on_probe`): the tree's arrays
and the accepted path's ranks (computed on the device) come with it, so `on_tree` copies nothing; a loop
without probes (SGLang's worker) gives no ranks, and its records have none. In a stamped session a step
replayed from a graph brings its stage times too, as GPU clock stamps: it gets no stage hooks, records no
event, and is ready as soon as it ends (its data is on the host). Its times are the host wall time taken at
`on_step_start` plus the stamps' offsets from the first one. `on_step_start` cannot tell such a step from
the eager first step of a shape, which does get stage hooks, so in a stamped session a step's first mark is
taken at its first stage hook.
Stamped records are resolved and handed on `STAMPED_DRAIN_EVERY` at a time, at a step start.

With `handoff` (what `start_telemetry` sets on CUDA), none of that runs on the decode thread: a step's end
posts its record to `telemetry.handoff`'s thread, which waits for its marks, resolves it and calls the sinks
while the decode thread waits for the device; requests starting and ending reach the sinks the same way, in
order. `flush` waits for that thread, `close` stops it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from ddtree.observer import GenerateInfo, RequestResult, StepProbe
from telemetry import semconv as sc
from telemetry.handoff import HandOff
from telemetry.stats import StatsSink, StepStats, call_sinks
from telemetry.timing import StageClock, clock_for

if TYPE_CHECKING:
    from ddtree.accept import AcceptResult
    from ddtree.methods import TreeShape
    from ddtree.tree import DraftTree


@dataclass
class _Pending:
    step: int
    info: GenerateInfo | None  # the requests' settings when the step started
    wall_ns: int
    marks: list[Any]
    stages: dict[str, tuple[int, int]] = field(default_factory=dict)  # stage -> mark indices
    depths: torch.Tensor | None = None  # [batch, nodes] host copy of the tree's depths, filled asynchronously
    tree: dict[str, torch.Tensor] = field(default_factory=dict)  # tokens, parents (log_probs): host copies too
    probe: StepProbe | None = None  # the tree's arrays (and stamps) read back with the step's tokens
    accepted: list[int] = field(default_factory=list)
    emitted: list[int] = field(default_factory=list)
    slot_ids: list[str | None] = field(default_factory=list)  # each slot's request when the step started
    rows: int = 0  # rows the step ran
    warmup: bool = False  # the step compiled or captured
    gain: float | None = None  # an adaptive step's predicted gain (`on_width`)


DRAIN_EVERY = 8  # records are resolved in groups: the same code run eight times in a row, with warm caches
MAX_PENDING = 16  # records left unresolved before a step start resolves them (when no verify stage ran)
STAMPED_DRAIN_EVERY = 32  # in a stamped session: records left before a step start resolves them


class Collector:
    """Implements `ddtree.observer.StepObserver`."""

    def __init__(
        self,
        sinks: list[StatsSink],
        device_type: str = "cpu",
        handoff: bool = False,
        dropped: Callable[[int], None] | None = None,
    ) -> None:
        self.sinks = sinks
        self.dropped = dropped or (lambda step: None)  # a step record the hand-off thread had no room for
        self.handoff = HandOff() if handoff else None  # the thread that resolves records and calls the sinks
        self.tree_fields = ("tokens", "parents", "log_probs")
        self.clock: StageClock = clock_for(device_type)
        self.pinned = device_type == "cuda"
        self.info: GenerateInfo | None = None  # the latest requests' settings (one session: one method)
        self.infos: dict[str, GenerateInfo] = {}  # request id -> the info it joined with
        self.slot_ids: list[str | None] = []  # slot -> its request, while it is in the session
        self.pending: deque[_Pending] = deque()
        self.current: _Pending | None = None  # the step started last: stage marks and the tree go to it
        self.started: dict[int, _Pending] = {}  # steps started and not yet ended (two when pipelined)
        self.open_stage: tuple[str, int] | None = None
        self.boundary: int | None = None  # index of the mark the next stage starts at, if one is due
        self.host_buffers: dict[tuple[int, ...], list[torch.Tensor]] = {}
        self.tree_buffers: dict[tuple[Any, ...], list[torch.Tensor]] = {}  # (shape, dtype) -> free host buffers
        self.probed = False  # steps bring their tree in `on_probe` (set by `on_session`)
        self.stamped = False  # steps replayed from a graph bring device stamps and get no stage hooks
        self.drain_at = MAX_PENDING  # records pending when a step start resolves them

    def on_session(self, stamped: bool) -> None:
        """Probes from now on; with `stamped`, marks are taken lazily (see the module docstring)."""
        self.probed, self.stamped = True, stamped
        self.drain_at = STAMPED_DRAIN_EVERY if stamped else MAX_PENDING

    def on_generate_start(self, info: GenerateInfo) -> None:
        self.info = info
        slots = info.slots if info.slots is not None else list(range(len(info.request_ids)))
        for rid, slot in zip(info.request_ids, slots, strict=True):
            self.infos[rid] = info
            self.slot_ids.extend([None] * (slot + 1 - len(self.slot_ids)))
            self.slot_ids[slot] = rid
        self._to_sinks("start_requests", info)

    def assign_slots(self, request_ids: list[str | None]) -> None:
        """Name the request in each row of the step that starts next, for a server whose batch rows move
        between steps (SGLang filters and merges its running batch): row i holds `request_ids[i]`, whatever
        slot it joined with."""
        self.slot_ids = list(request_ids)

    def on_step_start(self, step: int, batch_size: int, warmup: bool = False, shape: TreeShape | None = None) -> None:
        if len(self.pending) >= self.drain_at:
            self._drain()
        slots = self._slots(batch_size)
        info = self._step_info(shape)
        self.current = _Pending(
            step=step, info=info, wall_ns=time.time_ns(), marks=[], slot_ids=slots, rows=batch_size, warmup=warmup
        )
        self.started[step] = self.current
        self.boundary = None  # stamped: no mark unless a stage hook comes (the step runs eagerly)
        if not self.stamped:
            self.clock.begin_step()
            self.current.marks.append(self.clock.mark())
            self.boundary = 0

    def _step_info(self, shape: TreeShape | None) -> GenerateInfo | None:
        """The settings a step ran with: the requests', with the tree the step verified where it was named (a
        session whose budget follows the load)."""
        info = self.info
        if info is None or shape is None:
            return info
        return info.with_tree(shape.method, shape.budget, shape.topk)

    def on_width(self, step: int, shape: TreeShape, gain: float) -> None:
        """An adaptive step's tree: the step record's budget is the width it verified."""
        record = self.started.get(step)
        if record is not None:
            record.info = self._step_info(shape)
            record.gain = gain

    def on_stage_start(self, stage: str) -> None:
        assert self.current is not None
        if self.boundary is None:
            if not self.current.marks:  # a stamped session's eager step: its first mark
                self.clock.begin_step()
            self.current.marks.append(self.clock.mark())
            self.boundary = len(self.current.marks) - 1
        self.open_stage = (stage, self.boundary)
        self.boundary = None

    def on_stage_end(self, stage: str) -> None:
        assert self.current is not None and self.open_stage is not None
        self.current.marks.append(self.clock.mark())
        self.boundary = len(self.current.marks) - 1
        self.current.stages[stage] = (self.open_stage[1], self.boundary)
        self.open_stage = None
        if stage == sc.STAGE_VERIFY and len(self.pending) >= DRAIN_EVERY:
            self._drain()  # earlier steps, while the device verifies this one

    def on_tree(self, tree: DraftTree) -> None:
        """Non-blocking copies and nothing else on the device: the root and padding have depth 0, so the host
        counts the draft nodes per depth from the depths alone. The tokens and parents let the exporter find
        each accepted path's node indices from the request's output tokens (for the budget replay), and the
        log-probabilities give the drafter's prediction (`StepStats.predicted`). Nothing in a session: the
        probe brings them."""
        assert self.current is not None
        if self.probed:
            return
        free = self.host_buffers.setdefault(tuple(tree.depths.shape), [])
        host = free.pop() if free else torch.empty(tree.depths.shape, dtype=tree.depths.dtype, pin_memory=self.pinned)
        host.copy_(tree.depths, non_blocking=True)
        self.current.depths = host
        for name in self.tree_fields:
            self.current.tree[name] = self._host_copy(getattr(tree, name))

    def _host_copy(self, t: torch.Tensor) -> torch.Tensor:
        """`t` copied without blocking into a reused host buffer (pinned on CUDA)."""
        free = self.tree_buffers.setdefault((tuple(t.shape), t.dtype), [])
        host = free.pop() if free else torch.empty(t.shape, dtype=t.dtype, pin_memory=self.pinned)
        host.copy_(t, non_blocking=True)
        return host

    def _release(self, record: _Pending) -> None:
        """The record's host buffers go back to their pools."""
        if record.depths is not None:
            self.host_buffers[tuple(record.depths.shape)].append(record.depths)
        for host in record.tree.values():
            self.tree_buffers[(tuple(host.shape), host.dtype)].append(host)
        record.tree = {}

    def on_probe(self, step: int, probe: StepProbe) -> None:
        """Host arrays already: kept as they are, read when the record is resolved."""
        self.started[step].probe = probe

    def on_accept(self, step: int, result: AcceptResult, accepted: list[int]) -> None:
        self.started[step].accepted = accepted

    def on_step_end(self, step: int, emitted: list[int]) -> None:
        record = self.started.pop(step)
        record.emitted = emitted
        if record is self.current:
            if self.boundary is None and record.marks:  # the last stage is still open: the step ends now
                record.marks.append(self.clock.mark())
            self.current = None
            self.boundary = None
        if not any(emitted):  # a step launched ahead while its requests finished: no request decoded in it
            self.clock.release(record.marks)
            self._release(record)
        elif self.handoff is not None:
            if not self.handoff.post(self._finish, record, droppable=True):
                self.dropped(record.step)
        else:
            self.pending.append(record)

    def on_generate_end(self, results: list[RequestResult]) -> None:
        """Requests leave. Their steps have all been read by the engine, so the wait for the marks still pending
        takes microseconds at most; then each group of requests that joined together ends with its info."""
        self._drain(wait=True)
        groups: dict[int, tuple[GenerateInfo, list[RequestResult]]] = {}
        for result in results:
            info = self.infos.pop(result.request_id)
            groups.setdefault(id(info), (info, []))[1].append(result)
            self.slot_ids = [None if rid == result.request_id else rid for rid in self.slot_ids]
        for info, group in groups.values():
            self._to_sinks("end_requests", _only(info, [r.request_id for r in group]), group)
        if not self.infos:
            self.info = None

    def _slots(self, batch_size: int) -> list[str | None]:
        """Each slot's request now, `batch_size` slots."""
        ids = self.slot_ids[:batch_size]
        return ids + [None] * (batch_size - len(ids))

    def _ready(self, record: _Pending) -> bool:
        """Whether the record's marks can be read; a stamped record has none and is ready at once."""
        return not record.marks or self.clock.ready(record.marks)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until the sinks have every call made so far (at once without `handoff`); False on a timeout."""
        return self.handoff is None or self.handoff.flush(timeout_s)

    def close(self, timeout_s: float | None = None) -> None:
        """Hand on what is posted and stop the hand-off thread, if there is one."""
        if self.handoff is not None:
            self.handoff.close(timeout_s)

    def _to_sinks(self, method: str, *args: Any) -> None:
        if self.handoff is not None:
            self.handoff.post(call_sinks, self.sinks, method, *args)
        else:
            call_sinks(self.sinks, method, *args)

    def _drain(self, wait: bool = False) -> None:
        while self.pending and (wait or self._ready(self.pending[0])):
            self._finish(self.pending.popleft())

    def _finish(self, record: _Pending) -> None:
        """Resolve a record (after its last mark, if that has not completed) and hand it to the sinks."""
        if not self._ready(record):
            record.marks[-1].synchronize()
        stats = self._resolve(record)
        self.clock.release(record.marks)
        self._release(record)
        call_sinks(self.sinks, "step", stats)

    def _resolve(self, record: _Pending) -> StepStats:
        """Only what needs this process: event times or stamps, and the tree's rows. The counts derived from the
        depths are computed by whoever reads them first (`StepStats`), normally the exporter process."""
        assert record.info is not None
        start_ns, end_ns, stage_ns = self._times(record)
        active = [e > 0 for e in record.emitted]
        tree = self._tree(record, active)
        return StepStats(
            step=record.step,
            info=record.info,
            active=active,
            depths=tree.get("depths"),
            accepted=[n for n, a in zip(record.accepted, active, strict=True) if a],
            emitted=[e for e in record.emitted if e > 0],
            stage_ns=stage_ns,
            start_ns=start_ns,
            end_ns=end_ns,
            slot_ids=record.slot_ids,
            tokens=tree.get("tokens"),
            parents=tree.get("parents"),
            log_probs=tree.get("log_probs"),
            warmup=record.warmup,
            rows=record.rows,
            ranks=tree.get("ranks"),
            gain=record.gain,
        )

    def _times(self, record: _Pending) -> tuple[int, int, dict[str, tuple[int, int]]]:
        """The step's start and end and each stage's (start, end), wall-clock ns: from the device stamps (as
        offsets from the first one, after the step's host wall time), else from the marks."""
        stamps = record.probe.stamps_ns if record.probe is not None else None
        if stamps is not None:
            wall = [record.wall_ns + (t - stamps[0]) for t in stamps]
            stages = zip(sc.STAGES, wall, wall[1:], strict=False)  # len(STAGES) + 1 stamps
            return wall[0], wall[-1], {stage: (start, end) for stage, start, end in stages}
        if not record.marks:  # neither: a step that ran no stage
            return record.wall_ns, record.wall_ns, {}
        wall = self.clock.to_wall_ns(record.marks, record.wall_ns)
        return wall[0], wall[-1], {s: (wall[i], wall[j]) for s, (i, j) in record.stages.items()}

    def _tree(self, record: _Pending, active: list[bool]) -> dict[str, Any]:
        """The active rows of the tree's arrays (copies, or views of the probe's own arrays), by field name."""
        if record.probe is not None:
            probe, rows = record.probe, slice(None) if all(active) else active
            fields = ("depths", "ranks", *self.tree_fields)  # the accepted path's ranks come with the probe only
            return {name: getattr(probe, name)[rows] for name in fields}
        tree = {name: host.numpy()[active] for name, host in record.tree.items()}  # copies: buffers are reused
        if record.depths is not None:
            tree["depths"] = record.depths.numpy()[active]  # a copy: the buffer is reused
        return tree


def _only(info: GenerateInfo, request_ids: list[str]) -> GenerateInfo:
    """`info` narrowed to `request_ids` (all of them when they are its own, in order)."""
    if request_ids == info.request_ids:
        return info
    keep = [info.request_ids.index(rid) for rid in request_ids]
    return replace(
        info,
        request_ids=request_ids,
        prompt_tokens=[info.prompt_tokens[i] for i in keep],
        slots=None if info.slots is None else [info.slots[i] for i in keep],
        trace_parents=None if info.trace_parents is None else [info.trace_parents[i] for i in keep],
    )
