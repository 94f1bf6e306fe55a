"""One streaming pass over a step log: everything `ddtree analyze` and `ddtree advise` report, in bounded memory.

A `Digest` takes the log's JSON objects one at a time. It keeps per-configuration sums (`ConfigStats`),
histograms (acceptance lengths, the replay's `ReplayTable`, the reliability bins), time series whose points
widen as the run gets longer (`StepSeries`, `TimeSeries`), and order-free fingerprints of each
configuration's requests (`RequestSet`), so its size does not grow with the number of lines; the one exception
is the calibration's (predicted, accepted) pairs, 12 bytes a request-step (`telemetry.analysis.calibration`).
The joins:
- a step line's node ranks and log-probabilities wait for their request's line, which names the accepted
  paths; at most `MAX_WAITING` of them wait at a time (the oldest are dropped and counted);
- each request's logged steps (how many, their acceptance lengths) wait for its request line, which says how
  many steps it decoded in: that is how steps missing from the log are found (`Completeness`); at most
  `MAX_OPEN_REQUESTS` requests wait at a time (the oldest are counted as unfinished).
"""

from __future__ import annotations

import hashlib
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from telemetry import semconv as sc
from telemetry.analysis.calibration import calibration_summary
from telemetry.analysis.chain import chain_summary
from telemetry.analysis.replay import ReplayTable, topk_grid
from telemetry.analysis.steps import (
    Completeness,
    ConfigStats,
    LineCounts,
    RequestTally,
    advice,
    is_warmup,
    iter_records,
    sort_configs,
    step_duration_ms,
)

Key = tuple[str, int, "int | None"]
MAX_WAITING = 100_000  # request-steps whose node detail waits for the request's accepted paths
MAX_OPEN_REQUESTS = 100_000  # requests whose logged steps wait for their request line
RELIABILITY_BINS = 10
MAX_TIME_BINS = 512
MAX_STEP_POINTS = 4096  # points per configuration in `StepSeries`
GAP_FACTOR = 4.0  # idle time of more than this many step durations (of the step before) breaks the line
GAP_MIN_NS = 5_000_000  # and of at least 5 ms


@dataclass
class TimeSeries:
    """Sums and counts per time bin; the bin width doubles whenever the run outgrows `MAX_TIME_BINS` bins."""

    origin_ns: int | None = None
    width_ns: int = 100_000_000
    sums: dict[int, npt.NDArray[np.float64]] = field(default_factory=dict)
    counts: dict[int, int] = field(default_factory=dict)

    def add(self, t_ns: int, values: list[float]) -> None:
        if self.origin_ns is None:
            self.origin_ns = t_ns
        index = max(t_ns - self.origin_ns, 0) // self.width_ns
        while index >= MAX_TIME_BINS:
            self._widen()
            index //= 2
        if index in self.sums:
            self.sums[index] += values
        else:
            self.sums[index] = np.asarray(values, dtype=np.float64)
        self.counts[index] = self.counts.get(index, 0) + 1

    def _widen(self) -> None:
        sums: dict[int, npt.NDArray[np.float64]] = {}
        counts: dict[int, int] = {}
        for i, v in self.sums.items():
            sums[i // 2] = sums[i // 2] + v if i // 2 in sums else v.copy()
            counts[i // 2] = counts.get(i // 2, 0) + self.counts[i]
        self.sums, self.counts, self.width_ns = sums, counts, self.width_ns * 2

    def means(self, since_ns: int = 0) -> tuple[list[float], list[list[float]]]:
        """(bin starts in seconds after `since_ns`, per bin: the mean of its samples)."""
        xs, ys = [], []
        for i in sorted(self.sums):
            xs.append(((self.origin_ns or 0) + i * self.width_ns - since_ns) / 1e9)
            ys.append([float(v) / self.counts[i] for v in self.sums[i]])
        return xs, ys


@dataclass
class StepSeries:
    """One configuration's steady steps in log order, for tokens per second over time.

    A point holds up to `group` consecutive steps: [first start ns, last end ns, tokens, busy ns (the steps'
    own durations, summed), steps]; its rate is tokens / busy time, so with `group` 1 each point is one step's
    emitted tokens over its own duration. `breaks[i]`: idle time before point i (see `GAP_FACTOR`); a point
    never spans one until the run outgrows the points. Past `MAX_STEP_POINTS` points, neighbours merge and
    `group` doubles. Warm-up steps are not points: their starts are kept in `warmup_ns` (the first few)."""

    points: list[list[float]] = field(default_factory=list)
    breaks: list[bool] = field(default_factory=list)
    group: int = 1
    warmup_ns: list[int] = field(default_factory=list)
    last: tuple[int, int] | None = None  # the previous steady step's (start, end) ns

    def add(self, start_ns: int, end_ns: int, tokens: int, warmup: bool) -> None:
        if warmup:
            if len(self.warmup_ns) < MAX_STEP_POINTS:
                self.warmup_ns.append(start_ns)
            return
        if end_ns <= start_ns:
            return  # a step that ran no stage has no rate
        gap = self.last is not None and start_ns - self.last[1] > max(
            GAP_FACTOR * (self.last[1] - self.last[0]), GAP_MIN_NS
        )
        self.last = (start_ns, end_ns)
        if self.points and not gap and self.points[-1][4] < self.group:
            p = self.points[-1]
            p[1], p[2], p[3], p[4] = end_ns, p[2] + tokens, p[3] + end_ns - start_ns, p[4] + 1
        else:
            self.points.append([start_ns, end_ns, tokens, end_ns - start_ns, 1])
            self.breaks.append(gap)
        if len(self.points) > MAX_STEP_POINTS:
            self._halve(across_breaks=False)
            if len(self.points) > MAX_STEP_POINTS * 3 // 4:
                self._halve(across_breaks=True)
            self.group *= 2

    def _halve(self, across_breaks: bool) -> None:
        points, breaks, i = [], [], 0
        while i < len(self.points):
            p, b = list(self.points[i]), self.breaks[i]
            if i + 1 < len(self.points) and (across_breaks or not self.breaks[i + 1]):
                q = self.points[i + 1]
                p = [p[0], q[1], p[2] + q[2], p[3] + q[3], p[4] + q[4]]
                i += 1
            points.append(p)
            breaks.append(b)
            i += 1
        self.points, self.breaks = points, breaks

    def first_ns(self) -> int | None:
        starts = [int(self.points[0][0])] if self.points else []
        return min([*starts, *self.warmup_ns], default=None)

    def rates(self, since_ns: int) -> tuple[list[float], list[float]]:
        """(seconds after `since_ns`, tokens/s) per point, with a NaN pair at each break (no line across it)."""
        xs: list[float] = []
        ys: list[float] = []
        for p, gap in zip(self.points, self.breaks, strict=True):
            if gap:
                xs.append(float("nan"))
                ys.append(float("nan"))
            xs.append((p[0] - since_ns) / 1e9)
            ys.append(p[2] / p[3] * 1e9)
        return xs, ys


def _fingerprint(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


@dataclass
class RequestSet:
    """An order-free fingerprint of a configuration's requests: their ids, and their prompts where logged."""

    count: int = 0
    named: int = 0  # requests with a non-empty id
    ids: int = 0  # sum of the ids' 64-bit hashes, mod 2**64
    prompted: int = 0  # requests whose prompt token ids were logged
    prompts: int = 0

    def add(self, request_id: Any, prompt_ids: Any) -> None:
        self.count += 1
        if isinstance(request_id, str) and request_id:
            self.named += 1
            self.ids = (self.ids + _fingerprint(request_id)) % 2**64
        if isinstance(prompt_ids, list):
            self.prompted += 1
            self.prompts = (self.prompts + _fingerprint(",".join(map(str, prompt_ids)))) % 2**64

    def same(self, other: RequestSet) -> bool:
        """Whether both hold the same requests: the same ids, or the same prompts."""
        if not self.count or self.count != other.count:
            return False
        if self.named == self.count == other.named and self.ids == other.ids:
            return True
        return self.prompted == self.count == other.prompted and self.prompts == other.prompts


@dataclass
class Dropped:
    """What the `ddtree.telemetry` lines say the telemetry dropped."""

    steps: int = 0
    requests: int = 0
    total: int = 0  # the largest running total seen, all kinds


@dataclass
class Digest:
    counts: LineCounts = field(default_factory=LineCounts)
    configs: dict[Key, ConfigStats] = field(default_factory=dict)
    lengths: dict[Key, Counter[int]] = field(default_factory=dict)  # acceptance length -> request-steps
    replays: dict[Key, ReplayTable] = field(default_factory=dict)
    waiting: OrderedDict[tuple[str, int], tuple[list[int], list[float] | None]] = field(default_factory=OrderedDict)
    dropped_detail: int = 0
    open: OrderedDict[tuple[Key, str], list[int]] = field(default_factory=OrderedDict)  # -> [steps seen, lengths]
    evicted: list[int] = field(default_factory=lambda: [0, 0])  # [requests, request-steps] pushed out of `open`
    dropped: Dropped = field(default_factory=Dropped)
    unmatched: RequestTally = field(default_factory=RequestTally)  # request lines of configurations with no steps
    identities: dict[Key, RequestSet] = field(default_factory=dict)
    reliability: npt.NDArray[np.float64] = field(default_factory=lambda: np.zeros((RELIABILITY_BINS, 3)))
    series: dict[Key, StepSeries] = field(default_factory=dict)  # tokens/s per step, per configuration
    gpu: dict[str, TimeSeries] = field(default_factory=dict)  # gpu -> [utilization, memory, power]

    @classmethod
    def of(cls, lines: Iterable[str], each: Callable[[dict[str, Any]], None] | None = None) -> Digest:
        """The digest of a log's lines (`iter_records`: lines that are not JSON objects are counted, not read);
        `each` sees every record after the digest has."""
        digest = cls()
        for record in iter_records(lines, digest.counts):
            digest.add(record)
            if each is not None:
                each(record)
        return digest

    def add(self, record: dict[str, Any]) -> None:
        event = record.get("event")
        if event == sc.EVENT_STEP:
            self._step(record)
        elif event == sc.EVENT_REQUEST:
            self._request(record)
        elif event == sc.EVENT_TELEMETRY:
            self._telemetry(record)
        elif event == sc.EVENT_GPU:
            values = [record.get(f) for f in (sc.FIELD_GPU_UTILIZATION, sc.FIELD_GPU_MEMORY_USED, sc.FIELD_GPU_POWER)]
            t = record.get(sc.FIELD_TIME_NS)
            if isinstance(t, int) and all(isinstance(v, (int, float)) for v in values):
                self.gpu.setdefault(str(record.get(sc.FIELD_GPU, 0)), TimeSeries()).add(t, values)  # type: ignore[arg-type]

    def _step(self, s: dict[str, Any]) -> None:
        key: Key = (s[sc.FIELD_METHOD], s[sc.FIELD_BUDGET], s[sc.FIELD_TOPK])
        self.configs.setdefault(key, ConfigStats(*key)).add(s)
        self.lengths.setdefault(key, Counter()).update(a + 1 for a in s[sc.FIELD_ACCEPTED_DRAFTS])
        start, end = s.get(sc.FIELD_START_NS), s.get(sc.FIELD_END_NS)
        if isinstance(start, int):
            end = end if isinstance(end, int) else start + int(step_duration_ms(s) * 1e6)
            self.series.setdefault(key, StepSeries()).add(start, end, sum(s.get(sc.FIELD_EMITTED, [])), is_warmup(s))
        ids = s.get(sc.FIELD_REQUEST_IDS) or []
        for rid, accepted in zip(ids, s[sc.FIELD_ACCEPTED_DRAFTS], strict=False):
            self._seen(key, rid, accepted + 1)
        ranks = s.get(sc.FIELD_NODE_RANKS)
        if ranks is None:
            return
        probs = s.get(sc.FIELD_NODE_LOG_PROBS) or [None] * len(ranks)
        for rid, r, p in zip(ids, ranks, probs, strict=False):
            self.waiting[rid, s[sc.FIELD_STEP]] = (r, p)
        while len(self.waiting) > MAX_WAITING:
            self.waiting.popitem(last=False)
            self.dropped_detail += 1

    def _seen(self, key: Key, request_id: Any, length: int) -> None:
        """A step line of configuration `key` that lists the request (its acceptance length in the step). Runs
        of other configurations may reuse the request's id: entries are per configuration."""
        if not isinstance(request_id, str) or not request_id:
            return  # unnamed requests cannot be told apart
        entry = self.open.get((key, request_id))
        if entry is None:
            entry = self.open[key, request_id] = [0, 0]
            if len(self.open) > MAX_OPEN_REQUESTS:
                _, (steps, _) = self.open.popitem(last=False)
                self.evicted[0] += 1
                self.evicted[1] += steps
        entry[0] += 1
        entry[1] += length

    def _request(self, r: dict[str, Any]) -> None:
        key: Key = (r.get(sc.FIELD_METHOD, ""), r.get(sc.FIELD_BUDGET, 0), r.get(sc.FIELD_TOPK))
        rid, steps = r.get(sc.FIELD_REQUEST_ID), r.get(sc.FIELD_STEPS)
        self.identities.setdefault(key, RequestSet()).add(rid, r.get(sc.FIELD_PROMPT_TOKEN_IDS))
        if isinstance(rid, str) and rid and isinstance(steps, int):
            seen, lengths = self._steps_seen(key, rid)
            mean = r.get(sc.FIELD_MEAN_ACCEPTANCE)
            tally = self.configs[key].requests if key in self.configs else self.unmatched
            tally.add(steps, mean if isinstance(mean, (int, float)) else None, seen, lengths)
        paths = r.get(sc.FIELD_ACCEPTED_PATHS)
        if paths is None or r.get(sc.FIELD_BUDGET) is None:
            return
        budget = r[sc.FIELD_BUDGET]
        table = self.replays.setdefault(key, ReplayTable(budget, topk_grid(min(budget, key[2] or budget))))
        ranks = []
        for step, path in zip(r[sc.FIELD_PATH_STEPS], paths, strict=True):
            node_ranks, log_probs = self.waiting.pop((r[sc.FIELD_REQUEST_ID], step), (None, None))
            ranks.append(node_ranks)
            if log_probs is not None:
                self._reliability(path, log_probs)
        table.add_request(paths, ranks)

    def _steps_seen(self, key: Key, request_id: str) -> list[int]:
        """[steps, summed lengths] of the step lines that listed the request. A request whose budget followed
        the load (budget null) ran steps of several trees, `ar` steps among them: those of each count."""
        if key[1] is not None:
            return self.open.pop((key, request_id), [0, 0])
        entries = [self.open.pop((k, request_id), [0, 0]) for k in list(self.configs)]
        return [sum(e[0] for e in entries), sum(e[1] for e in entries)]

    def _telemetry(self, t: dict[str, Any]) -> None:
        """A `ddtree.telemetry` line; only those that report dropped records count."""
        steps, requests, total = (
            t.get(f) for f in (sc.FIELD_DROPPED_STEPS, sc.FIELD_DROPPED_REQUESTS, sc.FIELD_DROPPED_TOTAL)
        )
        self.dropped.steps += steps if isinstance(steps, int) else 0
        self.dropped.requests += requests if isinstance(requests, int) else 0
        self.dropped.total = max(self.dropped.total, total if isinstance(total, int) else 0)

    def _reliability(self, path: list[int], log_probs: list[float]) -> None:
        probs = np.exp(np.asarray(log_probs, dtype=np.float64))  # [nodes]
        accepted = np.zeros(len(probs))
        accepted[[n - 1 for n in path if n <= len(probs)]] = 1.0
        bins = np.minimum((probs * RELIABILITY_BINS).astype(np.int64), RELIABILITY_BINS - 1)
        np.add.at(self.reliability, bins, np.stack([np.ones_like(probs), accepted, probs], axis=1))

    def sorted_configs(self) -> list[ConfigStats]:
        return sort_configs(self.configs.values())

    def replay_source(self) -> tuple[Key, ReplayTable] | None:
        """The ddtree configuration to replay from: the largest budget (most ranked steps on a tie)."""
        tables = [(k, t) for k, t in self.replays.items() if k[0] == "ddtree" and t.steps]
        return max(tables, key=lambda kt: (kt[0][1], kt[1].ranked_steps), default=None)

    def same_requests(self, a: Key, b: Key) -> bool:
        """Whether configurations `a` and `b` ran the same requests (same ids, or same prompts where logged)."""
        return a == b or self.identities.get(a, RequestSet()).same(self.identities.get(b, RequestSet()))

    def completeness(self, key: Key | None = None) -> Completeness:
        """How complete the log is: for configuration `key`, or over all of them."""
        if key is None:
            tallies = [g.requests for g in self.configs.values()] + [self.unmatched]
        else:
            tallies = [self.configs[key].requests] if key in self.configs else []
        tally = RequestTally()
        for t in tallies:
            for name in ("requests", "complete", "steps", "logged"):
                setattr(tally, name, getattr(tally, name) + getattr(t, name))
        unfinished = (0, 0) if key is not None else (len(self.open) + self.evicted[0], self._unfinished_steps())
        return Completeness(
            tally.steps,
            tally.logged,
            tally.requests,
            tally.complete,
            self.counts.steps,
            self.dropped.steps,
            self.dropped.requests,
            *unfinished,
        )

    def _unfinished_steps(self) -> int:
        return sum(entry[0] for entry in self.open.values()) + self.evicted[1]

    def first_ns(self) -> int:
        """The earliest time in the log's series (ns), 0 without any."""
        starts = [s.first_ns() for s in self.series.values()]
        starts += [s.origin_ns for s in self.gpu.values()]
        return min((t for t in starts if t is not None), default=0)

    def summary(self) -> dict[str, Any]:
        """Everything as one JSON-ready object (`summary.json`)."""
        groups = self.sorted_configs()
        completeness = self.completeness()
        return {
            "lines": vars(self.counts),
            "completeness": vars(completeness) | {"share": completeness.share, "text": completeness.line()},
            "configs": [self._config(g) for g in groups],
            "replay": [_replay_summary(k, t) for k, t in sorted(self.replays.items(), key=lambda kt: kt[0][1])],
            "reliability": [
                {"low": i / RELIABILITY_BINS, "high": (i + 1) / RELIABILITY_BINS, "nodes": int(n), "accepted": int(a)}
                | ({"mean_probability": p / n} if n else {})
                for i, (n, a, p) in enumerate(self.reliability)
            ],
            "dropped_detail": self.dropped_detail,
            "fastest": advice(groups),
        }

    def _config(self, g: ConfigStats) -> dict[str, Any]:
        steps = max(g.steps, 1)
        return {
            "label": g.label,
            "method": g.method,
            "budget": g.budget,
            "topk": g.topk,
            "steps": g.steps,
            "warmup_steps": g.warmup_steps,
            "request_steps": g.request_steps,
            "active_requests_per_step": g.active_per_step,
            "rows_per_step": g.rows_per_step,
            "tau": g.tau,
            "step_line_tau": g.step_tau,
            "requests": vars(g.requests) | {"tau": g.requests.tau},
            "tokens_per_step": g.emitted / steps,
            "step_ms": g.step_ms,
            "stage_ms": {s: g.stage_mean_ms(s) for s in g.stage_ms},
            "tokens_per_second": g.tokens_per_second,
            "acceptance_rate_per_depth": g.depth_rate(),
            "nodes_per_depth": [n / steps for n in g.nodes_per_depth],
            "accepted_per_depth": [a / steps for a in g.accepted_per_depth],
            "chain": chain_summary(g.chain),  # what the tree added over its chain; None: no accepted ranks
            "calibration": calibration_summary(g.calibration),  # predicted against accepted; None: no predictions
            "acceptance_lengths": {
                str(k): v for k, v in sorted(self.lengths.get((g.method, g.budget, g.topk), {}).items())
            },
        }


def _replay_summary(key: Key, table: ReplayTable) -> dict[str, Any]:
    rows = []
    for topk in (None, *table.topks):
        for budget in range(1, table.budget + 1):
            tau = table.tau(budget, topk)
            if tau is not None and (topk is None or topk < budget):
                rows.append(
                    {"budget": budget, "topk": topk, "tau": tau, "exact_share": table.exact_share(budget, topk)}
                )
    return {
        "method": key[0],
        "budget": key[1],
        "topk": key[2],
        "steps": table.steps,
        "ranked_steps": table.ranked_steps,
        "requests": table.requests,
        "predicted": rows,
    }
