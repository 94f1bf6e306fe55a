"""Our telemetry inside SGLang's scheduler process, with `DDTREE_DEBUG_METRICS=1`.

The same `ddtree.observer.StepObserver` calls as our engine's, so spans, metrics and JSON step logs carry the
same names (`telemetry.semconv`):

- the DDTREE worker starts telemetry once per scheduler process (`start`), from the environment, when it is
  built; the main process (tokenizer) and the detokenizer start nothing;
- a request is reported when its prefill runs in the worker (`on_generate_start`, SGLang's `rid` as its id)
  and when SGLang has finished it (`on_generate_end`: the tokens it served and each step's accepted drafts + 1);
- each decode step reports its stages (draft, tree_build, verify, accept) and its tree from the worker, and
  its accepted and emitted counts once the scheduler has read them back: an around-hook on SGLang's
  `process_batch_result_decode` (registered by the plugin through SGLang's `HookRegistry`) takes the counts
  SGLang already copied to the host (`num_correct_drafts_per_req_cpu`) and what each request kept (its
  `output_ids_through_stop` before and after). Nothing here reads a device tensor; the tree goes to the
  collector, which copies it without blocking.

SGLang's batch rows move between steps (requests join, finish, are filtered out), so before each step the
collector is told which request each row holds (`Collector.assign_slots`).

With the variable unset the plugin registers no hook and this module imports nothing from `telemetry`.
"""

from __future__ import annotations

import atexit
import os
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Iterator

    from ddtree.accept import AcceptResult
    from ddtree.tree import DraftTree
    from telemetry.collector import Collector

FLAG = "DDTREE_DEBUG_METRICS"
METHOD = "ddtree"
PROCESSOR = "sglang.srt.managers.scheduler_components.batch_result_processor.SchedulerBatchResultProcessor"
# The step's stages: `telemetry.semconv.STAGES`, spelled here so that the worker imports nothing from telemetry.
DRAFT, TREE_BUILD, VERIFY, ACCEPT = "draft", "tree_build", "verify", "accept"
STEP_ATTR = "ddtree_telemetry_step"  # set on the worker's GenerationBatchResult: (step, AcceptResult)

_session: SGLangTelemetry | None = None  # this process's telemetry, once a DDTREE worker started it


def enabled(env: Mapping[str, str] | None = None) -> bool:
    """Whether `DDTREE_DEBUG_METRICS` asks for telemetry (a value other than 0/false is checked at start-up)."""
    value = (os.environ if env is None else env).get(FLAG, "").strip().lower()
    return value not in ("", "0", "false")


def register_hooks() -> None:
    """Hook SGLang's result processing (decode and prefill) in this process; the plugin calls this when
    telemetry is on, before SGLang applies its registered hooks."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(f"{PROCESSOR}.process_batch_result_decode", _around_decode, HookType.AROUND)
    HookRegistry.register(f"{PROCESSOR}.process_batch_result_prefill", _around_prefill, HookType.AROUND)


def start(device: str, budget: int, topk: int | None, model_name: str) -> SGLangTelemetry | None:
    """This process's telemetry (started on the first call), or None with telemetry off."""
    global _session
    if not enabled():
        return None
    if _session is None:
        import torch

        from telemetry import start_telemetry
        from telemetry.config import TelemetryConfig

        handle = start_telemetry(TelemetryConfig.from_env(), torch.device(device).type, model_name)
        atexit.register(handle.shutdown)
        _session = SGLangTelemetry(handle, budget, topk)
    return _session


def stage(session: SGLangTelemetry | None, name: str) -> AbstractContextManager[None]:
    """A stage of the current step (nothing with telemetry off)."""
    return nullcontext() if session is None else session.stage(name)


class SGLangTelemetry:
    """The glue between SGLang's scheduler and worker and one `telemetry.collector.Collector`."""

    def __init__(self, handle: Any, budget: int, topk: int | None) -> None:
        self.handle = handle
        self.observer: Collector = handle.observer
        self.budget, self.topk = budget, topk
        self.steps = 0
        self.requests: dict[str, Any] = {}  # rid -> SGLang's Req, reported as joined and not yet as ended
        self.lengths: dict[str, list[int]] = {}  # rid -> per decode step: accepted drafts + 1

    # -- the worker ------------------------------------------------------------------------------------------

    def join(self, reqs: list[Any]) -> None:
        """Report the requests of `reqs` not seen yet (each with its row in this batch as its slot)."""
        from ddtree.observer import GenerateInfo

        for row, req in enumerate(reqs):
            if req.rid in self.requests or req.finished():
                continue
            self.requests[req.rid], self.lengths[req.rid] = req, []
            params = req.sampling_params
            info = GenerateInfo(
                method=METHOD,
                budget=self.budget,
                topk=self.topk,
                temperature=float(params.temperature),
                max_new_tokens=int(params.max_new_tokens or 0),
                seed=int(getattr(params, "sampling_seed", None) or 0),
                request_ids=[req.rid],
                prompt_tokens=[list(req.origin_input_ids)],
                slots=[row],
            )
            self.observer.on_generate_start(info)

    def step_start(self, reqs: list[Any]) -> int:
        self.join(reqs)
        step, self.steps = self.steps, self.steps + 1
        self.observer.assign_slots([req.rid for req in reqs])
        self.observer.on_step_start(step, len(reqs))
        return step

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        self.observer.on_stage_start(name)
        yield
        self.observer.on_stage_end(name)

    def tree(self, tree: DraftTree) -> None:
        self.observer.on_tree(tree)

    # -- the scheduler, after it read a step back ------------------------------------------------------------

    def step_done(
        self, mark: tuple[int, AcceptResult], reqs: list[Any], before: list[int], counted: list[bool], accepted: Any
    ) -> None:
        step, result = mark
        drafts = [int(n) for n in accepted] if accepted is not None else [0] * len(reqs)
        for req, n, counts in zip(reqs, drafts, counted, strict=True):
            if counts and req.rid in self.lengths:
                self.lengths[req.rid].append(n + 1)
        emitted = [len(req.output_ids_through_stop) - n for req, n in zip(reqs, before, strict=True)]
        self.observer.on_accept(step, result, drafts)
        self.observer.on_step_end(step, emitted)
        self.finish(reqs)

    def finish(self, reqs: list[Any]) -> None:
        """Report the requests of `reqs` that SGLang has finished."""
        from ddtree.observer import RequestResult

        ended = []
        for req in reqs:
            if req.rid in self.requests and req.finished():
                del self.requests[req.rid]
                tokens = [int(t) for t in req.output_ids_through_stop]
                ended.append(RequestResult(req.rid, tokens, self.lengths.pop(req.rid), finish_reason(req)))
        if ended:
            self.observer.on_generate_end(ended)


def finish_reason(req: Any) -> str:
    """Our finish reasons from SGLang's: `length`, `stop` (a stop token or string), else `cancelled`."""
    name = type(req.finished_reason).__name__
    if name == "FINISH_LENGTH":
        return "length"
    if name in ("FINISH_MATCHED_TOKEN", "FINISH_MATCHED_STR"):
        return "stop"
    return "cancelled"


def mark_result(batch_result: Any, step: int, result: AcceptResult) -> None:
    """Tag the worker's step result, so the scheduler's hook knows which step it reads back."""
    setattr(batch_result, STEP_ATTR, (step, result))


def _around_decode(original: Callable[..., Any], processor: Any, batch: Any, result: Any, *a: Any, **kw: Any) -> Any:
    mark = getattr(result, STEP_ATTR, None)
    session = _session
    if session is None or mark is None:
        return original(processor, batch, result, *a, **kw)
    reqs = list(batch.reqs)
    before = [len(req.output_ids_through_stop) for req in reqs]
    counted = [not (req.is_retracted or req.finished()) for req in reqs]  # as SGLang counts its verify steps
    out = original(processor, batch, result, *a, **kw)
    session.step_done(mark, reqs, before, counted, getattr(result, "num_correct_drafts_per_req_cpu", None))
    return out


def _around_prefill(original: Callable[..., Any], processor: Any, batch: Any, *a: Any, **kw: Any) -> Any:
    out = original(processor, batch, *a, **kw)
    if _session is not None:
        _session.finish(list(batch.reqs))  # requests done at their first token
    return out
