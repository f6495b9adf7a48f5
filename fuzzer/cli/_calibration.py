"""The calibration a command judges by, read from and written to its database.

The rule (the stored calibration while it is fresh, else one measured now) is the oracle's,
:func:`fuzzer.oracle.calibrate.reuse_or_calibrate`, and the campaign follows it too; the
oracle does not know the store, so this is the database's side of it for ``fuzz replay``
and ``fuzz minimize``: read under a target's keys, store under the first, say on stderr
what is measured and why.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence

from fuzzer.cli._console import err, warn_if_unreliable
from fuzzer.errors import TargetError
from fuzzer.execution import Target
from fuzzer.oracle.calibrate import reuse_or_calibrate
from fuzzer.oracle.calibration import Calibration
from fuzzer.store import Store


def stored_calibration(store: Store | None, keys: Sequence[str]) -> Calibration | None:
    """The newest calibration stored under any of a target's ``keys`` (none without a database)."""
    data = None if store is None else store.latest_calibration(*keys)
    return None if data is None else Calibration.from_dict(data)


async def calibration_for(
    target: Target,
    store: Store | None,
    keys: Sequence[str],
    *,
    seed: int,
    hint: str = "",
    clock: Callable[[], float] = time.time,
) -> Calibration:
    """The calibration to judge ``target`` by; one measured here is stored under ``keys[0]``.

    ``seed`` orders the probes of a measurement; ``hint`` ends the line that announces one.
    """
    stored = stored_calibration(store, keys)

    def measuring(stale: Calibration | None) -> None:
        why = "no stored calibration for it" if stale is None else f"its stored one is {_age(stale, clock)} old"
        err.print(f"calibrating {keys[0]} first ({why}{hint})")

    def save(fresh: Calibration) -> None:
        if store is not None:
            store.save_calibration(keys[0], fresh.to_dict())

    def refresh_failed(error: TargetError) -> None:
        assert stored is not None
        err.print(f"warning: calibrating again failed ({error}); judging by the stored calibration, "
                  f"{_age(stored, clock)} old")

    calibration = await reuse_or_calibrate(
        target, stored, rng=lambda: random.Random(seed), save=save, clock=clock,
        on_measure=measuring, on_refresh_failed=refresh_failed,
    )
    warn_if_unreliable(calibration)
    return calibration


def _age(calibration: Calibration, clock: Callable[[], float]) -> str:
    hours = calibration.age_s(clock()) / 3600.0
    return f"{hours:.1f} h"
