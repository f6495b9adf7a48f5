"""The ``fuzz`` command line (ARCHITECTURE.md, "Store and CLI").

Only this package prints. Library code raises :class:`fuzzer.errors.FuzzError`;
the group below turns it into one line on stderr and exit status 2. Exit status 1
is reserved for "the oracle found something" (``fuzz replay``), so scripts and
``git bisect run`` can tell a finding from a broken invocation.

One module per command; shared options live in ``_options``.
"""

from __future__ import annotations

import importlib

import click

from fuzzer import __version__
from fuzzer.errors import FuzzError

#: Exit statuses of every command.
EXIT_OK = 0
EXIT_FINDING = 1
EXIT_ERROR = 2


class _Failure(click.ClickException):
    exit_code = EXIT_ERROR

    def show(self, file=None) -> None:  # noqa: ARG002 - click's signature
        click.echo(f"error: {self.message}", err=True)


#: Command name -> module of fuzzer.cli that defines it. Modules are imported on first use,
#: so `fuzz sim` (started as a child by every command without --target) does not pay for
#: scipy and the oracle at start-up.
_COMMANDS = {
    "campaign": "campaign",
    "status": "status",
    "findings": "findings",
    "show": "show",
    "minimize": "minimize",
    "export": "export",
    "import": "import_",
    "replay": "replay",
    "calibrate": "calibrate",
    "sim": "sim",
    "report": "report",
}


class _FuzzGroup(click.Group):
    """A click group that loads commands lazily and turns the fuzzer's own errors into one clear line."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(_COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        module = _COMMANDS.get(name)
        if module is None:
            return None
        return importlib.import_module(f"fuzzer.cli.{module}").command

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except FuzzError as e:
            raise _Failure(str(e)) from None


@click.group(cls=_FuzzGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "-V", "--version", prog_name="fuzz")
def cli() -> None:
    """A coverage-guided serving-latency fuzzer for OpenAI-compatible LLM servers.

    Run a campaign overnight, then list, minimize and export what it found.
    Without --target, commands run against the built-in simulated server.

    \b
    Example:
        fuzz campaign --duration 2m
        fuzz findings
        fuzz minimize 1 && fuzz export 1
    """


def main() -> None:
    cli(prog_name="fuzz")
