"""The one protocol through which telemetry observes a decode loop.

The loop calls these hooks at fixed points of every step. With telemetry off it holds `NOOP`, whose
methods do nothing, allocate nothing and import nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ddtree.tree import DraftTree
    from ddtree.verify import AcceptResult


class StepObserver(Protocol):
    def on_step_start(self, step: int, batch_size: int) -> None:
        """A decode step begins."""

    def on_stage_start(self, stage: str) -> None:
        """A stage (`telemetry.semconv.STAGES`) begins."""

    def on_stage_end(self, stage: str) -> None:
        """The stage that began last ends."""

    def on_tree(self, tree: DraftTree) -> None:
        """The tree this step verifies (device tensors: read them without a sync)."""

    def on_accept(self, result: AcceptResult, accepted: list[int]) -> None:
        """The accept result; `accepted` is the per-request count of accepted drafts, already on the host."""

    def on_step_end(self, step: int) -> None:
        """The step's tokens have reached the host."""


class NoopObserver:
    """Observes nothing. Every hook is an empty method."""

    def on_step_start(self, step: int, batch_size: int) -> None:
        pass

    def on_stage_start(self, stage: str) -> None:
        pass

    def on_stage_end(self, stage: str) -> None:
        pass

    def on_tree(self, tree: DraftTree) -> None:
        pass

    def on_accept(self, result: AcceptResult, accepted: list[int]) -> None:
        pass

    def on_step_end(self, step: int) -> None:
        pass


NOOP = NoopObserver()
