"""`make mutants`: break the code on purpose, one named mutation at a time, and check that a test notices.

Each mutant replaces a piece of source text (or a few, for one idea) in one file of a fresh temporary copy of the
project, runs the tests that should catch it (with `-x`), and is reported as killed, with the first test
that failed, or survived. The unmutated copy runs the same tests first: they must pass, or nothing below
means anything. Exit status 0 only when every mutant is killed.

    python scripts/mutants.py            # all of them
    python scripts/mutants.py --list     # names and what each breaks
    python scripts/mutants.py --only sampling-temperature-twice --only kv-keys-not-compacted
    python scripts/mutants.py --check    # only that every edit still applies (each old text occurs once)
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 900


def _load_list() -> ModuleType:
    """`scripts/mutant_list.py`, by path (the scripts are no package)."""
    spec = importlib.util.spec_from_file_location("mutant_list", Path(__file__).with_name("mutant_list.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


mutant_list = _load_list()
Mutant = mutant_list.Mutant


def _mutants() -> list[Mutant]:
    return mutant_list.mutants()


def _copy_project(dest: Path) -> None:
    """Tracked files and untracked ones git does not ignore: the working tree as it is, without caches."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, (n.decode() for n in listed)):
        source = ROOT / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)


def stale_edits(project: Path, mutants: list[Mutant]) -> list[str]:
    """One line per edit whose old text does not occur exactly once in its file (the code moved on)."""
    stale = []
    for mutant in mutants:
        text = (project / mutant.path).read_text()
        for old, _ in mutant.edits:
            if text.count(old) != 1:
                stale.append(f"{mutant.name}: {old!r} occurs {text.count(old)} times in {mutant.path}, not once")
    return stale


def _apply(project: Path, mutant: Mutant) -> None:
    path = project / mutant.path
    text = path.read_text()
    for old, new in mutant.edits:
        if text.count(old) != 1:
            raise SystemExit(f"{mutant.name}: {old!r} occurs {text.count(old)} times in {mutant.path}, not once")
        text = text.replace(old, new)
    path.write_text(text)


def _pytest(project: Path, tests: tuple[str, ...]) -> tuple[int, str]:
    """Run `tests` in `project` (which shadows the installed packages); exit code and output."""
    env = {**os.environ, "PYTHONPATH": str(project), "PYTHONDONTWRITEBYTECODE": "1"}
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-rf", "-p", "no:cacheprovider", *tests]
    try:
        done = subprocess.run(command, cwd=project, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return -1, "timeout"
    return done.returncode, done.stdout + done.stderr


def _first_failure(output: str) -> str:
    match = re.search(r"^(?:FAILED|ERROR) (\S+)", output, re.MULTILINE)
    return match.group(1) if match else output.strip().splitlines()[-1] if output.strip() else "?"


def run(mutants: list[Mutant], baseline: bool) -> bool:
    with tempfile.TemporaryDirectory(prefix="ddtree-mutants-") as tmp:
        pristine = Path(tmp) / "pristine"
        _copy_project(pristine)
        if baseline:
            tests = tuple(dict.fromkeys(t for m in mutants for t in m.tests))
            code, output = _pytest(pristine, tests)
            if code != 0:
                print(output[-4000:])
                print("the unmutated project fails these tests: fix that first")
                return False
            print(f"baseline: {len(tests)} test files pass on the unmutated copy")
        survived = []
        for mutant in mutants:
            project = Path(tmp) / mutant.name
            shutil.copytree(pristine, project)
            _apply(project, mutant)
            started = time.monotonic()
            code, output = _pytest(project, mutant.tests)
            took = time.monotonic() - started
            verdict = f"killed by {_first_failure(output)}" if code != 0 else "SURVIVED"
            if code == 0:
                survived.append(mutant.name)
            print(f"{mutant.name:<40} {verdict}  ({took:.0f} s)", flush=True)
            shutil.rmtree(project)
    print(
        f"{len(mutants) - len(survived)} of {len(mutants)} mutants killed"
        + (f"; survived: {survived}" if survived else "")
    )
    return not survived


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--only", action="append", default=[], metavar="NAME", help="run only this mutant (repeatable)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the run on the unmutated copy")
    parser.add_argument("--check", action="store_true", help="only check that every edit applies, run nothing")
    args = parser.parse_args()
    mutants = _mutants()
    if args.check:
        stale = stale_edits(ROOT, mutants)
        print("\n".join(stale) or f"all {len(mutants)} mutants apply")
        return 1 if stale else 0
    if args.list:
        for m in mutants:
            print(f"{m.name:<40} {m.path:<28} {m.what}")
        return 0
    unknown = set(args.only) - {m.name for m in mutants}
    if unknown:
        parser.error(f"unknown mutants: {', '.join(sorted(unknown))}")
    chosen = [m for m in mutants if not args.only or m.name in args.only]
    return 0 if run(chosen, baseline=not args.no_baseline) else 1


if __name__ == "__main__":
    sys.exit(main())
