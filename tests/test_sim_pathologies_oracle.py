"""The oracle on the pathologies added for issue 16 (kv-reserve-admission, disconnect-leak,
lifo-admission, decode-starvation, early-abort-leak, resident-prefix-refusal, seeded-sampling-path,
queued-abort-late, head-reserve-admission, logprobs-redetokenize, longest-prefix-first, aborted-blocks-held).

Each trigger (``fuzzer.sim.triggers``) is confirmed on virtual time with the kind its
pathology declares and only on requests the pathology really delayed (ground truth, read
by the test only), and the same trace on a clean simulator gives no finding.
"""

from __future__ import annotations

import pytest
from test_oracle import _examine_sim

from fuzzer.oracle.kinds import Decision
from fuzzer.sim import pathologies as P
from fuzzer.sim.triggers import TRIGGERS

NEW = (P.KV_RESERVE_ADMISSION, P.DISCONNECT_LEAK, P.LIFO_ADMISSION, P.DECODE_STARVATION, P.EARLY_ABORT_LEAK,
       P.RESIDENT_PREFIX_REFUSAL, P.SEEDED_SAMPLING_PATH, P.QUEUED_ABORT_LATE, P.HEAD_RESERVE_ADMISSION,
       P.LOGPROBS_REDETOKENIZE, P.LONGEST_PREFIX_FIRST, P.ABORTED_BLOCKS_HELD)


@pytest.mark.parametrize("name", NEW)
def test_the_trigger_is_confirmed_with_the_declared_kind_and_the_right_victim(name):
    trigger = TRIGGERS[name]
    exam = _examine_sim(trigger.trace, (name,))
    declared = {i.name: i.kind for i in P.describe()}[name]
    assert declared in {v.kind.value for v in exam.findings}, f"{name}: {exam.findings}"
    for v in exam.findings:
        assert v.decision is Decision.DIFFERENT
        if v.request_id is None:  # a verdict on the whole execution (leak): some request of it was hit
            assert any(name in names for r in exam.results for names in r.ground_truth.values())
        else:
            assert any(name in r.ground_truth.get(v.request_id, ()) for r in exam.results)
    if declared != "leak":
        assert any(v.request_id == trigger.victim for v in exam.findings)
    assert _examine_sim(trigger.trace).findings == ()


def test_a_request_held_up_by_work_its_client_abandoned_is_beyond_its_bound():
    # The paper schedule drops a request whose client left (vLLM aborts it on disconnect), so the
    # seat, step budget and blocks a server keeps spending on it (a lost abort: vLLM PR #29987's
    # class) delay the requests behind it beyond their bound, not only the server's return to idle.
    import asyncio
    from dataclasses import replace

    from test_oracle import _WARM_UP, _rng, _sim_calibration

    from fuzzer.oracle.confirm import examine
    from fuzzer.sim import VirtualTarget

    trigger = TRIGGERS[P.EARLY_ABORT_LEAK]
    calibration = _sim_calibration()
    assert calibration.assumption.aborts_on_disconnect

    def w_findings(pathologies, cal):
        target = VirtualTarget(pathologies=pathologies, seed=3)
        target.run(_WARM_UP)
        exam = asyncio.run(examine(target, trigger.trace, cal, runs=3, rng=_rng(3)))
        return [v for v in exam.findings if v.request_id == "W"], exam

    found, exam = w_findings((P.EARLY_ABORT_LEAK,), calibration)
    assert [str(v.kind) for v in found] == ["ttft-outlier"]
    assert all(P.EARLY_ABORT_LEAK in r.ground_truth.get("W", ()) for r in exam.results)
    # Controls: a clean server aborts Z and W is inside its bound; an assumption that the engine
    # serves an abandoned request to its end puts the zombie inside W's bound.
    assert w_findings((), calibration)[0] == []
    served_to_the_end = calibration.with_assumption(replace(calibration.assumption, aborts_on_disconnect=False))
    assert w_findings((P.EARLY_ABORT_LEAK,), served_to_the_end)[0] == []
