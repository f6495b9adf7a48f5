"""Confirmation re-runs that end early, and the target a campaign's confirmer runs them on.

Re-runs that end with their request. A latency candidate's re-runs are closed CONFIRM_CUT_FACTOR
times (plus CONFIRM_CUT_SLACK_S) after the time its request ended in the execution that showed
it: requests still running after it cannot have delayed it, and its bound plans them as the trace
asks. On a slow server a candidate's request often ends long before the trace's longest streams
(heldout4 with every bug on: an e2e victim done at 25 s of a 65 s trace, re-run three times). A
TTFT candidate's re-runs close after its first token came, the same way: what it waited for was
served by then, and its own output shows nothing more of it (heldout5 with every bug on: a TTFT
victim's first token came at 21 s, and its re-runs ran to its end and the trace's, 39-51 s). A
server that does not free what the client closed (the executor finds it not idle after a cut run)
keeps computing it; the confirmation target then stops cutting that trace, and every trace once
LEAKY_CUTS of them did (:class:`Cuts`).
An option test's runs close the same way after the other requests' end, when its carriers outlasted
them (the test's statistic is the others'): heldout4's test of ``logprobs`` ran 35 s traces whose
other requests were done at 5 s, and their ablations 19 s ones.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from fuzzer.execution import ExecutionResult, Outcome, Target
from fuzzer.oracle.judge import Candidate
from fuzzer.trace import Trace

#: A latency candidate's re-runs are closed this many times the time its request ended after the
#: start of the execution that showed it, plus CONFIRM_CUT_SLACK_S (see the module's docstring):
#: a re-run in which it ends later still shows it, as a lower bound of its latency.
CONFIRM_CUT_FACTOR = 1.5
CONFIRM_CUT_SLACK_S = 1.0


def confirmation_cut_s(candidate: Candidate) -> float | None:
    """The time cap of a candidate's re-runs: a latency's, or an option test's whose carriers outlasted the
    other requests (:func:`fuzzer.search.confirming.option_candidate`); None when its end is unknown."""
    if candidate.until_s is None:
        return None
    return CONFIRM_CUT_FACTOR * candidate.until_s + CONFIRM_CUT_SLACK_S


#: Traces whose cut runs left the server busy before a confirmation target stops cutting altogether:
#: on heldout4 with every bug, one trace's cut (a leak of its own) had switched cutting off for the
#: campaign, while the option test's cut runs of another had left the server idle six times, and a
#: later candidate whose request ended at 7.6 s of a 34.6 s trace was re-run whole three times.
LEAKY_CUTS = 2


@dataclass
class Cuts:
    """Whether a confirmation's re-runs may be closed early (``cut_s``): not for a trace whose cut run
    left the server busy (it keeps computing what the client closed: each cut would cost its wait and
    more), and for none once LEAKY_CUTS traces did. Kept across confirmations (a campaign's, a worker's)."""

    leaky: set[str] = field(default_factory=set)

    def allowed(self, digest: str) -> bool:
        """Whether the trace of hash ``digest`` may be cut."""
        return len(self.leaky) < LEAKY_CUTS and digest not in self.leaky


class ConfirmationTarget:
    """The campaign's target as its confirmer sees it: every run goes through ``run`` (see
    :meth:`fuzzer.search.campaign.Campaign._confirmation_run`); a virtual clock to idle on is passed through."""

    def __init__(self, target: Target, run: Callable[[Trace, float | None], Awaitable[ExecutionResult]],
                 cuts: Cuts | None = None):
        self._run = run
        self.cuts = Cuts() if cuts is None else cuts
        self.name = target.name
        idle = getattr(target, "idle", None)
        if idle is not None:
            self.idle = idle
        fresh_start = getattr(target, "fresh_start", None)  # a launched server: cold starts confirmed fresh too
        if fresh_start is not None:
            self.fresh_start = fresh_start
        restarts_left = getattr(target, "restarts_left", None)  # a launched server: its crash-loop budget
        if restarts_left is not None:
            self.restarts_left = restarts_left

    async def execute(self, trace: Trace, *, cut_s: float | None = None) -> ExecutionResult:
        """One run (the campaign caps each of its executions itself, and at ``cut_s`` when earlier)."""
        digest = trace.content_hash()
        cut_s = cut_s if self.cuts.allowed(digest) else None
        result = await self._run(trace, cut_s)
        if cut_s is not None and result.idle_after is False and any(r.outcome is Outcome.CUT for r in result.requests):
            self.cuts.leaky.add(digest)  # what the client closed still runs on the server
        return result

    async def aclose(self) -> None:  # the campaign owns the real target
        return None
