"""What a campaign's (and a fleet's) traces run without: the causes of findings already confirmed, and the
sampling options where latency candidates are confirmed."""

from __future__ import annotations

from collections.abc import Collection, Container

from fuzzer.oracle.ablation import OPTIONS, options_of, without_option
from fuzzer.oracle.signature import option_signature
from fuzzer.search.mutators import without_found_leaks
from fuzzer.trace import Trace


def without_found_causes(trace: Trace, found: Collection[str]) -> Trace:
    """``trace`` as a campaign's (and a fleet's) child runs it: without what a confirmed finding already
    explains. The disconnects whose leak is found could only find it again, each holding the next
    execution at the idle barrier until the leaked work ends; a sampling option whose option-slowdown is
    found slows every request beside it, so that its victims are its doing and each run takes the
    slowdown's time (the README's main job: children of the logprobs seed ran 8.5 s, 0.3 s without)."""
    return without_found_options(without_found_leaks(trace, found), found)


def without_found_options(trace: Trace, found: Container[str]) -> Trace:
    """``trace`` without each sampling option whose option-slowdown is in ``found``: where its latency
    candidates are confirmed (the option's victims are its doing). A campaign's and a fleet's."""
    for option in options_of(trace):
        if option_signature(option) in found:
            trace = without_option(trace, option)
    return trace


def without_options(trace: Trace) -> Trace:
    """``trace`` without any sampling option (fuzzer.oracle.ablation.OPTIONS): where a campaign (and a fleet's
    coordinator) confirms its latency candidates. An option changes no token work but costs its own rows real
    time (a sampler's logprobs), which the bound does not model: heldout7's clean configuration charged each
    logprob to its row, and beside eight choices of 20 logprobs the other requests were confirmed as eight
    false e2e- and ttft-outliers (5-940x). A slowdown that is not the option's shows without it; one the
    option brings everyone beyond its own rows' cost is the option test's (fuzzer.oracle.ablation)."""
    for option in OPTIONS:
        if any(getattr(r, option) is not None for r in trace.requests):
            trace = without_option(trace, option)
    return trace
