"""``--launch CMD`` and ``--target-file FILE``: the fuzzer starts the server itself (issue 17).

:func:`resolve` turns the options into a :class:`~fuzzer.execute.launch.LaunchSpec`;
:func:`fuzzer.cli._target.open_target` starts it, owns its process group and stops it on
every way out (the end, an error, Ctrl-C, SIGTERM).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from typing import AsyncIterator

import click

from fuzzer.errors import ConfigError
from fuzzer.execute.launch import LAUNCH_PREFIX, LaunchSpec
from fuzzer.execute.targetfile import TargetFile
from fuzzer.execute.targetfile import load as load_target_file


def launch_options(f):
    """Add --launch and --target-file to a command (the values arrive as ``launch``, ``target_file``)."""
    f = click.option(
        "--target-file",
        metavar="FILE",
        default=None,
        type=click.Path(dir_okay=False),
        help="TOML file saying how to start the server (command, env, ready_url, timeout, log_file, variants).",
    )(f)
    return click.option(
        "--launch",
        metavar="CMD",
        default=None,
        help="Start the server with this command, {port} standing for a loopback port the fuzzer chooses; "
        "it is stopped on exit.",
    )(f)


def resolve(target: str | None, launch: str | None, target_file: str | None) -> TargetFile | None:
    """What to launch, or None (``--target`` or the built-in simulator)."""
    given = [name for name, v in (("--target", target), ("--launch", launch), ("--target-file", target_file)) if v]
    if len(given) > 1:
        raise ConfigError(f"{' and '.join(given)} each say which server to use; give one of them")
    if launch is not None:
        return TargetFile(LaunchSpec.parse(launch))
    if target_file is not None:
        return load_target_file(target_file)
    return None


@contextlib.asynccontextmanager
async def sigterm_as_interrupt() -> AsyncIterator[None]:
    """SIGTERM acts as Ctrl-C while the block runs (the launched server is stopped on the way out),
    unless the command already handles SIGTERM itself (a campaign does)."""
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    terminated = False

    def on_term() -> None:
        nonlocal terminated
        terminated = True
        if task is not None:
            task.cancel()

    loop.add_signal_handler(signal.SIGTERM, on_term)
    try:
        yield
    except asyncio.CancelledError:
        if terminated:
            raise KeyboardInterrupt from None
        raise
    finally:
        loop.remove_signal_handler(signal.SIGTERM)


@contextlib.asynccontextmanager
async def open_launched(spec: LaunchSpec, **http_options) -> AsyncIterator:
    """Start ``spec``'s server, yield a ManagedTarget on it; the server is stopped on every way out."""
    from fuzzer.cli import _console  # noqa: PLC0415
    from fuzzer.execute.http import HttpTarget  # noqa: PLC0415
    from fuzzer.execute.launch import ManagedServer  # noqa: PLC0415
    from fuzzer.execute.managed import ManagedTarget  # noqa: PLC0415

    async with sigterm_as_interrupt():
        server = ManagedServer(spec)
        try:
            url = await server.start()
            async with HttpTarget(url, told=server.told(), **http_options) as http:
                yield ManagedTarget(http, server, sleep=asyncio.sleep,
                                    on_restart=lambda note: _console.err.print(f"note: {note}"))
        finally:
            await asyncio.to_thread(server.close)


def relaunch(store, target_id: int | None, given_url: str | None) -> LaunchSpec | None:
    """The launch command a stored finding's target was started with (``launch:CMD``), unless a URL is given."""
    if given_url is not None or target_id is None:
        return None
    identity = store.get_target(target_id)["url"]
    if not identity.startswith(LAUNCH_PREFIX):
        return None
    return LaunchSpec.parse(identity[len(LAUNCH_PREFIX):])
