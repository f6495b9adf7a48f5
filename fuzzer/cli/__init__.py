"""The ``fuzz`` command line (SPEC §9).

Only this package prints. Library code raises :class:`fuzzer.errors.FuzzError`;
the group below turns it into one line on stderr and exit status 2. Exit status 1
is reserved for "the oracle found something" (``fuzz replay``), so scripts and
``git bisect run`` can tell a finding from a broken invocation.

One module per command; shared options live in ``_options``.
"""

from __future__ import annotations

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


class _FuzzGroup(click.Group):
    """A click group that turns the fuzzer's own errors into one clear line."""

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


def _register() -> None:
    from fuzzer.cli import (  # noqa: PLC0415 - keep the import graph of the CLI explicit
        calibrate,
        campaign,
        export,
        findings,
        minimize,
        replay,
        report,
        show,
        sim,
        status,
    )

    for module in (campaign, status, findings, show, minimize, export, replay, calibrate, sim, report):
        cli.add_command(module.command)


_register()


def main() -> None:
    cli(prog_name="fuzz")
