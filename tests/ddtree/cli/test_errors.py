"""Every bad value and broken file is one clear line on stderr and exit status 2: never a traceback, never
silence. `generate`, `bench` and `serve` run in-process on the tiny pair; `serve` loads the pair here as its
engine process would and stops where the processes would start (a stub), so a check that lets a bad value
through shows as a server that started. (The engine process's own errors reach the user as one line too:
tests/ddtree/server/test_processes.py.)"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from ddtree.cli.main import main
from ddtree.engine import capacity


class ServerStub:
    """The launcher in these tests: loads the pair as the engine process does first, then records that the
    server would have started."""

    started = 0

    def __init__(self, settings: object, *args: object) -> None:
        self.settings = settings

    def run(self) -> int:
        from ddtree.server.model import ServerSettings, load_model

        assert isinstance(self.settings, ServerSettings)
        load_model(self.settings)
        ServerStub.started += 1
        return 0


@pytest.fixture(autouse=True)
def no_server(monkeypatch: pytest.MonkeyPatch) -> None:
    from ddtree.server import launch

    monkeypatch.setattr(launch, "Launcher", ServerStub)
    ServerStub.started = 0


def one_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run the CLI; assert exit 2 with one line on stderr, no traceback and no server; return the line."""
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, (code, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ddtree: error: "), err
    assert "Traceback" not in err and ServerStub.started == 0
    return lines[0]


def commands(target: Path, drafter: Path) -> dict[str, list[str]]:
    pair = ["--model", str(target), "--drafter", str(drafter), "--device", "cpu"]
    return {
        "generate": ["generate", *pair, "--prompt", "hi", "--max-new-tokens", "4"],
        "bench": ["bench", *pair, "--limit", "1", "--max-new-tokens", "4", "--budgets", "4"],
        "serve": ["serve", *pair, "--port", "0"],
    }


@pytest.mark.parametrize(
    ("command", "extra", "message"),
    [
        ("generate", ["--temperature", "nan"], "--temperature must be a finite number, got nan"),
        ("generate", ["--temperature", "inf"], "--temperature must be a finite number, got inf"),
        ("generate", ["--temperature", "-0.5"], "--temperature must be >= 0, got -0.5"),
        ("generate", ["--temperature", "warm"], "--temperature must be a number, got 'warm'"),
        ("generate", ["--topk", "0"], "--topk must be >= 1, got 0"),
        ("generate", ["--budget", "0"], "--budget must be >= 1, got 0"),
        ("generate", ["--max-new-tokens", "-1"], "--max-new-tokens must be >= 1, got -1"),
        ("generate", ["--seed", "-1"], "--seed must be in 0..4294967295, got -1"),
        ("bench", ["--limit", "0"], "--limit must be >= 1, got 0"),
        ("bench", ["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
        ("bench", ["--budgets", "8,0"], "--budgets must be comma-separated integers >= 1, got '8,0'"),
        ("bench", ["--rounds", "-2"], "--rounds must be >= 1, got -2"),
        ("serve", ["--port", "65536"], "--port must be in 0..65535, got 65536"),
        ("serve", ["--shutdown-timeout", "nan"], "--shutdown-timeout must be a finite number, got nan"),
        ("serve", ["--topk", "-1"], "--topk must be >= 1, got -1"),
    ],
)
def test_a_bad_flag_value_is_one_line_naming_flag_and_value(
    tiny_dirs: tuple[Path, Path], capsys: pytest.CaptureFixture[str], command: str, extra: list[str], message: str
) -> None:
    assert one_line([*commands(*tiny_dirs)[command], *extra], capsys) == f"ddtree: error: {message}"


@pytest.mark.parametrize(
    "argv",
    [
        ["models", "init-tiny", "--out", "x", "--hidden-size", "30"],
        ["models", "init-tiny", "--out", "x", "--num-layers", "0"],
        ["drafter", "train", "--data", "x", "--out", "y", "--lr", "nan"],
        ["drafter", "data", "--out", "y", "--multi-turn", "inf"],
        ["drafter", "part", "x", "--dest", "y", "--max-mib", "-1"],
    ],
)
def test_other_commands_check_their_numbers_too(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    flag, value = argv[-2:]
    line = one_line(argv, capsys)
    assert flag in line and value in line


def test_the_console_script_prints_one_line_and_exits_2(tiny_dirs: tuple[Path, Path]) -> None:
    argv = [*commands(*tiny_dirs)["generate"], "--temperature", "nan"]
    proc = subprocess.run([sys.executable, "-m", "ddtree.cli", *argv], capture_output=True, text=True, check=False)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == "ddtree: error: --temperature must be a finite number, got nan\n"


@pytest.mark.parametrize("command", ["generate", "bench", "serve"])
def test_a_tree_longer_than_the_context_is_refused_before_anything_allocates(
    tiny_dirs: tuple[Path, Path], capsys: pytest.CaptureFixture[str], command: str
) -> None:
    flag = "--budgets" if command == "bench" else "--budget"
    line = one_line([*commands(*tiny_dirs)[command], flag, "100000"], capsys)
    assert line.endswith(
        "ddtree B=100000: a tree of 100001 tokens (verified in one forward) exceeds the model's "
        "context length of 4096 tokens"
    )


@pytest.mark.parametrize("command", ["generate", "bench"])
def test_more_new_tokens_than_the_context_are_refused(
    tiny_dirs: tuple[Path, Path], capsys: pytest.CaptureFixture[str], command: str
) -> None:
    line = one_line([*commands(*tiny_dirs)[command], "--max-new-tokens", "1000000000"], capsys)
    assert "(prompt and new tokens) exceed the model's context length of 4096 tokens" in line


@pytest.mark.parametrize(
    ("command", "extra"),
    [("generate", ["--budget", "512"]), ("bench", ["--budgets", "2000"]), ("serve", ["--max-batch-size", "100000"])],
)
def test_buffers_beyond_the_free_memory_are_refused(
    tiny_dirs: tuple[Path, Path],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    command: str,
    extra: list[str],
) -> None:
    monkeypatch.setattr(capacity, "free_memory", lambda device: 2 * 10**6)
    line = one_line([*commands(*tiny_dirs)[command], *extra], capsys)
    assert " of KV cache, " in line and line.endswith("of tree buffers); 2.0 MB are free on cpu")


def _truncate(d: Path) -> None:
    """Cut the weights in half: the header is whole, the tensors are not."""
    weights = d / "model.safetensors"
    with weights.open("r+b") as f:
        f.truncate(weights.stat().st_size // 2)


def _set_config(**fields: object) -> Callable[[Path], None]:
    def edit(d: Path) -> None:
        config = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**config, **fields}))

    return edit


BROKEN_TARGETS: dict[str, tuple[Callable[[Path], None], str, str]] = {  # how, file named, problem
    "truncated weights": (_truncate, "model.safetensors", "incomplete metadata"),
    "garbage weights": (lambda d: (d / "model.safetensors").write_bytes(os.urandom(4096)), "model.safetensors", ""),
    "config not JSON": (lambda d: (d / "config.json").write_text("{not json"), "config.json", "not a valid JSON"),
    "config with a text size": (_set_config(hidden_size="wide"), "config.json", "hidden_size"),
    "config with no layers": (_set_config(num_hidden_layers=0), "config.json", "num_hidden_layers must be"),
    "tokenizer not JSON": (lambda d: (d / "tokenizer.json").write_text("[garbage"), "tokenizer.json", "tokenizer"),
}


@pytest.mark.parametrize("command", ["generate", "bench", "serve"])
@pytest.mark.parametrize("broken", list(BROKEN_TARGETS))
def test_a_broken_model_file_is_one_line_naming_it(
    tiny_dirs: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str, broken: str
) -> None:
    target, drafter = tiny_dirs
    copy = tmp_path / "target"
    shutil.copytree(target, copy)
    edit, name, problem = BROKEN_TARGETS[broken]
    edit(copy)
    line = one_line(commands(copy, drafter)[command], capsys)
    assert (str(copy / name) if name != "tokenizer.json" else name) in line and problem in line


@pytest.mark.parametrize("command", ["generate", "bench", "serve"])
def test_a_gguf_file_or_a_truncated_drafter_is_one_line(
    tiny_dirs: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    target, drafter = tiny_dirs
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + bytes(100))
    line = one_line(commands(gguf, drafter)[command], capsys)
    assert f"'{gguf}' is a GGUF file, not a model directory" in line
    cut = tmp_path / "drafter"
    shutil.copytree(drafter, cut)
    _truncate(cut)
    line = one_line(commands(target, cut)[command], capsys)
    assert f"cannot load drafter weights '{cut / 'model.safetensors'}'" in line


def test_a_prompt_file_without_prompts_is_an_error_not_an_empty_table(
    tiny_dirs: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    empty, wrong = tmp_path / "empty.jsonl", tmp_path / "wrong.jsonl"
    empty.write_text("\n")
    wrong.write_text('{"prompt": "fine"}\n{"prompt": 7}\n')
    bench = commands(*tiny_dirs)["bench"]
    assert one_line([*bench, "--prompts", str(empty)], capsys) == f"ddtree: error: no prompts in '{empty}'"
    assert "line 2: 'prompt' must be a non-empty string" in one_line([*bench, "--prompts", str(wrong)], capsys)


def test_serve_with_good_values_gets_as_far_as_starting(
    tiny_dirs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """The stub stands where uvicorn starts: the checks above stop before it, and good values reach it."""
    assert main(commands(*tiny_dirs)["serve"]) == 0
    assert ServerStub.started == 1
