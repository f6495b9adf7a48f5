"""A false positive of the oracle on a clean simulator, found by the issue 16 benchmark (kept for the oracle's owners).

The trace (a guided child of the vLLM 37308 seed, disconnect-leak benchmark, seed 4) holds a
32703-token prompt, 80% of the 2560-block KV cache, arriving while an 8192-token request
decodes 2048 tokens. Both cannot fit: the long prompt's chunks preempt it (the newest running
request) six times until the decode ends, and its TTFT is 9 s. vLLM v1 does the same by design
(recompute preemption of the newest request), but the FCFS bound predicts about 4.65 times
less, so the oracle confirms a ttft-outlier although no pathology is on. The test fails
(xfail, strict) until the bound models repeated self-preemption of a prefill that cannot fit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_oracle import _examine_sim

from fuzzer import trace as tf

TRACE = Path(__file__).parent / "data" / "fp-long-prompt-self-preemption.json"


@pytest.mark.xfail(strict=True, reason="the FCFS bound misses repeated self-preemption of a long prefill (oracle)")
def test_a_clean_simulator_gives_no_finding_on_a_self_preempting_long_prompt():
    assert _examine_sim(tf.load(TRACE)).findings == ()
