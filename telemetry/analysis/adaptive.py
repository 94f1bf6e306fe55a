"""The adaptive rule replayed on a logged run: what a width chosen per step from the drafter's own prediction
would have made, against every fixed width and `ar`, under a cost curve.

Per logged step of r rows, each row i with its prediction E_i(W) at the widths the step logged
(`predicted_accepted_at_widths`, `telemetry.calibration`) and its accepted path's node indices:

    fixed width W:  tokens = sum_i (1 + accepted_i(W)),  time = cost(r, W)
    adaptive:       W* = argmax over W (and `ar`) of sum_i (1 + m(E_i(W))) / cost(r, W), then as fixed W*
    ar:             tokens = r,  time = the cost file's ar step at r rows (where it has one)

accepted_i(W) is the replay of `telemetry.analysis.replay` (the path's nodes with index <= W), exact per step
at T=0 and an estimate over whole requests, as it says there; m is the identity, or calibrated, width W's own
map from E(W) to accepted(W) (`AdaptiveReplay.maps`, cross-fitted). Each rule's tokens/s is its tokens over its time,
summed over the steps. The log must come from a run at the largest width to consider (widths above the logged
tree cannot be replayed).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from telemetry import semconv as sc
from telemetry.analysis.calibration import Observed, calibration_map
from telemetry.analysis.cost import CostFile
from telemetry.analysis.digest import Key
from telemetry.analysis.replay import replay_accepted
from telemetry.calibration import apply_map

AR = 0  # the width of an `ar` step: no tree
Maps = list[tuple[list[float], list[float]]]  # per width, a calibration map's knots


@dataclass
class AdaptiveReplay:
    """Steps of one configuration, as they are added: their widths, predictions and accepted paths."""

    widths: tuple[int, ...] = ()
    steps: list[tuple[int, np.ndarray[Any, Any], list[list[int]]]] = field(default_factory=list)  # rows, curves, paths
    accepted: list[np.ndarray[Any, Any]] = field(default_factory=list)  # per step [requests, widths]: replayed
    _folds: tuple[int, tuple[Maps, Maps]] | None = field(default=None, repr=False, compare=False)

    def add(self, rows: int, widths: Sequence[int], curves: Sequence[Sequence[float]], paths: list[list[int]]) -> None:
        """One step: `rows` rows ran (the cost's batch size), `curves` [requests][widths] and each request's
        accepted path. Steps of other widths than the first step's are left out (a budget that changed)."""
        if not self.widths:
            self.widths = tuple(widths)
        if tuple(widths) != self.widths or len(curves) != len(paths) or not paths:
            return
        self.steps.append((rows, np.asarray(curves, dtype=np.float64), paths))
        self.accepted.append(np.asarray([[replay_accepted(p, w) for w in self.widths] for p in paths], dtype=np.int64))

    def evaluate(self, cost: CostFile, calibrated: bool = False, rows: int | None = None) -> dict[str, Any]:
        """Tokens/s of every fixed width, `ar` (where the cost file times it) and the adaptive rule, and the
        widths the rule chose (0: `ar`). `calibrated`: the rule reads each width's prediction through that
        width's map (`maps`), fitted on the other half of the steps (even against odd), so that no step's
        choice rests on its own outcome. `rows`: as if every step ran that many rows; a logged step of more
        rows stands for several steps of `rows` of its requests each (in order), one of fewer for a step of
        `rows` requests like its own (its tokens scaled)."""
        folds = self.cross_fitted() if calibrated else None
        tokens: defaultdict[int, float] = defaultdict(float)
        seconds: defaultdict[int, float] = defaultdict(float)
        chosen: Counter[int] = Counter()
        adaptive_tokens, adaptive_s, steps = 0.0, 0.0, 0
        for index, curves, accepted, batch_rows, scale in self._groups(rows):
            steps += 1
            batch = cost.batch_for(batch_rows)
            ms = {w: cost.curves[batch].step_ms(w) for w in self.widths}
            if batch in cost.ar_step_ms:
                ms[AR] = cost.ar_step_ms[batch]
            requests = len(accepted)
            got = {w: scale * (requests + int(accepted[:, j].sum())) for j, w in enumerate(self.widths)}
            got[AR] = scale * requests
            for w in ms:
                tokens[w] += got[w]
                seconds[w] += ms[w] / 1e3
            expected = curves if folds is None else _mapped(folds[index % 2], curves)
            best = _choice(expected, self.widths, ms)
            chosen[best] += 1
            adaptive_tokens += got[best]
            adaptive_s += ms[best] / 1e3
        fixed = {w: tokens[w] / seconds[w] for w in seconds if seconds[w] > 0}
        adaptive = adaptive_tokens / adaptive_s if adaptive_s > 0 else None
        best_fixed = max(fixed.values(), default=None)
        return {
            "steps": steps,
            "fixed_tokens_per_second": {str(w): v for w, v in sorted(fixed.items())},
            "adaptive_tokens_per_second": adaptive,
            "adaptive_over_best_fixed": adaptive / best_fixed if adaptive and best_fixed else None,
            "chosen_widths": {str(w): n for w, n in sorted(chosen.items())},
            "calibrated": calibrated,
            "rows": rows,
        }

    def cross_fitted(self) -> tuple[Maps, Maps]:
        """The maps the even steps read (fitted on the odd ones) and those the odd steps read; fitted once for
        the steps added so far."""
        if self._folds is None or self._folds[0] != len(self.steps):
            self._folds = (len(self.steps), (self.maps(1), self.maps(0)))
        return self._folds[1]

    def maps(self, fold: int | None = None) -> Maps:
        """Per width, the calibration map from the prediction at that width to the drafts accepted at it
        (replayed from the paths; `telemetry.analysis.calibration.calibration_map`), over the steps of
        `fold` (0: the even ones, 1: the odd ones; None: all)."""
        observed = [Observed() for _ in self.widths]
        for index, ((_, curves, _), accepted) in enumerate(zip(self.steps, self.accepted, strict=True)):
            if fold is not None and index % 2 != fold:
                continue
            for j in range(len(self.widths)):
                observed[j].add(curves[:, j].tolist(), accepted[:, j].tolist())
        return [calibration_map(o) if o.request_steps else ([0.0], [0.0]) for o in observed]

    def _groups(self, rows: int | None) -> Iterator[tuple[int, np.ndarray[Any, Any], np.ndarray[Any, Any], int, float]]:
        """(the logged step's index, curves, accepted drafts, rows the step costs at, its tokens' scale) per step
        to evaluate: each logged step as it ran, or its requests in groups of `rows` (a group of fewer requests
        scaled up to `rows`)."""
        for index, ((logged, curves, _), accepted) in enumerate(zip(self.steps, self.accepted, strict=True)):
            if rows is None:
                yield index, curves, accepted, logged, 1.0
                continue
            for start in range(0, len(accepted), rows):
                group = accepted[start : start + rows]
                yield index, curves[start : start + rows], group, rows, rows / len(group)


def _mapped(maps: Maps, curves: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """Each width's column of `curves` through that width's map."""
    return np.stack([apply_map(m, curves[:, j]) for j, m in enumerate(maps)], axis=1)


def _choice(expected: np.ndarray[Any, Any], widths: tuple[int, ...], ms: dict[int, float]) -> int:
    """The width (0: `ar`, where timed) with the most predicted tokens a ms: (rows + the rows' summed
    prediction at the width) / the width's step time; the smaller width on a tie."""
    rows = expected.shape[0]
    gain = {w: (rows + float(expected[:, j].sum())) / ms[w] for j, w in enumerate(widths)}
    if AR in ms:
        gain[AR] = rows / ms[AR]
    return max(gain, key=lambda w: (gain[w], -w))


MAX_PENDING_STEPS = 20_000  # steps waiting for their requests' accepted paths (the oldest go first)


@dataclass
class _Pending:
    rows: int
    widths: tuple[int, ...]
    curves: dict[str, list[float]]  # request -> its prediction at the widths
    paths: dict[str, list[int]] = field(default_factory=dict)


class AdaptiveLog:
    """Reads a log's records (`Digest.of(lines, each=...)`): the step lines' predictions, joined with the
    accepted paths their requests' lines bring when they end; a step is replayed once every request in it has
    ended (steps still waiting past `MAX_PENDING_STEPS`, and those of requests that never ended, are left out)."""

    def __init__(self) -> None:
        self.replays: dict[Key, AdaptiveReplay] = {}
        self.pending: dict[tuple[Key, int], _Pending] = {}
        self.by_request: dict[tuple[Key, str], list[int]] = {}  # the pending steps a request is in
        self.left_out = 0

    def __call__(self, record: dict[str, Any]) -> None:
        event = record.get("event")
        if event == sc.EVENT_STEP:
            self._step(record)
        elif event == sc.EVENT_REQUEST:
            self._request(record)

    def _step(self, s: dict[str, Any]) -> None:
        curves, widths = s.get(sc.FIELD_PREDICTED_AT_WIDTHS), s.get(sc.FIELD_PREDICTED_WIDTHS)
        ids = s.get(sc.FIELD_REQUEST_IDS) or []
        if not curves or not widths or len(ids) != len(curves) or s.get(sc.FIELD_WARMUP):
            return
        key: Key = (s[sc.FIELD_METHOD], s[sc.FIELD_BUDGET], s[sc.FIELD_TOPK])
        rows = s.get(sc.FIELD_ROWS) or len(ids)
        step = int(s[sc.FIELD_STEP])
        self.pending[key, step] = _Pending(int(rows), tuple(widths), dict(zip(ids, curves, strict=True)))
        for rid in ids:
            self.by_request.setdefault((key, rid), []).append(step)
        if len(self.pending) > MAX_PENDING_STEPS:
            del self.pending[next(iter(self.pending))]
            self.left_out += 1

    def _request(self, r: dict[str, Any]) -> None:
        key: Key = (r.get(sc.FIELD_METHOD, ""), r.get(sc.FIELD_BUDGET, 0), r.get(sc.FIELD_TOPK))
        rid = r.get(sc.FIELD_REQUEST_ID)
        if not isinstance(rid, str):
            return
        waiting = self.by_request.pop((key, rid), [])
        paths = dict(zip(r.get(sc.FIELD_PATH_STEPS) or [], r.get(sc.FIELD_ACCEPTED_PATHS) or [], strict=False))
        for step in waiting:
            pending = self.pending.get((key, step))
            if pending is None:
                continue
            if step not in paths:  # the request's line has no path for a step it was in: the step cannot replay
                del self.pending[key, step]
                self.left_out += 1
                continue
            pending.paths[rid] = list(paths[step])
            if len(pending.paths) == len(pending.curves):
                del self.pending[key, step]
                order = list(pending.curves)
                replay = self.replays.setdefault(key, AdaptiveReplay())
                replay.add(
                    pending.rows, pending.widths, [pending.curves[i] for i in order], [pending.paths[i] for i in order]
                )
