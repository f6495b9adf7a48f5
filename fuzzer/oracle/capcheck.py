"""Before an ordering inversion of a long prompt by a shorter one is confirmed: are prompts of its size capped?

The order check holds a long prompt to FCFS order against a shorter one sent after it only where calibration
found no long-prefill cap (:func:`fuzzer.oracle.order.first_served`): under a cap, the shorter one passes by
design. Calibration probes the cap once, with a prompt of two token budgets, and a server may cap prompts of a
trace's size while that probe shows none (a longer prompt handled otherwise, a budget misread under load).
issue 16's seventh held-out server with every bug on measured a 4096-token budget and no cap at two
calibrations; clean, a cap of about 455 tokens; a 2048-token prompt passed by a 128-token one, as the clean
server serves it too, was a confirmed ttft-outlier of a 30-minute campaign (stop 60). So before such a candidate
is confirmed, the cap probe (:func:`fuzzer.oracle.chunkcap.chunk_cap`) runs again with a prompt of the victim's
size; a cap it measures is the engine's policy (ARCHITECTURE.md, "Oracle").
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from dataclasses import dataclass, replace

from fuzzer.errors import TargetError
from fuzzer.execution import ExecutionResult, Target
from fuzzer.oracle import judge
from fuzzer.oracle.calibrate import longest_prompt
from fuzzer.oracle.calibration import Calibration
from fuzzer.oracle.chunkcap import chunk_cap
from fuzzer.oracle.evidence import preemptions
from fuzzer.oracle.kinds import Metric
from fuzzer.oracle.order import cap_dependent, inversions
from fuzzer.oracle.policy import DEFAULT_POLICY, OraclePolicy
from fuzzer.oracle.verdict import Verdict
from fuzzer.trace import Trace


def rests_on_no_cap(trace: Trace, result: ExecutionResult, candidate: judge.Candidate, calibration: Calibration,
                    policy: OraclePolicy = DEFAULT_POLICY) -> int | None:
    """The prompt size to probe when ``candidate`` is a TTFT whose request ``result`` shows overtaken only by
    shorter requests, judged without a cap (:func:`fuzzer.oracle.order.cap_dependent`); else None."""
    a = calibration.assumption
    if (candidate.metric is not Metric.TTFT or candidate.request_id is None or a.long_prefill_threshold
            or not (a.arrival_order and a.admission_stops)):
        return None
    inversion = inversions(trace, result, calibration, preemptions(result) > 0, policy).get(candidate.request_id)
    return None if inversion is None else cap_dependent(trace, inversion)


async def probe_cap(target: Target, calibration: Calibration, tokens: int) -> Calibration:
    """``calibration`` with the cap measured by a probe of ``tokens`` prompt tokens: a cap found is assumed; a cap
    the probe cannot rule out leaves the order check no ground (``admission_stops`` off); none, or a server that
    could not be asked, as it was."""
    try:
        found = await chunk_cap(target, calibration, longest_prompt(target), prompt_tokens=tokens)
    except TargetError:
        return calibration  # the server could not be asked (down, refusing): judged as before, the campaign goes on
    a = calibration.assumption
    if found:
        return replace(calibration, assumption=replace(
            a, long_prefill_threshold=found, source=f"{a.source}; long-prefill cap measured at {tokens} prompt tokens"))
    if found is None:
        return replace(calibration, assumption=replace(
            a, admission_stops=False, source=f"{a.source}; long-prefill cap not known at {tokens} prompt tokens"))
    return calibration


async def cap_checked(probe: Callable[[Calibration, int], Awaitable[Calibration]],
                      probed: MutableMapping[tuple[float, int], Calibration], trace: Trace, result: ExecutionResult,
                      candidate: judge.Candidate, calibration: Calibration,
                      policy: OraclePolicy = DEFAULT_POLICY) -> tuple[Calibration, bool]:
    """(The calibration to judge ``candidate`` of ``result`` by, whether it still stands under it): where its inversion
    rests on no cap (:func:`rests_on_no_cap`), ``probe`` (a :func:`probe_cap` of the caller's target) is run once per
    prompt size and calibration (``probed`` keeps them), and the candidate stands only if the calibration it returns
    still makes it one (overtaken by design, it may still be slow beyond that)."""
    tokens = rests_on_no_cap(trace, result, candidate, calibration, policy)
    if not tokens:
        return calibration, True
    key = (calibration.created_at, tokens)
    probed[key] = after = probed.get(key) or await probe(calibration, tokens)
    if after is calibration:
        return calibration, True
    return after, any((c.kind, c.request_id) == (candidate.kind, candidate.request_id)
                      for c in judge.candidates(trace, result, after, policy))


@dataclass(frozen=True)
class Rechecked:
    """What :func:`recheck` leaves: the verdicts, the calibration for the rest (a cap found is every verdict's) and
    per request the one its verdict was judged by where it differs (a cap not known at its size); a line per probe."""

    calibration: Calibration
    verdicts: list[Verdict]
    by_request: dict[str, Calibration]
    notes: list[str]


async def recheck(probe: Callable[[Calibration, int], Awaitable[Calibration]], trace: Trace,
                  results: Sequence[ExecutionResult], verdicts: Sequence[Verdict], calibration: Calibration,
                  rejudge: Callable[[Calibration], list[Verdict]], policy: OraclePolicy = DEFAULT_POLICY) -> Rechecked:
    """:func:`cap_checked` for several runs judged together (``fuzz replay``): each TTFT verdict with a kind, seen in
    some run, whose inversion in one of ``results`` rests on no cap, is judged again (``rejudge``) under the cap
    ``probe`` measures at its prompt size, once per size. A cap found becomes the calibration of every verdict;
    a cap not known, of that verdict only."""
    out, by_request, notes = list(verdicts), {}, []
    probed: dict[int, Calibration] = {}
    for i in range(len(out)):
        v = out[i]
        if v.kind is None or v.metric is not Metric.TTFT or v.request_id is None or not v.reproduced:
            continue
        candidate = judge.Candidate(v.kind, v.request_id, v.metric)
        tokens = next((n for r in results if (n := rests_on_no_cap(trace, r, candidate, calibration, policy))), None)
        if not tokens:
            continue
        after = probed[tokens] = probed.get(tokens) or await probe(calibration, tokens)
        if after is calibration:
            continue
        cap = after.assumption.long_prefill_threshold
        if cap:
            calibration, out = after, rejudge(after)
            by_request.clear()  # every verdict is judged under the cap now, as a campaign's calibration takes it
            notes.append(f"{v.request_id} was passed by shorter prompts: a long-prefill cap of {cap} tokens measured "
                         f"at {tokens} prompt tokens (the order check does not hold it to FCFS order)")
        else:
            again = {w.request_id: w for w in rejudge(after) if w.request_id}
            out[i], by_request[v.request_id] = again.get(v.request_id, v), after
            notes.append(f"{v.request_id} was passed by shorter prompts: the long-prefill cap is not known at {tokens} "
                         "prompt tokens (its order is not held to FCFS order)")
    return Rechecked(calibration, out, by_request, notes)
