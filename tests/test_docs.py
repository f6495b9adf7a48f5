"""Every command and every option of ``fuzz`` is documented in the README.

In the style of sqlite-utils' test_docs.py: the commands and their options are read from
the click objects themselves, so a new option without a README line fails here.
"""

from __future__ import annotations

import click
import pytest
from conftest import ROOT

from fuzzer.cli import cli

README = (ROOT / "README.md").read_text()


def _section(name: str) -> str:
    """The README's reference section of one command: from ``### `fuzz NAME``` to the next heading."""
    marker = f"### `fuzz {name}"
    start = README.find(marker)
    if start < 0:
        return ""
    end = README.find("\n#", start + len(marker))
    return README[start:] if end < 0 else README[start:end]


def _commands() -> dict[str, click.Command]:
    ctx = click.Context(cli)
    return {name: cli.get_command(ctx, name) for name in cli.list_commands(ctx)}


def _options() -> list[tuple[str, str]]:
    found = []
    for name, command in sorted(_commands().items()):
        for param in command.params:
            if isinstance(param, click.Option) and not param.hidden:
                longest = max(param.opts, key=len)
                if longest not in ("--help",):
                    found.append((name, longest))
    return found


def test_the_reader_finds_commands_and_options():
    """Positive control: the options read from click are real ones."""
    options = _options()
    assert ("campaign", "--duration") in options and ("replay", "--runs") in options
    assert len(_commands()) >= 10


@pytest.mark.parametrize("name", sorted(_commands()))
def test_command_has_a_reference_section(name):
    assert _section(name), f"README.md has no '### `fuzz {name} ...`' section"


@pytest.mark.parametrize(("command", "option"), _options())
def test_option_is_documented_in_its_command_section(command, option):
    assert f"`{option}" in _section(command), f"fuzz {command} {option} is not in its README section"


def test_a_missing_option_is_caught():
    """Positive control: an option no section documents is not found."""
    assert "`--no-such-option" not in _section("campaign")
