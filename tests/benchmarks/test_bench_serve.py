"""`benchmarks/bench_serve.py --serve LABEL=ARGS`: the label may hold `=` (`B=16`), the flags are split as a
shell would, and a spec without flags is refused."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _bench_serve() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_serve_script", ROOT / "benchmarks" / "bench_serve.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_a_label_may_hold_an_equals_sign() -> None:
    parse = _bench_serve()._server_spec
    assert parse("B=16=--budget 16") == ("B=16", ["--budget", "16"])
    assert parse("ar=--method ar") == ("ar", ["--method", "ar"])
    assert parse("auto=--budget-schedule 'my file.json'") == ("auto", ["--budget-schedule", "my file.json"])


def test_a_spec_without_flags_is_refused() -> None:
    with pytest.raises(SystemExit, match="LABEL=ARGS"):
        _bench_serve()._server_spec("B=16")


def test_clients_and_requests_are_shared_out_evenly() -> None:
    shares = _bench_serve()._shares
    assert shares(10, 3) == [4, 3, 3] and shares(64, 4) == [16] * 4 and sum(shares(7, 5)) == 7


@pytest.mark.parametrize("processes", [1, 3])
def test_the_load_generator_counts_every_token_of_a_stub_that_streams_at_once(processes: int) -> None:
    """Against `stub_server.py` (a token per chunk, no model): every request is read to its end, by one load
    process or several, and the wall time spans them all."""
    import argparse
    import socket
    import subprocess
    import time

    import httpx

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    stub = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "stub_server.py"), "--port", str(port)])
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.post(f"{url}/v1/completions", json={"max_tokens": 1}, timeout=5)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, "the stub did not start"
                time.sleep(0.1)
        args = argparse.Namespace(
            clients=6, requests=20, processes=processes, max_tokens=16, temperature=0.0, model_name=None,
            timeout=30.0, heldout=False, chat=False,
        )  # fmt: skip
        stats = _bench_serve().run_load(url, args)
    finally:
        stub.kill()
        stub.wait(10)
    assert stats["requests"] == 20 and stats["failed"] == 0 and stats["tokens"] == 20 * 16
    assert stats["wall_s"] > 0 and stats["out_tok_per_s"] == pytest.approx(320 / stats["wall_s"])
