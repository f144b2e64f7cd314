"""`rpmemfs --help` names every command the parser has (rpmemfs/cli.py), in its opening line and
in its list, and every command function of the CLI has a command."""

from __future__ import annotations

import argparse
import re

import pytest

from rpmemfs import cli


def _commands() -> list[str]:
    parser = cli.build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return list(sub.choices)


def _help(capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as done:
        cli.main(["--help"])
    assert done.value.code == 0
    return capsys.readouterr().out


def test_every_command_function_has_a_command() -> None:
    functions = {name.removeprefix("cmd_") for name in vars(cli) if name.startswith("cmd_")}
    assert functions == set(_commands())


def test_help_names_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    text = _help(capsys)
    intro = text.split("\n\n")[1]  # after the usage: the line that names them all
    listing = text.split("  COMMAND\n", 1)[1]
    named = set(re.findall(r"[a-z]+", intro))
    listed = set(re.findall(r"^    ([a-z]+)\b", listing, re.M))
    commands = set(_commands())
    assert len(commands) >= 20
    assert commands - named == set(), "rpmemfs --help's opening line leaves them out"
    assert commands - listed == set(), "rpmemfs --help's list of commands leaves them out"
