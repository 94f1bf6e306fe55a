"""One streaming pass over a step log: everything `ddtree analyze` and `ddtree advise` report, in bounded memory.

A `Digest` takes the log's JSON objects one at a time. It keeps per-configuration sums (`ConfigStats`),
histograms (acceptance lengths, the replay's `ReplayTable`, the reliability bins) and time series whose
bins widen as the run gets longer, so its size does not grow with the number of lines. The one join: a
step line's node ranks and log-probabilities wait for their request's line, which names the accepted
paths; at most `MAX_WAITING` of them wait at a time (the oldest are dropped and counted).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from telemetry import semconv as sc
from telemetry.analysis import ConfigStats, LineCounts, advice, sort_configs
from telemetry.replay import ReplayTable, topk_grid

Key = tuple[str, int, "int | None"]
MAX_WAITING = 100_000  # request-steps whose node detail waits for the request's accepted paths
RELIABILITY_BINS = 10
MAX_TIME_BINS = 512


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

    def points(self, mean: bool, since_ns: int = 0) -> tuple[list[float], list[list[float]]]:
        """(bin starts in seconds after `since_ns`, per bin: the means or the sums per second)."""
        xs, ys = [], []
        for i in sorted(self.sums):
            xs.append(((self.origin_ns or 0) + i * self.width_ns - since_ns) / 1e9)
            scale = 1 / self.counts[i] if mean else 1e9 / self.width_ns
            ys.append([float(v) * scale for v in self.sums[i]])
        return xs, ys


@dataclass
class Digest:
    counts: LineCounts = field(default_factory=LineCounts)
    configs: dict[Key, ConfigStats] = field(default_factory=dict)
    lengths: dict[Key, Counter[int]] = field(default_factory=dict)  # acceptance length -> request-steps
    replays: dict[Key, ReplayTable] = field(default_factory=dict)
    waiting: OrderedDict[tuple[str, int], tuple[list[int], list[float] | None]] = field(default_factory=OrderedDict)
    dropped_detail: int = 0
    reliability: npt.NDArray[np.float64] = field(default_factory=lambda: np.zeros((RELIABILITY_BINS, 3)))
    tokens: TimeSeries = field(default_factory=TimeSeries)  # [emitted tokens]
    gpu: dict[str, TimeSeries] = field(default_factory=dict)  # gpu -> [utilization, memory, power]

    def add(self, record: dict[str, Any]) -> None:
        event = record.get("event")
        if event == sc.EVENT_STEP:
            self._step(record)
        elif event == sc.EVENT_REQUEST:
            self._request(record)
        elif event == sc.EVENT_GPU:
            values = [record.get(f) for f in (sc.FIELD_GPU_UTILIZATION, sc.FIELD_GPU_MEMORY_USED, sc.FIELD_GPU_POWER)]
            t = record.get(sc.FIELD_TIME_NS)
            if isinstance(t, int) and all(isinstance(v, (int, float)) for v in values):
                self.gpu.setdefault(str(record.get(sc.FIELD_GPU, 0)), TimeSeries()).add(t, values)  # type: ignore[arg-type]

    def _step(self, s: dict[str, Any]) -> None:
        key: Key = (s[sc.FIELD_METHOD], s[sc.FIELD_BUDGET], s[sc.FIELD_TOPK])
        self.configs.setdefault(key, ConfigStats(*key)).add(s)
        self.lengths.setdefault(key, Counter()).update(a + 1 for a in s[sc.FIELD_ACCEPTED_DRAFTS])
        if isinstance(s.get(sc.FIELD_START_NS), int):
            self.tokens.add(s[sc.FIELD_START_NS], [float(sum(s.get(sc.FIELD_EMITTED, [])))])
        ranks = s.get(sc.FIELD_NODE_RANKS)
        if ranks is None:
            return
        probs = s.get(sc.FIELD_NODE_LOG_PROBS) or [None] * len(ranks)
        for rid, r, p in zip(s[sc.FIELD_REQUEST_IDS], ranks, probs, strict=False):
            self.waiting[rid, s[sc.FIELD_STEP]] = (r, p)
        while len(self.waiting) > MAX_WAITING:
            self.waiting.popitem(last=False)
            self.dropped_detail += 1

    def _request(self, r: dict[str, Any]) -> None:
        paths = r.get(sc.FIELD_ACCEPTED_PATHS)
        if paths is None or r.get(sc.FIELD_BUDGET) is None:
            return
        key: Key = (r[sc.FIELD_METHOD], r[sc.FIELD_BUDGET], r.get(sc.FIELD_TOPK))
        budget = r[sc.FIELD_BUDGET]
        table = self.replays.setdefault(key, ReplayTable(budget, topk_grid(min(budget, key[2] or budget))))
        for step, path in zip(r[sc.FIELD_PATH_STEPS], paths, strict=True):
            ranks, log_probs = self.waiting.pop((r[sc.FIELD_REQUEST_ID], step), (None, None))
            table.add(path, ranks)
            if log_probs is not None:
                self._reliability(path, log_probs)

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

    def summary(self) -> dict[str, Any]:
        """Everything as one JSON-ready object (`summary.json`)."""
        groups = self.sorted_configs()
        return {
            "lines": vars(self.counts),
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
            "request_steps": g.request_steps,
            "tau": g.tau,
            "tokens_per_step": g.emitted / steps,
            "step_ms": g.step_ms,
            "stage_ms": {s: ms / steps for s, ms in g.stage_ms.items()},
            "tokens_per_second": g.tokens_per_second,
            "acceptance_rate_per_depth": g.depth_rate(),
            "nodes_per_depth": [n / steps for n in g.nodes_per_depth],
            "accepted_per_depth": [a / steps for a in g.accepted_per_depth],
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
        "predicted": rows,
    }
