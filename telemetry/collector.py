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
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from telemetry import semconv as sc
from telemetry.hooks import GenerateInfo, RequestResult
from telemetry.stats import StatsSink, StepStats, call_sinks
from telemetry.timing import StageClock, clock_for

if TYPE_CHECKING:
    from ddtree.tree import DraftTree
    from ddtree.verify import AcceptResult


@dataclass
class _Pending:
    step: int
    wall_ns: int
    marks: list[Any]
    stages: dict[str, tuple[int, int]] = field(default_factory=dict)  # stage -> mark indices
    depths: torch.Tensor | None = None  # [batch, nodes] host copy of the tree's depths, filled asynchronously
    tree: dict[str, torch.Tensor] = field(default_factory=dict)  # tokens, parents (log_probs): host copies too
    accepted: list[int] = field(default_factory=list)
    emitted: list[int] = field(default_factory=list)
    slot_ids: list[str | None] = field(default_factory=list)  # each slot's request when the step started


DRAIN_EVERY = 8  # records are resolved in groups: the same code run eight times in a row, with warm caches
MAX_PENDING = 16  # records left unresolved before a step start resolves them (when no verify stage ran)


class Collector:
    """Implements `telemetry.hooks.StepObserver`."""

    def __init__(self, sinks: list[StatsSink], device_type: str = "cpu", tree_detail: bool = False) -> None:
        self.sinks = sinks
        self.tree_fields = ("tokens", "parents", "log_probs") if tree_detail else ("tokens", "parents")
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

    def on_generate_start(self, info: GenerateInfo) -> None:
        self.info = info
        slots = info.slots if info.slots is not None else list(range(len(info.request_ids)))
        for rid, slot in zip(info.request_ids, slots, strict=True):
            self.infos[rid] = info
            self.slot_ids.extend([None] * (slot + 1 - len(self.slot_ids)))
            self.slot_ids[slot] = rid
        call_sinks(self.sinks, "start_requests", info)

    def assign_slots(self, request_ids: list[str | None]) -> None:
        """Name the request in each row of the step that starts next, for a server whose batch rows move
        between steps (SGLang filters and merges its running batch): row i holds `request_ids[i]`, whatever
        slot it joined with."""
        self.slot_ids = list(request_ids)

    def on_step_start(self, step: int, batch_size: int) -> None:
        if len(self.pending) >= MAX_PENDING:
            self._drain()
        self.clock.begin_step()
        self.current = _Pending(
            step=step, wall_ns=time.time_ns(), marks=[self.clock.mark()], slot_ids=self._slots(batch_size)
        )
        self.started[step] = self.current
        self.boundary = 0

    def on_stage_start(self, stage: str) -> None:
        assert self.current is not None
        if self.boundary is None:
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
        each accepted path's node indices from the request's output tokens (for the budget replay); the
        log-probabilities are copied only when tree detail is on."""
        assert self.current is not None
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

    def on_accept(self, step: int, result: AcceptResult, accepted: list[int]) -> None:
        self.started[step].accepted = accepted

    def on_step_end(self, step: int, emitted: list[int]) -> None:
        record = self.started.pop(step)
        record.emitted = emitted
        if record is self.current:
            if self.boundary is None:  # the last stage is still open: the step ends now
                record.marks.append(self.clock.mark())
            self.current = None
            self.boundary = None
        if any(emitted):
            self.pending.append(record)
        else:  # a step launched ahead while its requests finished: no request decoded in it
            self.clock.release(record.marks)
            self._release(record)

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
            call_sinks(self.sinks, "end_requests", _only(info, [r.request_id for r in group]), group)
        if not self.infos:
            self.info = None

    def _slots(self, batch_size: int) -> list[str | None]:
        """Each slot's request now, `batch_size` slots."""
        ids = self.slot_ids[:batch_size]
        return ids + [None] * (batch_size - len(ids))

    def _drain(self, wait: bool = False) -> None:
        while self.pending and (wait or self.clock.ready(self.pending[0].marks)):
            record = self.pending.popleft()
            if wait and not self.clock.ready(record.marks):
                record.marks[-1].synchronize()
            stats = self._resolve(record)
            self.clock.release(record.marks)
            self._release(record)
            call_sinks(self.sinks, "step", stats)

    def _resolve(self, record: _Pending) -> StepStats:
        """Only what needs this process: event times and the host copy's rows. The counts derived from the
        depths are computed by whoever reads them first (`StepStats`), normally the exporter process."""
        assert self.info is not None
        wall = self.clock.to_wall_ns(record.marks, record.wall_ns)
        active = [e > 0 for e in record.emitted]
        tree = {name: host.numpy()[active] for name, host in record.tree.items()}  # copies: buffers are reused
        return StepStats(
            step=record.step,
            info=self.info,
            active=active,
            depths=None if record.depths is None else record.depths.numpy()[active],  # a copy: the buffer is reused
            accepted=[n for n, a in zip(record.accepted, active, strict=True) if a],
            emitted=[e for e in record.emitted if e > 0],
            stage_ns={s: (wall[i], wall[j]) for s, (i, j) in record.stages.items()},
            start_ns=wall[0],
            end_ns=wall[-1],
            slot_ids=record.slot_ids,
            tokens=tree.get("tokens"),
            parents=tree.get("parents"),
            log_probs=tree.get("log_probs"),
        )


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
