"""What the SGLang tests share: the skip rule, the prompts, and runs of SGLang's Engine and of our CLI."""

from __future__ import annotations

import collections
import importlib.util
import io
import json
import os
import subprocess
import sys
from contextlib import redirect_stdout
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import ddtree
from ddtree.cli.main import main

HAVE_SGLANG = importlib.util.find_spec("sglang") is not None
# `make test-sglang` sets DDTREE_REQUIRE_SGLANG=1: there a missing sglang fails instead of skipping.
requires_sglang = pytest.mark.skipif(
    not HAVE_SGLANG and not os.environ.get("DDTREE_REQUIRE_SGLANG"),
    reason="sglang 0.5.23 is not installed in this environment; `make test-sglang` runs these in .venv-sglang",
)
ENGINE_RUN = Path(__file__).with_name("engine_run.py")
# The checkout whose `ddtree` this test imported: the engine's processes must import the same one, whatever
# checkout the environment's editable install points at (engine_run.py runs with its own directory first on
# the path, not the working directory).
CHECKOUT = Path(ddtree.__file__).resolve().parents[1]
MAX_NEW_TOKENS = 32


@dataclass(frozen=True)
class Run:
    """One request's outcome: tokens, verify steps, and how many steps accepted 0, 1, 2, ... drafts."""

    token_ids: list[int]
    steps: int
    histogram: list[int]
    rid: str = ""  # SGLang's request id
    completion_tokens: int = 0  # as SGLang reports it


def histogram(accepted_drafts: list[int]) -> list[int]:
    counts = collections.Counter(accepted_drafts)
    return [counts.get(i, 0) for i in range(max(counts, default=-1) + 1)]


def sglang_runs(
    algorithm: str, prompts: list[list[int]], env: dict[str, str] | None = None, **request: Any
) -> list[Run]:
    """Greedy generation for `prompts` as one batch on SGLang's Engine (CPU mode, float32), in a fresh process;
    `request` adds `engine_run.py`'s other fields (a pair's directories, Engine arguments)."""
    path = os.pathsep.join([str(CHECKOUT), *filter(None, [os.environ.get("PYTHONPATH")])])
    full_env = {**os.environ, "PYTHONPATH": path, "DDTREE_SGLANG_CPU": "1", **(env or {})}
    fields = {"algorithm": algorithm, "prompts": prompts, "max_new_tokens": MAX_NEW_TOKENS, **request}
    proc = subprocess.run(
        [sys.executable, str(ENGINE_RUN), json.dumps(fields)], env=full_env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return [
        Run(r["output_ids"], r["spec_verify_ct"], r["histogram"], r["rid"], r["completion_tokens"]) for r in records
    ]


def ddtree_runs(
    method: str,
    prompts: list[list[int]],
    budget: int | None = None,
    topk: int | None = None,
    pair: tuple[Path, Path] | None = None,
) -> list[Run]:
    """The same prompts as one batch through `ddtree generate --json` on CPU in float32 (on the default pair,
    or on `pair`'s target and drafter directories)."""
    args = ["generate", "--method", method, "--device", "cpu", "--dtype", "float32", "--json"]
    args += ["--model", str(pair[0]), "--drafter", str(pair[1])] if pair is not None else []
    args += ["--max-new-tokens", str(MAX_NEW_TOKENS)]
    args += ["--budget", str(budget)] if budget is not None else []
    args += ["--topk", str(topk)] if topk is not None else []
    for ids in prompts:
        args += ["--prompt-ids", ",".join(map(str, ids))]
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(args) == 0
    records: list[dict[str, Any]] = [json.loads(line) for line in out.getvalue().splitlines()]
    return [Run(r["token_ids"], r["steps"], histogram([n - 1 for n in r["acceptance_lengths"]])) for r in records]


def assert_same_runs(ours: list[Run], theirs: list[Run]) -> None:
    assert len(ours) == len(theirs)
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert b.token_ids == a.token_ids, f"request {i}: tokens differ"
        assert b.steps == a.steps, f"request {i}: verify steps differ"
        assert trimmed(b.histogram) == trimmed(a.histogram), f"request {i}: acceptance histograms differ"
        assert sum(b.histogram) == b.steps


def trimmed(hist: list[int]) -> list[int]:
    out = list(hist)
    while out and out[-1] == 0:
        out.pop()
    return out
