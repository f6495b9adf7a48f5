"""A prefix cached in a slot (llama-server) is not held to a hit once another request was admitted.

llama-server -np 1 --cache-ram 0, the resent-prefix seed (scaled to a 1008-token history): its one slot
served a short request between two turns, and the next turn recomputed the history, by design. Held to
a cache hit, it was a confirmed e2e-outlier of 2.3x.
"""

from __future__ import annotations

from dataclasses import replace

from fuzzer.execute.adapters import ADAPTERS
from fuzzer.oracle.expectation import expect
from fuzzer.oracle.model import SchedulerAssumption, StepModel, assumption_for
from fuzzer.trace import Request, Trace

MODEL = StepModel(overhead_s=0.004, prefill_token_s=100e-6, decode_seq_s=50e-6, context_token_s=1e-8,
                  request_overhead_s=0.001)
SLOT = SchedulerAssumption(max_num_seqs=1, block_size=1, slot_cache=True)
TURNS = Trace(requests=(Request(id="turn1", at_ms=0, prompt_tokens=1072, max_tokens=16, prefix="chat"),
                        Request(id="other", at_ms=1800, prompt_tokens=96, max_tokens=16),
                        Request(id="turn2", at_ms=3000, prompt_tokens=1136, max_tokens=16, prefix="chat")),
              prefixes={"chat": 1008})


def test_a_request_admitted_between_two_members_of_a_group_loses_their_slots_prefix():
    shared = expect(TURNS, MODEL, replace(SLOT, slot_cache=False))
    slot = expect(TURNS, MODEL, SLOT)
    assert shared["turn2"].cached_tokens == 1008 and slot["turn2"].cached_tokens == 0
    # the bound then holds the history's prefill: about 1008 tokens more than the hit's
    assert slot["turn2"].ttft_s - shared["turn2"].ttft_s > 0.9 * 1008 * MODEL.prefill_token_s
    # Control: with nothing admitted in between, the slot still holds it.
    alone = Trace(requests=tuple(r for r in TURNS.requests if r.id != "other"), prefixes=TURNS.prefixes)
    assert expect(alone, MODEL, SLOT)["turn2"].cached_tokens == 1008


def test_llama_server_is_assumed_to_cache_per_slot_and_the_assumption_is_stored():
    llama = assumption_for("llamacpp", ADAPTERS["llamacpp"].scheduler_defaults)
    vllm = assumption_for("vllm", ADAPTERS["vllm"].scheduler_defaults)
    assert llama.slot_cache and not vllm.slot_cache
    assert SchedulerAssumption.from_dict(llama.to_dict()) == llama
    old = {k: v for k, v in llama.to_dict().items() if k != "slot_cache"}  # a calibration stored before
    assert SchedulerAssumption.from_dict(old).slot_cache is False
