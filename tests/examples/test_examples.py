"""Each example in examples/ run as a user runs it, as a subprocess from outside the checkout, on the tiny random pair.

The tiny pair's text is noise, so these check the structure of what the examples print, not its words.
"""

from __future__ import annotations

import json
import os
import py_compile
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.ddtree.server.support import stop_process

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"
BUDGET = 8


def run_example(name: str, *args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    for variable in ("DDTREE_DEBUG_METRICS", "DDTREE_LOG_FILE"):  # the examples set telemetry up themselves
        env.pop(variable, None)
    return subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def pair_args(tiny_dirs: tuple[Path, Path]) -> list[str]:
    return ["--model", str(tiny_dirs[0]), "--drafter", str(tiny_dirs[1])]


def test_python_api_prints_the_text_and_tau(tiny_dirs: tuple[Path, Path], tmp_path: Path) -> None:
    proc = run_example("python_api.py", *pair_args(tiny_dirs), "--max-new-tokens", "12", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    last = proc.stdout.rstrip("\n").splitlines()[-1]
    found = re.fullmatch(r"tau (\d+\.\d\d) over (\d+) steps, \d+\.\d tokens/s, finish: (stop|length)", last)
    assert found is not None, proc.stdout
    assert float(found[1]) >= 1.0 and 1 <= int(found[2]) <= 11


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--prompt", ""], "error: prompt 0 has no tokens"),
        (["--max-new-tokens", "0"], "--max-new-tokens: must be >= 1, got 0"),
    ],
)
def test_python_api_refuses_bad_input_with_one_line(
    tiny_dirs: tuple[Path, Path], tmp_path: Path, args: list[str], message: str
) -> None:
    proc = run_example("python_api.py", *pair_args(tiny_dirs), *args, cwd=tmp_path)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr


def test_python_api_names_a_missing_model(tiny_dirs: tuple[Path, Path], tmp_path: Path) -> None:
    proc = run_example("python_api.py", "--model", str(tmp_path / "nope"), "--drafter", str(tiny_dirs[1]), cwd=tmp_path)
    assert proc.returncode == 2 and "missing or has no config.json" in proc.stderr and "Traceback" not in proc.stderr


def test_analyze_run_prints_a_row_per_configuration_and_advice(tiny_dirs: tuple[Path, Path], tmp_path: Path) -> None:
    log = tmp_path / "steps.jsonl"
    args = [*pair_args(tiny_dirs), "--budgets", "4,8", "--max-new-tokens", "12", "--log", str(log)]
    proc = run_example("analyze_run.py", *args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("config"))
    rows = dict(re.split(r"\s{2,}", line.strip(), maxsplit=1) for line in lines[head + 1 : head + 5])
    assert set(rows) == {"ar", "dflash", "ddtree B=4", "ddtree B=8"}
    step_lines = [r for r in map(json.loads, log.read_text().splitlines()) if r.get("event") == "ddtree.step"]
    assert sum(int(rest.split()[0]) for rest in rows.values()) == len(step_lines)  # the steps column
    assert any(line.startswith("fastest: ") for line in lines)
    assert any(re.match(r"completeness: \d+ of \d+ request-steps logged", line) for line in lines)
    assert any(line.startswith("replayed from ddtree B=8") for line in lines), proc.stdout  # advise's replay
    assert "Explain recursion" not in log.read_text()  # prompts are not logged


def test_analyze_run_will_not_overwrite_a_log(tiny_dirs: tuple[Path, Path], tmp_path: Path) -> None:
    log = tmp_path / "old.jsonl"
    log.write_text("kept\n")
    proc = run_example("analyze_run.py", *pair_args(tiny_dirs), "--log", str(log), cwd=tmp_path)
    assert proc.returncode == 2 and "exists" in proc.stderr and log.read_text() == "kept\n"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def served(tiny_dirs: tuple[Path, Path], tmp_path: Path) -> Iterator[str]:
    """`ddtree serve` on the tiny pair, its tokenizer given a chat template: the base URL of its /v1."""
    target = tmp_path / "target"
    shutil.copytree(tiny_dirs[0], target)
    (target / "chat_template.jinja").write_text(TEMPLATE)
    port = _free_port()
    argv = [sys.executable, "-m", "ddtree.cli", "serve", "--model", str(target), "--drafter", str(tiny_dirs[1])]
    argv += ["--port", str(port), "--budget", str(BUDGET), "--max-model-len", "256", "--max-batch-size", "2"]
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen(argv, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            assert time.monotonic() < deadline, "the server did not come up within 120 s"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                time.sleep(0.2)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        stop_process(proc)
        log.close()


def test_openai_client_gets_a_whole_and_a_streamed_chat_with_their_ddtree_blocks(served: str, tmp_path: Path) -> None:
    proc = run_example("openai_client.py", "--base-url", served, "--max-tokens", "16", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.startswith("model: target\n--- whole\n")
    whole_text = out.split("--- whole\n", 1)[1].split("\nfinish_reason: ", 1)[0]
    streamed_text = out.split("--- streamed\n", 1)[1].rsplit("\nddtree: ", 1)[0]
    assert whole_text == streamed_text  # greedy: the same reply both ways
    assert re.search(r"^finish_reason: (stop|length)$", out, re.M)
    assert re.search(r"^usage: \d+ prompt \+ \d+ completion tokens$", out, re.M)
    blocks = [json.loads(line.removeprefix("ddtree: ")) for line in out.splitlines() if line.startswith("ddtree: {")]
    assert len(blocks) == 2 and blocks[0] == blocks[1]
    assert blocks[0]["method"] == "ddtree" and blocks[0]["budget"] == BUDGET
    assert sum(blocks[0]["acceptance_histogram"]) == blocks[0]["steps"] >= 1


def test_openai_client_without_a_server_is_one_clear_error(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{_free_port()}/v1"
    proc = run_example("openai_client.py", "--base-url", url, cwd=tmp_path, timeout=120)
    assert proc.returncode == 1 and f"error: no server at {url}" in proc.stderr and "Traceback" not in proc.stderr


def test_the_sglang_example_compiles_and_parses_its_flags_without_sglang(tmp_path: Path) -> None:
    script = EXAMPLES / "sglang" / "compare_ddtree_dflash.py"
    py_compile.compile(str(script), cfile=str(tmp_path / "compiled.pyc"), doraise=True)
    proc = run_example("sglang/compare_ddtree_dflash.py", "--help", cwd=tmp_path, timeout=60)
    assert proc.returncode == 0 and proc.stdout.startswith("usage:") and "--drafter" in proc.stdout


def test_the_examples_readme_lists_every_example() -> None:
    readme = (EXAMPLES / "README.md").read_text()
    scripts = sorted(p.relative_to(EXAMPLES).as_posix() for p in EXAMPLES.rglob("*.py"))
    assert scripts and all(f"examples/{s}" in readme for s in scripts), scripts
