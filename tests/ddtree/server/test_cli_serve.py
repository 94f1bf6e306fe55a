"""`ddtree serve`: bad flags are one line and exit 2, before any model is loaded or pulled."""

from __future__ import annotations

import pytest

from ddtree.cli.main import main


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--port", "-1"], "--port must be in 0..65535, got -1"),
        (["--port", "70000"], "--port must be in 0..65535"),
        (["--max-batch-size", "0"], "--max-batch-size must be >= 1, got 0"),
        (["--max-queue", "-3"], "--max-queue must be >= 1"),
        (["--max-model-len", "1"], "--max-model-len must be >= 2"),
        (["--budget", "0"], "--budget must be >= 1"),
        (["--api-key", " "], "--api-key must not be empty"),
        (["--max-body-bytes", "0"], "--max-body-bytes must be >= 1, got 0"),
        (["--shutdown-timeout", "-1"], "--shutdown-timeout must be >= 0"),
        (["--budget", "0"], "--budget must be >= 1"),
        (["--budget", "many"], "--budget"),
        (["--budget", "auto", "--method", "ar"], "--budget auto chooses ddtree trees; it needs --method ddtree"),
        (["--budget-schedule", "/nonexistent/schedule.json"], "cannot read the schedule"),
    ],
)
def test_bad_serve_flags_exit_2_with_one_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DDTREE_HOME", "/nonexistent/ddtree-home")  # nothing may be pulled
    code = main(["serve", *argv])
    _, err = capsys.readouterr()
    assert code == 2
    assert err.startswith("ddtree: error: ") and message in err
    assert len(err.strip().splitlines()) == 1


def test_a_missing_model_directory_is_a_clear_error(tmp_path: object, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["serve", "--model", f"{tmp_path}/nope", "--method", "ar", "--port", "0"])
    _, err = capsys.readouterr()
    assert code == 2 and "ddtree: error:" in err and "missing or has no config.json" in err
