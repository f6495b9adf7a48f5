"""What a confirmed crash needs, so that a campaign stops running it (fuzzer.search.confirming).

Once a trace is confirmed to take the server down, every mutant that keeps what crashed it takes
the server down again: the crash is known, each of those executions measures nothing, and a
launched server's restarts are a bounded budget (``max_restarts`` deaths in 10 minutes stop the
campaign). A 20-minute campaign against vLLM 0.32's CPU build found its crash on a seeded request
(3 of 3 runs) within 6 minutes, and then stopped on the crash loop: its mutants kept the seed.

A *trait* is something a request may carry that the trace is also valid without: a sampling seed,
logprobs, several choices, sampling, a client that leaves early, a shared prefix, a non-streamed
or chat request, a request that may stop at end of sequence. :func:`crash_needs` runs the crashing
trace without its traits, then without one trait at a time while the server's restarts allow:
a trait whose removal alone lets the trace run is what the crash needs, and the campaign runs every
later trace without it (:func:`avoiding`). When only the trace without all its traits runs, all of
them are avoided (a narrower answer would cost deaths the budget does not have); when even that
trace crashes, the crash is in the trace's shape and nothing is avoided (the crash-loop stop
stays the guard).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from dataclasses import replace

from fuzzer.search.mutators import without_cancellations
from fuzzer.trace import Request, Trace, disconnects

#: Request traits a crash may need, each with what a request is without it (first tried first:
#: sampling options before the shape of how clients use the API).
TRAITS: dict[str, Callable[[Request], Request | None]] = {
    "seed": lambda r: replace(r, seed=None) if r.seed is not None else None,
    "logprobs": lambda r: replace(r, logprobs=None) if r.logprobs is not None else None,
    "n": lambda r: replace(r, n=1) if r.n > 1 else None,
    "sampling": lambda r: replace(r, temperature=0.0) if r.temperature else None,
    "prefix": lambda r: replace(r, prefix=None) if r.prefix is not None else None,
    "unstreamed": lambda r: replace(r, stream=True) if not r.stream else None,
    "chat": lambda r: replace(r, api="completions") if r.api != "completions" else None,
    "eos": lambda r: replace(r, ignore_eos=True) if not r.ignore_eos else None,
}
#: Clients that leave early are removed as fuzzer.search.mutators.without_cancellations does.
LEAVING = "leaving"


def traits_of(trace: Trace) -> tuple[str, ...]:
    """The traits some request of ``trace`` carries, in the order they are tried."""
    out = [t for t, strip in TRAITS.items() if any(strip(r) is not None for r in trace.requests)]
    if any(disconnects(r) for r in trace.requests):
        out.append(LEAVING)
    return tuple(out)


def without_trait(trace: Trace, trait: str) -> Trace:
    """``trace`` with ``trait`` removed from every request (``trace`` itself when none carries it)."""
    if trait == LEAVING:
        return without_cancellations(trace)
    strip = TRAITS[trait]
    changed = [(r, strip(r)) for r in trace.requests]
    if all(new is None for _, new in changed):
        return trace
    return trace.with_requests([r if new is None else new for r, new in changed])


def avoiding(trace: Trace, traits: Iterable[str]) -> Trace:
    """``trace`` without every one of ``traits`` (what confirmed crashes need)."""
    for trait in traits:
        trace = without_trait(trace, trait)
    return trace


def tried(trace: Trace) -> list[Trace]:
    """The traces :func:`crash_needs` may run for a crash of ``trace`` (a fleet stores their runs by them)."""
    traits = traits_of(trace)
    return [avoiding(trace, traits), *(without_trait(trace, t) for t in traits)]


async def crash_needs(
    trace: Trace,
    run: Callable[[Trace], Awaitable[bool]],
    restarts_left: Callable[[], int | None],
) -> tuple[str, ...]:
    """The traits of a crashing ``trace`` to avoid from now on; () when its shape alone crashes.

    ``run`` executes a trace and says whether it took the server down (waiting for the server to
    answer again when it did); ``restarts_left`` is how many more deaths the server may have before
    its crash-loop stop (None: not a launched server, whose deaths nobody counts: one more is tried).
    """
    traits = traits_of(trace)
    if not traits:
        return ()
    plain, *singles = tried(trace)
    if await run(plain):
        return ()
    if len(traits) == 1:
        return traits
    for trait, single in zip(traits, singles):
        left = restarts_left()
        # A try that crashes costs a death: none is tried on the last one.
        if left is not None and left < 1:
            break
        if not await run(single):
            return (trait,)
        if left is None:
            break
    return traits
