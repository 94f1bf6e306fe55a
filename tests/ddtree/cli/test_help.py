"""The CLI's manners: help on every option, defaults shown (and no "default: None"), an example per command
that parses, `--version`, and old option spellings that still work and are marked in the help."""

from __future__ import annotations

import argparse
import importlib.metadata
import shlex
from pathlib import Path
from typing import Any

import pytest

import ddtree
from ddtree.cli import main as cli_main
from ddtree.cli.common import iter_parsers
from ddtree.cli.main import build_parser, main

PARSERS = {p.prog: p for p in iter_parsers(build_parser())}


def test_every_command_is_walked() -> None:
    assert {
        "ddtree",
        "ddtree bench",
        "ddtree serve",
        "ddtree tune",
        "ddtree models init-tiny",
        "ddtree drafter state import",
    } <= set(PARSERS)
    assert len(PARSERS) == 24


@pytest.mark.parametrize("prog", list(PARSERS))
def test_every_option_and_argument_has_help(prog: str) -> None:
    missing = [
        "/".join(a.option_strings) or a.dest
        for a in PARSERS[prog]._actions
        if not isinstance(a, argparse._SubParsersAction) and not (a.help or "").strip()
    ]
    assert not missing, f"{prog}: no help for {missing}"
    for action in PARSERS[prog]._actions:  # and every subcommand its line in the list
        if isinstance(action, argparse._SubParsersAction):
            assert all((choice.help or "").strip() for choice in action._choices_actions), prog


def _examples(parser: argparse.ArgumentParser) -> list[list[str]]:
    """The epilog's indented `ddtree ...` command lines as argv lists: continuations joined, `# ` comments
    and environment assignments dropped, `a && b` as two."""
    text = (parser.epilog or "").split("examples:\n", 1)[1].replace("\\\n", " ")
    commands = []
    for line in (line for line in text.splitlines() if line.startswith("  ")):  # not the notes below them
        for part in line.split(" # ")[0].split("&&"):
            words = shlex.split(part)
            while words and "=" in words[0]:
                words.pop(0)
            if words and words[0] == "ddtree":
                commands.append(words[1:])
    return commands


@pytest.mark.parametrize("prog", list(PARSERS))
def test_every_command_has_examples_that_parse(prog: str) -> None:
    parser = PARSERS[prog]
    assert parser.epilog and parser.epilog.startswith("examples:\n"), prog
    examples = _examples(parser)
    assert any(" ".join(["ddtree", *argv]).startswith(prog) for argv in examples), f"{prog} has no example of itself"
    for argv in examples:
        args = build_parser().parse_args(argv)  # a bad example raises UserError here
        assert callable(args.func)


def _help(prog: str) -> str:
    return PARSERS[prog].format_help()


def test_defaults_are_shown_but_not_none_or_false() -> None:
    bench = " ".join(_help("ddtree bench").split())
    assert "new tokens per prompt, at most (default: 128)" in bench
    assert "(default: 4,8,16,32,64)" in bench and "(default: ar,dflash,ddtree)" in bench
    assert "(default: 15.0)" in _help("ddtree drafter pack-data")
    for prog in PARSERS:
        text = _help(prog)
        for noise in ("(default: None)", "(default: False)", "(default: [])", "(default: )"):
            assert noise not in text, (prog, noise)
        assert "default: default" not in text, prog


def test_help_never_shows_the_api_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DDTREE_API_KEY", "sekret-key")
    assert "sekret-key" not in build_parser().parse_args(["serve"]).__dict__.values()
    assert "sekret-key" not in {p.prog: p for p in iter_parsers(build_parser())}["ddtree serve"].format_help()


def test_the_server_still_takes_its_key_from_the_environment(
    tiny_dirs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from ddtree.server import launch

    seen: list[Any] = []
    monkeypatch.setattr(launch, "serve", lambda settings, host, port: seen.append(settings) or 0)
    monkeypatch.setenv("DDTREE_API_KEY", "from-env")
    pair = ["--model", str(tiny_dirs[0]), "--drafter", str(tiny_dirs[1]), "--device", "cpu"]
    assert main(["serve", *pair]) == 0
    assert main(["serve", *pair, "--api-key", "from-flag"]) == 0
    assert [s.api_key for s in seen] == ["from-env", "from-flag"]


def test_version(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"ddtree {importlib.metadata.version('ddtree')}\n"

    def not_installed(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    assert cli_main.version() == ddtree.__version__


OLD_AND_NEW = [  # (command, more arguments it needs, old spelling, new spelling, dest)
    ("bench", [], "--limit", "--num-prompts", "num_prompts"),
    ("bench", [], "--json", "--out", "json_out"),
    ("advise", [], "--cost", "--cost-curve", "cost"),
    ("drafter init", ["--out", "d"], "--target", "--model", "target"),
    ("drafter data", ["--out", "d"], "--target", "--model", "target"),
    ("drafter train", ["--out", "d", "--data", "x"], "--target", "--model", "target"),
    ("drafter part", ["b"], "--dest", "--out", "dest"),
]


@pytest.mark.parametrize(("command", "needed", "old", "new", "dest"), OLD_AND_NEW)
def test_old_spellings_still_work_and_are_marked(
    command: str, needed: list[str], old: str, new: str, dest: str
) -> None:
    value, expected = ("7", 7) if dest == "num_prompts" else ("somewhere", "somewhere")
    for spelling in (new, old):
        args = build_parser().parse_args([*command.split(), *needed, spelling, value])
        assert getattr(args, dest) == expected, spelling
    text = " ".join(_help(f"ddtree {command}").split())
    assert f"{new}, {old} " in text and f"({old}: deprecated alias)" in text


@pytest.mark.parametrize("spelling", ["--num-prompts", "--limit"])
def test_an_error_names_the_spelling_typed(spelling: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", spelling, "0"]) == 2
    assert capsys.readouterr().err == f"ddtree: error: {spelling} must be >= 1, got 0\n"
    assert main(["bench", f"{spelling}=x"]) == 2
    assert capsys.readouterr().err == f"ddtree: error: {spelling} must be an integer, got 'x'\n"
