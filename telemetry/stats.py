"""What the collector hands its sinks: one `StepStats` per decode step, and the sink protocol.

Free of torch, so that the exporter process (`telemetry.process`) can import it cheaply.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Protocol

from telemetry.hooks import GenerateInfo, RequestResult


@dataclass(frozen=True)
class StepStats:
    step: int
    info: GenerateInfo
    active: list[bool]  # per request: still decoding during this step
    tree_nodes: list[int]  # per active request
    nodes_per_depth: list[int]  # index d: nodes at depth d over active requests (index 0 unused)
    accepted: list[int]  # per active request: accepted drafts
    accepted_per_depth: list[int]
    emitted: list[int]  # per active request
    stage_ns: dict[str, tuple[int, int]]  # stage -> (start, end), wall-clock ns
    start_ns: int
    end_ns: int

    @property
    def request_ids(self) -> list[str]:
        return [rid for rid, a in zip(self.info.request_ids, self.active, strict=True) if a]

    @property
    def tree_depth(self) -> int:
        return max((d for d, n in enumerate(self.nodes_per_depth) if n), default=0)


class StatsSink(Protocol):
    def start_requests(self, info: GenerateInfo) -> None: ...

    def step(self, stats: StepStats) -> None: ...

    def end_requests(self, info: GenerateInfo, results: list[RequestResult]) -> None: ...


def call_sinks(sinks: list[Any], method: str, *args: Any) -> None:
    """Call every sink; one that raises is dropped with a warning, and decoding goes on."""
    for sink in list(sinks):
        try:
            getattr(sink, method)(*args)
        except BrokenPipeError:
            raise  # the reader of our output went away (`| head`): the program ends, quietly
        except Exception as exc:  # a telemetry bug must never break decoding
            sinks.remove(sink)
            warnings.warn(f"ddtree telemetry: {type(sink).__name__} failed and is off: {exc!r}", stacklevel=3)
