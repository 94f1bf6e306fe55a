"""The model cache under `$DDTREE_HOME` (default ~/.cache/ddtree): manifests, checks, the pull lock.

A cached model directory is complete only when its manifest, written last, lists every file with its size,
mtime and sha256. The quick check (`check_directory`) compares sizes and mtimes and hashes only the files
whose mtime moved (a file rewritten in place keeps its size); the deep check hashes every file. Pulls of one
model take an exclusive `flock` on `models/.NAME.lock`, build in temporary directories beside the result and
rename the result into place, so a pull killed midway leaves only a temporary directory (`.NAME.tmp-*`),
which the next pull removes under the lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MANIFEST = "ddtree-manifest.json"


def ddtree_home() -> Path:
    return Path(os.environ.get("DDTREE_HOME") or Path.home() / ".cache" / "ddtree")


def sha256_file(path: Path) -> str:
    """The file's sha256, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass(frozen=True)
class FileCheck:
    """One file of a manifest: `problem` is None when the file is intact."""

    name: str
    problem: str | None = None
    hashed: bool = False  # its sha256 was computed (deep check, or its mtime had moved)
    mtime_ns: int | None = None  # its mtime now, where that is not the manifest's but the sha256 matched


def read_manifest(directory: Path) -> dict[str, Any] | None:
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    return manifest if isinstance(files, dict) else None


def check_file(directory: Path, name: str, meta: Any, deep: bool) -> FileCheck:
    """Size first, then the sha256 where `deep` or where the mtime is not the manifest's."""
    try:
        stat = (directory / name).stat()
        size, digest = int(meta["size"]), str(meta["sha256"])
    except FileNotFoundError:
        return FileCheck(name, "missing")
    except (OSError, KeyError, TypeError, ValueError) as exc:
        return FileCheck(name, f"unreadable ({exc})")
    if stat.st_size != size:
        return FileCheck(name, f"size {stat.st_size} bytes, the manifest says {size}")
    same_mtime = meta.get("mtime_ns") == stat.st_mtime_ns
    if not deep and same_mtime:
        return FileCheck(name)
    if sha256_file(directory / name) != digest:
        return FileCheck(name, "sha256 differs from the manifest's", hashed=True)
    return FileCheck(name, hashed=True, mtime_ns=None if same_mtime else stat.st_mtime_ns)


def check_directory(directory: Path, deep: bool = False) -> list[FileCheck] | None:
    """A check per file of the manifest; None where there is no readable manifest (an unfinished build)."""
    manifest = read_manifest(directory)
    if manifest is None:
        return None
    return [check_file(directory, name, meta, deep) for name, meta in sorted(manifest["files"].items())]


def is_complete(directory: Path, deep: bool = False) -> bool:
    """True when the manifest exists and every file matches it (`check_directory`)."""
    checks = check_directory(directory, deep)
    return checks is not None and all(c.problem is None for c in checks)


def refresh_mtimes(directory: Path, checks: list[FileCheck]) -> None:
    """Record the new mtimes of files that were hashed and matched, so the next quick check skips them."""
    manifest = read_manifest(directory)
    moved = {c.name: c.mtime_ns for c in checks if c.mtime_ns is not None}
    if manifest is None or not moved:
        return
    for name, mtime in moved.items():
        manifest["files"][name]["mtime_ns"] = mtime
    _write_json(directory / MANIFEST, manifest)


def write_manifest(directory: Path, extra: dict[str, str]) -> None:
    """List every file of `directory` with its size, mtime and sha256 (the last thing a build writes)."""
    files = {}
    for path in sorted(directory.iterdir()):
        if path.is_file() and path.name != MANIFEST:
            stat = path.stat()
            files[path.name] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": sha256_file(path)}
    _write_json(directory / MANIFEST, {**extra, "files": files})


def _write_json(path: Path, value: Any) -> None:
    """Write through a temporary file and an atomic rename: a reader sees the old file or the new one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-")
    with os.fdopen(fd, "w") as f:
        json.dump(value, f, indent=2)
    os.replace(tmp, path)


@contextlib.contextmanager
def pull_lock(root: Path, name: str, quiet: bool = False) -> Iterator[None]:
    """Hold the exclusive lock of `name`'s pulls (released by the kernel if the process dies)."""
    root.mkdir(parents=True, exist_ok=True)
    path = root / f".{name}.lock"
    with path.open("a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not quiet:
                print(f"ddtree: waiting for another pull of {name} ({path})", file=sys.stderr, flush=True)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def temp_prefix(name: str) -> str:
    """The prefix of `name`'s build directories (temporary, in the directory that holds the result)."""
    return f".{name}.tmp-"


def remove_stale(root: Path, name: str) -> list[Path]:
    """Remove what interrupted pulls of `name` left in `root` (also the `.NAME-xxxxxxxx` directories of earlier
    versions); call it holding `pull_lock`."""
    legacy = re.compile(rf"\.{re.escape(name)}-[a-z0-9_]{{8}}")
    found = root.iterdir() if root.is_dir() else iter(())
    stale = [p for p in found if p.is_dir() and (p.name.startswith(temp_prefix(name)) or legacy.fullmatch(p.name))]
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale


def replace_directory(new: Path, final: Path) -> None:
    """Put `new` at `final`: the old directory, if any, is renamed aside first and removed after."""
    old = None
    if final.exists():
        old = Path(tempfile.mkdtemp(dir=final.parent, prefix=temp_prefix(final.name))) / "old"
        final.rename(old)
    new.rename(final)
    if old is not None:
        shutil.rmtree(old.parent, ignore_errors=True)


def describe_problems(directory: Path, checks: list[FileCheck] | None) -> str:
    """One line: why a cached directory is not complete."""
    if checks is None:
        return f"{directory} has no manifest (an unfinished build)"
    bad = [f"{c.name}: {c.problem}" for c in checks if c.problem is not None]
    return f"{directory}: " + "; ".join(bad)
