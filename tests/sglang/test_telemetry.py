"""Our telemetry inside SGLang's scheduler (DDTREE_DEBUG_METRICS=1): the step and request log lines of a real
SGLang Engine run (CPU mode, float32, DDTREE budget 8) reconcile with the tokens SGLang served."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from typing import Any

import pytest

from ddtree.models.chat import chat_ids
from ddtree.models.default import default_target
from telemetry import semconv as sc
from tests.sglang.support import MAX_NEW_TOKENS, Run, histogram, requires_sglang, sglang_runs, trimmed

pytestmark = requires_sglang

# "Hi" stops early at an end-of-sequence token (its row leaves the batch); the others run to the length cap,
# usually with a last step whose accepted tokens SGLang cuts at the cap.
PROMPTS = ["Why is the sky blue?", "Hi", "Write a haiku about rain, then explain it."]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Run], list[dict[str, Any]]]:
    """One Engine start: SGLang's outputs and the JSON lines our telemetry wrote in its scheduler process."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(default_target(quiet=True)))
    log = tmp_path_factory.mktemp("telemetry") / "steps.jsonl"
    env = {
        "SGLANG_DDTREE_BUDGET": "8",
        "DDTREE_DEBUG_METRICS": "1",
        "DDTREE_LOG_FILE": str(log),
        "OTEL_TRACES_EXPORTER": "none",
        "OTEL_METRICS_EXPORTER": "none",
    }
    runs = sglang_runs("DDTREE", [chat_ids(tokenizer, p) for p in PROMPTS], env)
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    return runs, lines


def test_step_and_request_lines_reconcile_with_the_tokens_sglang_served(
    run: tuple[list[Run], list[dict[str, Any]]],
) -> None:
    runs, lines = run
    steps = [line for line in lines if line["event"] == sc.EVENT_STEP]
    requests = {line[sc.FIELD_REQUEST_ID]: line for line in lines if line["event"] == sc.EVENT_REQUEST}
    assert steps and len(requests) == len(runs) == len(PROMPTS)
    emitted: dict[str, int] = collections.Counter()
    accepted: dict[str, list[int]] = collections.defaultdict(list)
    for step in steps:
        assert step[sc.FIELD_METHOD] == "ddtree" and step[sc.FIELD_BUDGET] == 8
        assert set(step[sc.FIELD_STAGE_MS]) == set(sc.STAGES)
        assert len(step[sc.FIELD_TREE_NODES]) == len(step[sc.FIELD_REQUEST_IDS])
        rows = zip(step[sc.FIELD_REQUEST_IDS], step[sc.FIELD_EMITTED], step[sc.FIELD_ACCEPTED_DRAFTS], strict=True)
        for rid, e, a in rows:
            emitted[rid] += e
            accepted[rid].append(a)
            assert 1 <= e <= a + 1
    for r in runs:
        served = len(r.token_ids)
        assert served == r.completion_tokens <= MAX_NEW_TOKENS
        assert 1 + emitted[r.rid] == served, f"{r.rid}: the step lines emitted {emitted[r.rid]} after the first token"
        assert len(accepted[r.rid]) == r.steps, f"{r.rid}: step lines against SGLang's verify steps"
        assert histogram(accepted[r.rid]) == trimmed(r.histogram), f"{r.rid}: acceptance histograms differ"
        line = requests[r.rid]
        assert line[sc.FIELD_OUTPUT_TOKENS] == served and line[sc.FIELD_STEPS] == r.steps
        assert line[sc.FIELD_FINISH_REASON] == ("length" if served == MAX_NEW_TOKENS else "stop")
        mean = sum(a + 1 for a in accepted[r.rid]) / r.steps
        assert line[sc.FIELD_MEAN_ACCEPTANCE] == pytest.approx(mean, abs=0.01)
    assert max(a for values in accepted.values() for a in values) >= 2, "no step accepted two drafts"
    assert any(len(r.token_ids) < MAX_NEW_TOKENS for r in runs), "no request stopped before the cap"


OFF_PROBE = """
import json, sys
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.plugins.hook_registry import HookRegistry
from ddtree.sglang import observe
import ddtree.sglang.worker
session = observe.start("cpu", 8, None, "target")
hooked = sorted(t for t in HookRegistry._hooks if t.startswith(observe.PROCESSOR))
print(json.dumps({"session": session is not None, "hooked": hooked,
                  "telemetry": sorted(m for m in sys.modules if m == "telemetry" or m.startswith("telemetry."))}))
"""


@pytest.mark.parametrize("flag", ["", "1"])
def test_telemetry_is_neither_imported_nor_hooked_unless_asked(flag: str) -> None:
    """What the scheduler process does at start-up: SGLang's plugin loader, then the worker's `observe.start`."""
    env = {k: v for k, v in os.environ.items() if k != "DDTREE_DEBUG_METRICS"}
    env |= {"DDTREE_DEBUG_METRICS": flag, "OTEL_TRACES_EXPORTER": "none", "OTEL_METRICS_EXPORTER": "none"}
    env |= {"DDTREE_LOG_FILE": os.devnull}
    out = subprocess.run([sys.executable, "-c", OFF_PROBE], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    if flag:
        assert got["session"] and "telemetry.collector" in got["telemetry"]
        assert [t.rsplit(".", 1)[1] for t in got["hooked"]] == [
            "process_batch_result_decode",
            "process_batch_result_prefill",
        ]
    else:
        assert got == {"session": False, "hooked": [], "telemetry": []}


def test_the_stage_names_are_telemetrys() -> None:
    from ddtree.sglang import observe

    assert (observe.DRAFT, observe.TREE_BUILD, observe.VERIFY, observe.ACCEPT) == sc.STAGES


def test_sglang_finish_reasons() -> None:
    from types import SimpleNamespace

    from ddtree.sglang.observe import finish_reason

    class FINISH_LENGTH: ...  # SGLang's class names

    class FINISH_MATCHED_TOKEN: ...

    class FINISH_ABORT: ...

    reasons = [finish_reason(SimpleNamespace(finished_reason=c())) for c in (FINISH_LENGTH, FINISH_MATCHED_TOKEN)]
    assert reasons == ["length", "stop"]
    assert finish_reason(SimpleNamespace(finished_reason=FINISH_ABORT())) == "cancelled"
