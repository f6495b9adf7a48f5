"""Where the CLI writes: one rich console for stdout, one for stderr."""

from __future__ import annotations

import sys

from rich.console import Console

# Piped output (CI logs, `| less`) gets room for the widest table instead of rich's 80 columns.
_PIPE_WIDTH = 160

out = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else _PIPE_WIDTH)
err = Console(stderr=True, highlight=False, soft_wrap=True, width=None if sys.stderr.isatty() else _PIPE_WIDTH)


def warn_if_unreliable(calibration) -> None:
    """One warning line when the calibration is too noisy to judge 2x slowdowns reliably."""
    if (note := calibration.reliability_note()) is not None:
        err.print(f"warning: {note}")
