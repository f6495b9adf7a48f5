"""What the minimizer tried that failed, and when it is worth trying again.

Every test of a candidate costs executions, and the minimizer's rounds would try the
same deletions and the same lowered values again and again. So a failed change is
remembered under a key (``"L3 delete"``, ``"L3 prompt_tokens"``, ``"gaps 0.5"``: the
request id first when it concerns one request), with the value that failed and the
*share* of the effect it kept: the failed candidate's effect over the effect of the
trace that was current then. It is tried again only when

* the request it concerns changed (a lowered request may now be deletable), or
* the current trace got strong enough that the same share of its effect would now
  be above the shrinking threshold (lowering the request that set the victim's
  baseline, say, makes the victim's slowdown larger, and deletions that failed by a
  little may pass now).

Effects are measured in shrinking thresholds (1.0: just reproduced while shrinking).
A predicate that does not measure them (a plain yes/no) gets the simple rule: every
deletion forgets everything.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping

from fuzzer.trace import Trace

#: A failed change is tried again when the current effect times its share reaches this.
RETRY_AT = 1.1


class FailureMemory:
    def __init__(self, state: Mapping | None = None):
        state = dict(state or {})
        #: key -> the highest value that failed (1 for changes that have no value).
        self._values: dict[str, int] = dict(state.get("values", {}))
        #: key -> the failed candidate's effect over the effect of the trace current then.
        self._shares: dict[str, float] = dict(state.get("shares", {}))
        #: key -> the hash of the trace that was current when it failed.
        self._on: dict[str, str] = dict(state.get("on", {}))

    def state(self) -> dict:
        return {"values": dict(self._values), "shares": dict(self._shares), "on": dict(self._on)}

    def __contains__(self, key: str) -> bool:
        return key in self._values

    def known(self, key: str, current: str, effect: float | None) -> int | None:
        """The value that failed under ``key``; None when nothing did or it is worth a new try.

        ``current`` is the hash of the current trace (nothing is retried before it changed),
        ``effect`` its effect.
        """
        if key not in self._values:
            return None
        if self._on.get(key) != current and self.predicted(key, effect) >= RETRY_AT:
            self._drop(key)
            return None
        return self._values[key]

    def predicted(self, key: str, effect: float | None) -> float:
        """What the change under ``key`` would show on the current trace (0.0: not known)."""
        share = self._shares.get(key)
        return 0.0 if share is None or effect is None else effect * share

    def retry_due(self, suffix: str, current: str, effect: float | None) -> bool:
        """Would some remembered failure whose key ends with ``suffix`` be tried again now?"""
        return any(k.endswith(suffix) and self._on.get(k) != current and self.predicted(k, effect) >= RETRY_AT
                   for k in self._values)

    def fail(self, key: str, value: int, current: str, candidate_effect: float | None, effect: float | None) -> None:
        self._values[key] = max(self._values.get(key, value), value)
        self._on[key] = current
        if candidate_effect is not None and effect:
            self._shares[key] = min(self._shares.get(key, candidate_effect / effect), candidate_effect / effect)

    def forget(self, old: Trace, new: Trace, *, measured: bool) -> None:
        """``new`` replaced ``old``: forget what concerned the requests that changed.

        Arrival times aside: compressing the gaps moves every request, and that says nothing
        about one of them (the effect tells when to retry). Likewise a change to several
        requests at once keeps their deletions. What failed on ``old`` before any effect was
        measured (on the original trace) is forgotten too. Without ``measured`` effects, a
        deletion forgets everything.
        """
        if not measured and len(new.requests) < len(old.requests):
            self._values.clear()
            self._shares.clear()
            self._on.clear()
            return
        kept = {replace(r, at_ms=0.0) for r in new.requests}
        changed = {r.id for r in old.requests if replace(r, at_ms=0.0) not in kept}
        for key in list(self._values):
            if key not in self._shares and self._on.get(key) == old.content_hash():
                self._drop(key)  # it failed before any effect was known: nothing to predict with
            elif key.split(" ", 1)[0] in changed and not (len(changed) > 1 and key.endswith(" delete")):
                self._drop(key)

    def _drop(self, key: str) -> None:
        self._values.pop(key, None)
        self._shares.pop(key, None)
        self._on.pop(key, None)
