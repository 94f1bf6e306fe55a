"""`ddtree serve` says on stderr, once the pair is loaded and its API processes listen, what it serves and where."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ddtree.runtime import EngineOptions
from ddtree.server import run
from ddtree.server.app import create_app
from ddtree.server.launch import default_api_servers
from ddtree.server.model import ServerSettings, load_model
from tests.ddtree.server.support import serve_process


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


def test_the_line_names_model_method_tree_device_dtype_processes_and_url(tiny_dirs: tuple[Path, Path]) -> None:
    served = load_model(_settings(tiny_dirs, "ddtree", 4))
    assert run.startup_line(served.card(), "http://127.0.0.1:8000", 1) == (
        "ddtree serve: target, method ddtree, budget 4, cpu, float32, graphs off, 1 API server process, "
        "at http://127.0.0.1:8000 (OpenAI API under /v1)"
    )
    served = load_model(_settings(tiny_dirs, "ar", 4))
    assert run.startup_line(served.card(), "http://h:1", 3) == (
        "ddtree serve: target, method ar, cpu, float32, graphs off, 3 API server processes, at http://h:1 "
        "(OpenAI API under /v1)"
    )


def test_the_url_brackets_an_ipv6_host(tiny_dirs: tuple[Path, Path]) -> None:
    settings = _settings(tiny_dirs, "ar", 4)
    app = create_app(settings, load_model(settings))
    assert run.make_server(app, "::1", 8123).url() == "http://[::1]:8123"
    assert run.make_server(app, "0.0.0.0", 9000).url() == "http://0.0.0.0:9000"


@pytest.mark.parametrize(("cores", "count"), [(1, 1), (2, 1), (7, 1), (8, 2), (16, 4), (128, 4)])
def test_the_default_api_server_count_is_a_quarter_of_the_cores(cores: int, count: int) -> None:
    assert default_api_servers(cores) == count


def test_serve_prints_the_line_with_the_port_bound(tiny_dirs: tuple[Path, Path], tmp_path: Path) -> None:
    """The real server on port 0: the line comes once, after loading and once every API process listens, with
    the port the system picked and the API processes it chose."""
    flags = ("--device", "cpu", "--budget", "4", "--max-model-len", "64")
    with serve_process(tiny_dirs, tmp_path / "serve.log", *flags) as server:
        lines = [line for line in server.text().splitlines() if line.startswith("ddtree serve:")]
        assert len(lines) == 1, lines
        found = re.fullmatch(
            r"ddtree serve: target, method ddtree, budget 4, cpu, float64, graphs off, (\d+) API server process(es)?, "
            r"at http://127\.0\.0\.1:(\d+) \(OpenAI API under /v1\)",
            lines[0],
        )
        assert found and int(found[3]) > 0, lines[0]
        assert int(found[1]) == default_api_servers()
        assert len(server.processes()) == 1 + default_api_servers()  # the engine's and the API processes
