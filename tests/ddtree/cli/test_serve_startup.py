"""`ddtree serve` says on stderr, once the pair is loaded and uvicorn listens, what it serves and where."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ddtree.cli.main import main
from ddtree.runtime import EngineOptions
from ddtree.server import run
from ddtree.server.app import create_app
from ddtree.server.model import ServerSettings, load_model


def _settings(tiny_dirs: tuple[Path, Path], method: str, budget: int) -> ServerSettings:
    target, drafter = tiny_dirs
    return ServerSettings(
        model=str(target),
        drafter=str(drafter),
        method=method,
        budget=budget,
        max_model_len=64,
        options=EngineOptions(device="cpu"),
    )


def test_the_line_names_model_method_tree_device_dtype_and_url(tiny_dirs: tuple[Path, Path]) -> None:
    served = load_model(_settings(tiny_dirs, "ddtree", 4))
    assert run.startup_line(served, "http://127.0.0.1:8000") == (
        "ddtree serve: target, method ddtree, budget 4, cpu, float32, graphs off, "
        "at http://127.0.0.1:8000 (OpenAI API under /v1)"
    )
    served = load_model(_settings(tiny_dirs, "ar", 4))
    assert run.startup_line(served, "http://h:1") == (
        "ddtree serve: target, method ar, cpu, float32, graphs off, at http://h:1 (OpenAI API under /v1)"
    )


def test_the_url_brackets_an_ipv6_host(tiny_dirs: tuple[Path, Path]) -> None:
    settings = _settings(tiny_dirs, "ar", 4)
    app = create_app(settings, load_model(settings))
    assert run.make_server(app, "::1", 8123).url() == "http://[::1]:8123"
    assert run.make_server(app, "0.0.0.0", 9000).url() == "http://0.0.0.0:9000"


def test_serve_prints_the_line_with_the_port_bound(
    tiny_dirs: tuple[Path, Path], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real server on port 0, stopped as soon as it has started: the line comes once, after loading,
    with the port the system picked; servers made outside `serve` (tests, embedders) stay quiet."""
    started = run.GracefulServer.startup

    async def start_then_stop(self: run.GracefulServer, sockets: object = None) -> None:
        await started(self, None)
        self.should_exit = True

    monkeypatch.setattr(run.GracefulServer, "startup", start_then_stop)
    target, drafter = tiny_dirs
    argv = ["serve", "--model", str(target), "--drafter", str(drafter), "--device", "cpu", "--budget", "4"]
    assert main([*argv, "--port", "0", "--max-model-len", "64"]) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("ddtree serve:")]
    assert len(lines) == 1, lines
    found = re.fullmatch(
        r"ddtree serve: target, method ddtree, budget 4, cpu, float32, graphs off, "
        r"at http://127\.0\.0\.1:(\d+) \(OpenAI API under /v1\)",
        lines[0],
    )
    assert found and int(found[1]) > 0, lines[0]
    assert run.make_server(create_app(_settings(tiny_dirs, "ar", 4)), "127.0.0.1", 0).announce is False
