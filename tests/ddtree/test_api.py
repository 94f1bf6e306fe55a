"""The Python API (`ddtree.load_pair`, `Pair.generate`) on the tiny random pair, in float64 so that greedy
comparisons between methods are exact."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

import ddtree
from ddtree.api import Completion, Pair
from ddtree.errors import SettingsError
from ddtree.models.chat import chat_ids
from telemetry import semconv as sc

PROMPTS = ["Hello, tree", "a", "Speculative decoding, step by step."]
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"


@pytest.fixture(scope="module")
def pair(tiny_dirs: tuple[Path, Path]) -> Iterator[Pair]:
    target, drafter = tiny_dirs
    with ddtree.load_pair(str(target), str(drafter), dtype="float64") as loaded:
        yield loaded


def test_ddtree_and_dflash_equal_ar_token_for_token(pair: Pair) -> None:
    ar = pair.generate(PROMPTS, method="ar", max_new_tokens=40)
    for method in ("dflash", "ddtree"):
        outs = pair.generate(PROMPTS, method=method, budget=8, max_new_tokens=40)
        assert [o.token_ids for o in outs] == [o.token_ids for o in ar], method
        assert [o.text for o in outs] == [o.text for o in ar]
    assert all(length == 1 for o in ar for length in o.acceptance_lengths)
    # the drafts were accepted at times, so the tree's paths took part
    assert max(length for o in outs for length in o.acceptance_lengths) > 1


def test_a_str_gives_a_completion_and_a_list_gives_a_list_in_order(pair: Pair) -> None:
    alone = [pair.generate(p, method="ddtree", budget=8, max_new_tokens=12) for p in PROMPTS]
    assert all(isinstance(o, Completion) for o in alone)
    together = pair.generate(PROMPTS, method="ddtree", budget=8, max_new_tokens=12)
    assert isinstance(together, list) and len(together) == len(PROMPTS)
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    assert pair.generate(tuple(PROMPTS[:2]), max_new_tokens=4)[1].token_ids == alone[1].token_ids[:4]


def test_a_completion_carries_its_text_steps_and_tau(pair: Pair) -> None:
    out = pair.generate("Hello, tree", method="ddtree", budget=8, max_new_tokens=30)
    assert len(out.token_ids) == 30 and out.finish_reason == "length"
    assert out.text == pair.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert out.steps == len(out.acceptance_lengths) > 0
    # the prefill gives the first token; each step gives its acceptance length
    assert sum(out.acceptance_lengths) >= len(out.token_ids) - 1
    assert out.acceptance_length == sum(out.acceptance_lengths) / out.steps
    assert out.seconds > 0 and out.tokens_per_second == len(out.token_ids) / out.seconds
    one = pair.generate("Hello, tree", method="ar", max_new_tokens=1)
    assert one.steps == 0 and one.acceptance_length is None


def test_chat_applies_the_tokenizers_template(pair: Pair) -> None:
    assert not pair.tokenizer.chat_template  # the tiny tokenizer has none: chat falls back to the plain text
    plain = pair.generate("hi", method="ar", max_new_tokens=8, chat=False)
    assert pair.generate("hi", method="ar", max_new_tokens=8).token_ids == plain.token_ids
    pair.tokenizer.chat_template = TEMPLATE
    try:
        assert chat_ids(pair.tokenizer, "hi") == pair.tokenizer.encode("<user>hi\n<assistant>")
        templated = pair.generate("hi", method="ar", max_new_tokens=8)
    finally:
        pair.tokenizer.chat_template = None
    by_hand = pair.generate("<user>hi\n<assistant>", method="ar", max_new_tokens=8, chat=False)
    assert templated.token_ids == by_hand.token_ids != plain.token_ids


def test_an_empty_text_is_a_prompt_where_its_template_gives_it_tokens(pair: Pair) -> None:
    """One rule with the CLI and the server: a prompt is refused when it encodes to no tokens, not for its text."""
    with pytest.raises(ValueError, match="prompt 0 has no tokens"):
        pair.generate("", method="ar", max_new_tokens=4)  # no template: the empty text has no tokens
    pair.tokenizer.chat_template = TEMPLATE
    try:
        out = pair.generate("", method="ar", max_new_tokens=4)
    finally:
        pair.tokenizer.chat_template = None
    by_hand = pair.generate("<user>\n<assistant>", method="ar", max_new_tokens=4, chat=False)
    assert out.token_ids == by_hand.token_ids and len(out.token_ids) == 4


def test_the_models_end_of_sequence_token_stops_generation(
    pair: Pair, tiny_dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    tokens = pair.generate("Hello, tree", method="ar", max_new_tokens=40).token_ids
    at = next(i for i in range(3, len(tokens)) if tokens[i] not in tokens[:i])  # a token's first appearance
    target = tmp_path / "target"
    shutil.copytree(tiny_dirs[0], target)
    config = json.loads((target / "generation_config.json").read_text())
    (target / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": tokens[at]}))
    with ddtree.load_pair(str(target), str(tiny_dirs[1]), dtype="float64") as stopping:
        assert tokens[at] in stopping.eos_token_ids
        for method in ("ar", "ddtree"):
            out = stopping.generate("Hello, tree", method=method, budget=8, max_new_tokens=40)
            assert out.token_ids == tokens[: at + 1] and out.finish_reason == "stop", method


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"prompt": ""}, "prompt 0 has no tokens"),
        ({"prompt": ["fine", ""]}, "prompt 1 has no tokens"),
        ({"prompt": []}, "no prompts were given"),
        ({"budget": 0}, "budget must be >= 1, got 0"),
        ({"budget": 0, "method": "ar"}, "budget must be >= 1, got 0"),
        ({"temperature": -0.5}, "temperature must be a finite number >= 0, got -0.5"),
        ({"temperature": float("nan")}, "temperature must be a finite number >= 0"),
        ({"method": "beam"}, "method must be one of ar, dflash, ddtree, got 'beam'"),
        ({"max_new_tokens": 0}, "max_new_tokens must be >= 1, got 0"),
        ({"topk": 0}, "topk must be in 1.."),
        ({"topk": 10**6}, "topk must be in 1..258 (the vocabulary size), got 1000000"),
        ({"seed": -1}, "seed must be in 0.."),
    ],
)
def test_bad_values_raise_value_error_in_the_words_of_the_values(
    pair: Pair, kwargs: dict[str, object], message: str
) -> None:
    args = {"prompt": "Hello", **kwargs}
    with pytest.raises(ValueError, match="^" + re.escape(message)) as raised:
        pair.generate(args.pop("prompt"), **args)  # type: ignore[call-overload]
    assert "--" not in str(raised.value)
    if "prompt" not in message:  # a setting's: the one error type, naming the setting its message starts with
        assert isinstance(raised.value, SettingsError) and message.startswith(raised.value.setting + " ")


def test_a_model_without_a_drafter_runs_ar_only(pair: Pair, tiny_dirs: tuple[Path, Path]) -> None:
    with ddtree.load_pair(str(tiny_dirs[0]), dtype="float64") as alone:
        assert alone.drafter is None
        out = alone.generate("Hello, tree", method="ar", max_new_tokens=10)
        assert out.token_ids == pair.generate("Hello, tree", method="ar", max_new_tokens=10).token_ids
        for method in ("ddtree", "dflash"):
            with pytest.raises(ValueError, match=f"method '{method}' needs a drafter"):
                alone.generate("Hello, tree", method=method)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dtype": "float8"}, "dtype must be one of auto, float32"),
        ({"device": "tpu"}, "device must be one of auto, cpu, cuda"),
        ({"cuda_graphs": "yes"}, "cuda_graphs must be one of auto, on, off"),
        ({"tree_kernel": "cuda"}, "tree_kernel must be one of auto, torch, triton"),
        ({"attention": "flash"}, "attention must be one of auto, sdpa, triton"),
    ],
)
def test_bad_load_values_raise_before_anything_loads(kwargs: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ddtree.load_pair("/nonexistent/model", **kwargs)


def test_a_missing_model_directory_is_a_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"missing or has no config\.json"):
        ddtree.load_pair(str(tmp_path / "nope"))


def test_telemetry_starts_once_at_load_and_close_flushes_it(
    tiny_dirs: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "steps.jsonl"
    for name, value in {
        "DDTREE_DEBUG_METRICS": "1",
        "OTEL_TRACES_EXPORTER": "none",
        "OTEL_METRICS_EXPORTER": "none",
        "DDTREE_LOG_FILE": str(log),
    }.items():
        monkeypatch.setenv(name, value)
    pair = ddtree.load_pair(str(tiny_dirs[0]), str(tiny_dirs[1]), dtype="float64")
    outs = [*pair.generate(PROMPTS[:2], budget=8, max_new_tokens=10), pair.generate("x", method="ar", max_new_tokens=6)]
    pair.close()
    pair.close()  # a second close does nothing
    with pytest.raises(RuntimeError, match="closed"):
        pair.generate("x")
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    steps = [line for line in lines if line.get("event") == sc.EVENT_STEP]
    requests = [line for line in lines if line.get("event") == sc.EVENT_REQUEST]
    assert len(requests) == 3  # both calls in one log: one start, one shutdown
    assert {s["method"] for s in steps} == {"ddtree", "ar"}
    assert sum(len(s[sc.FIELD_ACCEPTED_DRAFTS]) for s in steps) == sum(o.steps for o in outs)
    assert PROMPTS[0] not in log.read_text()  # no prompt text in the logs


def test_import_ddtree_stays_light_and_telemetry_off_imports_no_opentelemetry(tiny_dirs: tuple[Path, Path]) -> None:
    code = textwrap.dedent(
        f"""
        import os, sys
        os.environ.pop("DDTREE_DEBUG_METRICS", None)
        import ddtree
        assert {{"load_pair", "Pair", "Completion"}} <= set(ddtree.__all__)
        heavy = [m for m in ("torch", "transformers") if m in sys.modules]
        assert not heavy, heavy
        with ddtree.load_pair({str(tiny_dirs[0])!r}, {str(tiny_dirs[1])!r}) as pair:
            out = pair.generate("Hello", max_new_tokens=4, budget=4)
        assert len(out.token_ids) == 4
        assert "torch" in sys.modules and not [m for m in sys.modules if m.startswith("opentelemetry")]
        print("ok")
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
