"""Dummy requests through an empty session: the warm-up that compiles and captures every step shape before the
first real request, and an adaptive session's measure of what each (cap, width) costs a step."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ddtree.engine.requests import Request, row_counts

if TYPE_CHECKING:
    from ddtree.engine.session import DecodeSession

# The kinds of step a batch can make (their graphs differ: `StepState`'s flags): greedy, sampled, sampled
# with a filter, each with and without log-probabilities. A batch that mixes them steps as the widest.
WARM_UP_KINDS: tuple[dict[str, Any], ...] = tuple(
    {"temperature": t, "top_p": p, "logprobs": lp} for lp in (None, 0) for t, p in ((0.0, 1.0), (1.0, 1.0), (1.0, 0.9))
)


def warm_up(session: DecodeSession, prompt_tokens: int, new_tokens: int) -> None:
    """`DecodeSession.warm_up`."""
    if session.free_slots() != list(range(session.num_slots)):
        raise ValueError("warm_up needs an empty session")
    adaptive = session.adaptive
    forced: list[tuple[int | None, int | None, bool]] = [(None, None, False)]
    if adaptive is not None:  # every (cap, width), then every width's fixed step
        forced = [(c, w, False) for c, w in adaptive.pairs()] + [(None, w, True) for w in adaptive.widths]
        adaptive.measured = True  # measured below, once every width's graphs are made
    with session.unobserved():
        try:
            for kind in WARM_UP_KINDS:
                for n in row_counts(session.num_slots):
                    for cap, width, fixed in forced:
                        if adaptive is not None:
                            adaptive.forced_cap, adaptive.forced, adaptive.forced_fixed = cap, width, fixed
                        _run_dummies(session, n, prompt_tokens, new_tokens, kind)
        finally:
            if adaptive is not None:
                adaptive.forced_cap, adaptive.forced, adaptive.forced_fixed = None, None, False
    if adaptive is not None:
        session.measure_costs(prompt_tokens=prompt_tokens)


@torch.inference_mode()
def measure_costs(session: DecodeSession, repeats: int, prompt_tokens: int, unwaited: bool | None) -> None:
    """`DecodeSession.measure_costs`."""
    adaptive = session.adaptive
    if adaptive is None:
        raise ValueError("only an adaptive session chooses widths by their cost")
    if session.free_slots() != list(range(session.num_slots)):
        raise ValueError("measure_costs needs an empty session")
    adaptive.measured = True  # its own joins do not measure again
    with session.unobserved():
        try:
            if unwaited is None:  # only a device that runs ahead of the host makes the host's wait cost a step
                unwaited = session.target.device.type == "cuda"
            for n in row_counts(session.num_slots):
                for cap, width in adaptive.pairs():
                    adaptive.forced_cap, adaptive.forced = cap, width
                    adaptive.set_cost(n, cap, width, _time_steps(session, n, repeats, prompt_tokens))
                adaptive.forced_cap, adaptive.forced_fixed = None, True
                for width in adaptive.widths if unwaited else ():
                    adaptive.forced = width
                    adaptive.fixed_costs[n][width] = _time_steps(session, n, repeats, prompt_tokens)
                adaptive.forced_fixed = False
        finally:
            adaptive.forced_cap, adaptive.forced, adaptive.forced_fixed = None, None, False


def _time_steps(session: DecodeSession, n: int, repeats: int, prompt_tokens: int) -> float:
    """Seconds per step of `n` greedy dummy requests, after one untimed step."""
    room = session.capacity - session.tokens_needed(prompt_tokens, 0)
    new_tokens = max(1, min(room, (repeats + 1 + session.pipeline_depth) * session.proposer.block))
    slots = session.join([Request([0] * prompt_tokens, new_tokens) for _ in range(n)])
    session.step()
    seconds = timed_steps(session.step, repeats, session.target.device)
    session.drain()
    for slot in slots:
        session.leave(slot)
    return seconds


def timed_steps(run: Callable[[], object], steps: int, device: torch.device) -> float:
    """Seconds per call of `run` over `steps` calls, the device drained before and after."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(steps):
        run()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - started) / steps


def _run_dummies(session: DecodeSession, n: int, prompt_tokens: int, new_tokens: int, kind: dict[str, Any]) -> None:
    slots = session.join([Request([0] * prompt_tokens, new_tokens, **kind) for _ in range(n)])
    while session.has_active():
        session.step()
    session.drain()
    for slot in slots:
        session.leave(slot)
