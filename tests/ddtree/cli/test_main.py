from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ddtree.cli.main import main
from ddtree.models.tiny import write_tiny_target


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def gen_args(target: Path, drafter: Path, *extra: str) -> list[str]:
    return ["generate", "--model", str(target), "--drafter", str(drafter), "--max-new-tokens", "12", *extra]


def test_generate_json_is_lossless_across_methods(
    tiny_dirs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    target, drafter = tiny_dirs
    records = {}
    for method in ("ar", "dflash", "ddtree"):
        code, out, _ = run(
            [*gen_args(target, drafter, "--method", method, "--budget", "16"), "--prompt", "hi", "--json"], capsys
        )
        assert code == 0
        records[method] = json.loads(out)
    assert set(records["ddtree"]) == {"token_ids", "text", "steps", "acceptance_lengths", "tokens_per_second"}
    assert len(records["ar"]["token_ids"]) == 12
    assert records["ar"]["token_ids"] == records["dflash"]["token_ids"] == records["ddtree"]["token_ids"]
    assert records["ddtree"]["steps"] == len(records["ddtree"]["acceptance_lengths"])


def test_generate_prompt_ids_and_text(tiny_dirs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    target, drafter = tiny_dirs
    code, out, err = run([*gen_args(target, drafter), "--prompt-ids", "1,2,3", "--prompt-ids", "4"], capsys)
    assert code == 0
    assert len(out.splitlines()) >= 2 and "steps" in err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--budget", "0"], "--budget must be >= 1"),
        (["--topk", "100000"], "--topk must be in 1..258"),
        (["--temperature", "-1"], "--temperature"),
        (["--prompt-ids", "1,x"], "comma-separated integers"),
        (["--prompt-ids", "99999"], "outside the vocabulary"),
    ],
)
def test_bad_input_is_one_clear_line_and_exit_2(
    tiny_dirs: tuple[Path, Path], capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    target, drafter = tiny_dirs
    argv = gen_args(target, drafter, *extra)
    if "--prompt-ids" not in extra:
        argv += ["--prompt", "hello"]
    code, _, err = run(argv, capsys)
    assert code == 2
    assert message in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_missing_and_unreadable_model_directories(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(["generate", "--model", str(tmp_path / "nope"), "--method", "ar", "--prompt", "x"], capsys)
    assert code == 2 and "missing or has no config.json" in err
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{not json")
    code, _, err = run(["generate", "--model", str(tmp_path / "bad"), "--method", "ar", "--prompt", "x"], capsys)
    assert code == 2 and "cannot read the model config" in err


def test_drafter_that_does_not_fit_the_target(
    tiny_dirs: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target, _ = tiny_dirs
    other = write_tiny_target(tmp_path / "wide", hidden_size=48, num_layers=2)
    assert main(["drafter", "init", "--target", str(other), "--out", str(tmp_path / "d48")]) == 0
    capsys.readouterr()
    code, _, err = run([*gen_args(target, tmp_path / "d48"), "--prompt", "x"], capsys)
    assert code == 2 and "hidden size 48 does not match the target's 32" in err
    code, _, err = run([*gen_args(target, tmp_path / "missing"), "--prompt", "x"], capsys)
    assert code == 2 and "drafter directory" in err


def test_method_without_drafter(tiny_dirs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    target, _ = tiny_dirs
    code, _, err = run(["generate", "--model", str(target), "--method", "ddtree", "--prompt", "x"], capsys)
    assert code == 2 and "needs --drafter" in err


def test_console_script_exit_code(tiny_dirs: tuple[Path, Path]) -> None:
    target, drafter = tiny_dirs
    proc = subprocess.run(
        [sys.executable, "-m", "ddtree.cli", *gen_args(target, drafter, "--budget", "-3"), "--prompt", "x"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == "ddtree: error: --budget must be >= 1, got -3"


def test_drafter_with_another_vocabulary(
    tiny_dirs: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target, drafter = tiny_dirs
    other = tmp_path / "vocab"
    other.mkdir()
    config = json.loads((drafter / "config.json").read_text())
    config["vocab_size"] = 300
    (other / "config.json").write_text(json.dumps(config))
    (other / "model.safetensors").write_bytes((drafter / "model.safetensors").read_bytes())
    code, _, err = run([*gen_args(target, other), "--prompt", "x"], capsys)
    assert code == 2 and "vocabulary 300 does not match the target's 258" in err


def test_cuda_graphs_on_without_a_gpu_is_a_clear_error(
    tiny_dirs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    target, drafter = tiny_dirs
    pair = ["--model", str(target), "--drafter", str(drafter), "--device", "cpu", "--cuda-graphs", "on"]
    assert main(["generate", *pair, "--prompt", "hi"]) == 2
    assert main(["bench", *pair, "--limit", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("ddtree: error: --cuda-graphs on needs a CUDA device") == 2


def test_triton_attention_without_a_gpu_is_a_clear_error(
    tiny_dirs: tuple[Path, Path], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the tests' interpreter would let it run
    target, drafter = tiny_dirs
    pair = ["--model", str(target), "--drafter", str(drafter), "--device", "cpu", "--attention", "triton"]
    assert main(["generate", *pair, "--prompt", "hi"]) == 2
    assert main(["bench", *pair, "--limit", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("ddtree: error: --attention triton needs triton and a CUDA device") == 2


def test_serve_hands_its_connection_limits_to_the_server(
    tiny_dirs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from ddtree.server import launch

    seen: list[Any] = []
    monkeypatch.setattr(launch, "serve", lambda settings, host, port: seen.append(settings) or 0)
    target, drafter = tiny_dirs
    limits = ["--header-timeout", "2.5", "--body-timeout", "7", "--max-connections", "64", "--backlog", "16"]
    limits += ["--keep-alive-timeout", "3", "--max-header-bytes", "4096"]
    assert main(["serve", "--model", str(target), "--drafter", str(drafter), *limits]) == 0
    (settings,) = seen
    assert (settings.header_timeout, settings.body_timeout) == (2.5, 7.0)
    assert (settings.max_connections, settings.backlog) == (64, 16)
    assert (settings.keep_alive_timeout, settings.max_header_bytes) == (3, 4096)


@pytest.mark.parametrize("flag", ["--header-timeout", "--body-timeout"])
def test_serve_refuses_a_timeout_that_is_not_positive(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", flag, "0"]) == 2
    assert f"{flag} must be > 0" in capsys.readouterr().err
