"""The shape operators (fuzzer.search.shapes) build what their public reports describe, and on the
simulator they reach the pathology modelled on that report (ground truth, read by the test only)."""

from __future__ import annotations

import random

import pytest

from fuzzer import trace as tf
from fuzzer.search import shapes
from fuzzer.search.mutators import OPERATORS, Limits, generate
from fuzzer.sim import VirtualTarget

LIMITS = Limits()


def _children(op, count=40, limits=LIMITS):
    out = []
    for i in range(count):
        rng = random.Random(i)
        parent = generate(rng, limits)
        child = op(parent, rng, limits)
        if child is not None:
            out.append((i, parent, child))
    return out


def _sim_limits():
    """The limits of the simulator, with the KV size it reports (the KV shapes need it)."""
    sim = VirtualTarget()
    blocks, size = sim.kv_cache()
    return Limits(kv_tokens=blocks * size, max_model_len=sim.config.max_model_len)


def _kv_children(op, count):
    """(seed, parent, child) of a KV shape under the simulator's limits, where it applies; it needs the KV size."""
    assert op(generate(random.Random(0), LIMITS), random.Random(0), LIMITS) is None  # size unknown
    limits = _sim_limits()
    for i in range(count):
        rng = random.Random(i)
        parent = generate(rng, limits)
        child = op(parent, rng, limits)
        if child is not None:
            yield i, parent, child


def test_the_shapes_are_havoc_operators():
    for op in shapes.SHAPE_OPERATORS:
        assert OPERATORS[op.__name__] is op


def test_long_outputs_ask_for_far_more_than_they_write():
    for _, parent, child in _children(shapes.long_outputs):
        new = [r for r in child.requests if r.id not in {p.id for p in parent.requests}]
        longs = [r for r in new if r.max_tokens > LIMITS.max_output_tokens]
        assert len(longs) >= 2 and all(not r.ignore_eos for r in longs)  # EOS ends them early
        assert sum(r.prompt_tokens + r.max_tokens for r in longs) >= LIMITS.max_model_len // 2
        behind = [r for r in new if r not in longs]
        assert behind and min(r.at_ms for r in behind) > max(r.at_ms for r in longs)
        assert all(r.prompt_tokens + r.max_tokens <= LIMITS.max_model_len for r in child.requests)


def test_disconnect_long_leaves_a_long_stream_after_a_few_tokens():
    for _, parent, child in _children(shapes.disconnect_long):
        left = [r for r in child.requests if r.cancel_after_tokens is not None and r.cancel_after_tokens <= 16
                and 2048 <= r.max_tokens <= 3072]
        assert left and all(r.stream and r.ignore_eos for r in left)


def test_long_prompt_beside_stream_sends_several_budgets_while_a_stream_runs():
    for _, _, child in _children(shapes.long_prompt_beside_stream):
        live = next(r for r in child.requests if r.id.startswith("live"))
        big = next(r for r in child.requests if r.id.startswith("big"))
        assert big.prompt_tokens >= 2 * LIMITS.token_budget and big.at_ms > live.at_ms and live.stream


def test_prefix_burst_puts_short_members_among_long_ones():
    for _, parent, child in _children(shapes.prefix_burst):
        group = (set(child.prefixes) - set(parent.prefixes)).pop()
        members = sorted((r for r in child.requests if r.prefix == group), key=lambda r: r.at_ms)
        assert members[0].prompt_tokens > members[1].prompt_tokens  # a short one arrives during a long prefill
        assert members[-1].at_ms - members[0].at_ms <= 40


def test_timeout_before_first_token_leaves_long_prompts_within_tens_of_ms_then_a_request_needs_them():
    for _, parent, child in _children(shapes.timeout_before_first_token):
        gone = [r for r in child.requests if r.disconnect_after_ms is not None]
        assert gone and all(r.disconnect_after_ms <= 80 and r.prompt_tokens >= LIMITS.token_budget - 148
                            and r.max_tokens >= 2048 and r.ignore_eos for r in gone)
        later = [r for r in child.requests if r.id.startswith("next")]
        assert later and later[0].at_ms > max(r.at_ms for r in gone)
        # What the client read: nothing, on the simulator (a 1900-token prompt takes longer than 80 ms there).
        result = VirtualTarget(seed=1).run(child)
        assert all(result.request(r.id).outcome.value == "cancelled" and result.request(r.id).ttft_s is None
                   for r in gone if r.disconnect_after_ms <= 30)


def test_disconnect_fanout_leaves_an_n_stream_after_a_few_tokens():
    for _, _, child in _children(shapes.disconnect_fanout):
        fan = next(r for r in child.requests if r.id.startswith("fan") and r.n > 1)
        assert fan.cancel_after_tokens is not None and fan.stream and fan.max_tokens >= 2048
    assert shapes.disconnect_fanout(generate(random.Random(0), LIMITS), random.Random(0),
                                    Limits(unsupported=frozenset({"n"}))) is None


def test_sampling_batch_puts_one_seeded_or_logprobs_request_among_many_streams():
    kinds = set()
    for _, parent, child in _children(shapes.sampling_batch):
        new = [r for r in child.requests if r not in parent.requests]
        rows = [r for r in new if r.id.startswith("row")]
        carrier = new[-1]
        assert len(new) == len(rows) + 1 and len(rows) >= 4 and carrier.at_ms > max(r.at_ms for r in rows)
        assert all(r.seed is None and r.logprobs is None for r in rows)
        assert (carrier.seed is None) != (carrier.logprobs is None)
        assert carrier.seed is None or carrier.temperature > 0
        kinds.add("seed" if carrier.seed is not None else "logprobs")
    assert kinds == {"seed", "logprobs"}
    # Within the logprobs a server accepts; a seed alone where it refuses them.
    for i in range(20):
        parent = generate(random.Random(i), LIMITS)
        five = shapes.sampling_batch(parent, random.Random(i), Limits(max_logprobs=5))
        assert all(r.logprobs is None or r.logprobs <= 5 for r in five.requests if r not in parent.requests)
        none = shapes.sampling_batch(parent, random.Random(i), Limits(unsupported=frozenset({"logprobs"})))
        assert all(r.logprobs is None for r in none.requests if r not in parent.requests)
        one = shapes.sampling_batch(parent, random.Random(i), Limits(unsupported=frozenset({"n"})))
        assert all(r.n == 1 for r in one.requests if r not in parent.requests)


def test_sampling_batch_rows_take_several_choices_half_the_time_within_the_kv_cache():
    # A per-row sampler cost grows with the sequences sampled, and a trace holds at most max_requests requests.
    widths = []
    for _, parent, child in _children(shapes.sampling_batch, 60):
        rows = [r for r in child.requests if r not in parent.requests][:-1]
        assert len({r.n for r in rows}) == 1
        widths.append(rows[0].n)
    assert set(widths) == {1, shapes.ROW_CHOICES} and 0.25 < widths.count(1) / len(widths) < 0.75
    for i in range(30):  # where the rows' choices would ask for more than half the reported KV cache: one each
        parent = generate(random.Random(i), LIMITS)
        small = shapes.sampling_batch(parent, random.Random(i), Limits(kv_tokens=4096))
        assert small is None or all(r.n == 1 for r in small.requests if r.id.startswith("row") and r not in parent.requests)
        fits = shapes.sampling_batch(parent, random.Random(i), Limits(max_n=2))
        assert fits is None or all(r.n <= 2 for r in fits.requests if r not in parent.requests[:-1] and r.id.startswith("row"))


def test_logprob_streams_sends_long_logprobs_streams_then_a_plain_one_while_they_decode_and_reaches_its_pathology():
    reached = tried = 0
    for i, parent, child in _children(shapes.logprob_streams, 30):
        new = [r for r in child.requests if r not in parent.requests]
        lp = [r for r in new if r.logprobs is not None]
        plain = [r for r in new if r.logprobs is None]
        assert 2 <= len(lp) <= 6 and 1 <= len(plain) <= 2
        assert all(r.stream and r.max_tokens >= 256 and r.logprobs <= 20 for r in lp)
        assert max(r.logprobs for r in lp) == 20  # the most the server takes
        assert min(r.at_ms for r in plain) >= max(r.at_ms for r in lp) + 500 and all(r.stream for r in plain)
        target = VirtualTarget(pathologies=("logprobs-redetokenize",), seed=i)
        if any(target.run(parent).ground_truth.values()):
            continue
        tried += 1
        reached += any("logprobs-redetokenize" in target.run(child).ground_truth.get(r.id, ()) for r in plain)
        assert not any(VirtualTarget(seed=i).run(child).ground_truth.values())
    assert tried >= 10 and reached >= 0.6 * tried, (reached, tried)
    for i in range(20):
        parent = generate(random.Random(i), LIMITS)
        five = shapes.logprob_streams(parent, random.Random(i), Limits(max_logprobs=5))
        assert five is None or all(r.logprobs is None or r.logprobs <= 5 for r in five.requests if r not in parent.requests)
        assert shapes.logprob_streams(parent, random.Random(i), Limits(unsupported=frozenset({"logprobs"}))) is None


def test_kv_burst_asks_for_more_than_the_reported_kv_and_needs_its_size():
    sim = VirtualTarget()
    blocks, size = sim.kv_cache()
    limits = Limits(kv_tokens=blocks * size, max_model_len=sim.config.max_model_len)
    assert shapes.kv_burst(generate(random.Random(0), LIMITS), random.Random(0), LIMITS) is None  # size unknown
    reached = tried = 0
    for i in range(20):
        rng = random.Random(i)
        parent = generate(rng, limits)
        child = shapes.kv_burst(parent, rng, limits)
        if child is None:
            continue
        burst = [r for r in child.requests if r.id.startswith("kv") and not r.id.startswith("kvlate")]
        assert sum(r.prompt_tokens + r.max_tokens for r in burst) >= 1.15 * limits.kv_tokens
        assert all(r.prompt_tokens + r.max_tokens <= limits.max_model_len for r in child.requests)
        target = VirtualTarget(pathologies=("preemption-thrash",), seed=i)
        if any(target.run(parent).ground_truth.values()):
            continue
        tried += 1
        reached += any(target.run(child).ground_truth.values())  # KV exhausted: preemption happens
    assert tried >= 10 and reached >= 0.6 * tried, (reached, tried)


def test_the_limits_carry_the_kv_size_a_target_reports():
    from fuzzer.cli._target import limits_for

    sim = VirtualTarget()
    blocks, size = sim.kv_cache()
    assert limits_for(sim).kv_tokens == blocks * size
    assert limits_for(object()).kv_tokens is None  # a target that does not tell
    assert Limits.from_dict(Limits(kv_tokens=123).to_dict()).kv_tokens == 123


def test_prefix_under_pressure_leaves_the_tails_room_but_not_the_whole_prompts_and_reaches_its_pathology():
    limits = _sim_limits()
    reached = tried = 0
    for i, parent, child in _kv_children(shapes.prefix_under_pressure, 20):  # none where the parent holds too much
        tf.validate(child)
        new = [r for r in child.requests if r not in parent.requests]
        owner = next(r for r in new if r.id.startswith("owner"))
        sharers = [r for r in new if r.id.startswith("sharer")]
        held = sum(r.prompt_tokens for r in new if r not in sharers)
        # The parent's requests that may still hold KV while the shape runs, at their full length.
        start = min(r.at_ms for r in new)
        near = sum(r.prompt_tokens + r.n * r.max_tokens for r in parent.requests if r.at_ms >= start - 1000)
        free = limits.kv_tokens - held - near
        # After the prefills a sharer's whole prompt does not fit the free KV; once every decode has
        # grown to its end, every sharer's tail and output still do (nobody is preempted by design).
        grown = free - sum(r.max_tokens for r in new if r not in sharers)
        assert all(r.prefix == owner.prefix and r.prompt_tokens > free for r in sharers)
        assert grown >= sum(r.prompt_tokens - child.prefixes[r.prefix] + r.max_tokens for r in sharers)
        target = VirtualTarget(pathologies=("resident-prefix-refusal",), seed=i)
        if any(target.run(parent).ground_truth.values()):
            continue
        tried += 1
        reached += any(target.run(child).ground_truth.values())
    assert tried >= 8 and reached >= 0.6 * tried, (reached, tried)  # 12 of 12 (12 of 20 applied) when written


@pytest.mark.parametrize("op, pathology, share", [
    (shapes.long_outputs, "kv-reserve-admission", 0.6),
    (shapes.disconnect_long, "disconnect-leak", 0.6),
    (shapes.timeout_before_first_token, "disconnect-leak", 0.6),
    (shapes.disconnect_fanout, "disconnect-leak", 0.6),
    (shapes.prefix_burst, "hol-prefix-burst", 0.6),
    (shapes.long_prompt_beside_stream, "unchunked-prefill", 0.6),
    (shapes.cold_among_warm, "longest-prefix-first", 0.6),
])
def test_a_shape_reaches_its_pathology_where_its_parent_does_not(op, pathology, share):
    reached = tried = 0
    for i, parent, child in _children(op, 30):
        target = VirtualTarget(pathologies=(pathology,), seed=i)
        if any(target.run(parent).ground_truth.values()):
            continue  # the parent already shows it
        tried += 1
        result = target.run(child)
        shows = not result.idle_after if pathology == "disconnect-leak" else any(result.ground_truth.values())
        reached += shows
    assert tried >= 10 and reached >= share * tried, (reached, tried)


@pytest.mark.parametrize("max_model_len", [1, 64, 511, 512, 600, 4096, 8192])
@pytest.mark.parametrize("kv_tokens", [None, 64000])
def test_shapes_fit_any_model_length_or_do_not_apply(max_model_len, kv_tokens):
    # The KV shapes apply only where the server reports its KV (64000 tokens: the held-out server's,
    # whose 8192-token model length once refused prefix_under_pressure's owner: its prefix was a
    # quarter of the KV capped at the length, and its output did not fit beside it).
    limits = Limits(max_model_len=max_model_len, max_output_tokens=min(1024, max_model_len), kv_tokens=kv_tokens)
    for i in range(30):
        rng = random.Random(i)
        parent = generate(random.Random(i), Limits(max_model_len=max(max_model_len, 64)))
        for op in shapes.SHAPE_OPERATORS:
            child = op(parent, rng, limits)
            if child is None:
                continue
            assert max_model_len >= shapes.MIN_MODEL_LEN
            tf.validate(child)
            added = [r for r in child.requests if r not in parent.requests]
            assert all(r.prompt_tokens + r.max_tokens <= max_model_len for r in added), op.__name__


def test_cached_prefix_burst_sends_short_tails_of_a_computed_prefix_together():
    children = _children(shapes.cached_prefix_burst)
    assert len(children) >= 30
    for _, parent, child in children:
        (name,) = set(child.prefixes) - set(parent.prefixes)
        owner, *burst = [r for r in child.requests if r.prefix == name]
        assert owner.id.startswith("owner") and 8 <= len(burst) <= 32
        assert all(r.at_ms - owner.at_ms >= min(shapes.WARM_AFTER_MS) for r in burst)
        assert max(r.at_ms for r in burst) - min(r.at_ms for r in burst) < len(burst)
        assert all(0 < r.prompt_tokens - child.prefixes[name] <= 32 for r in burst)


def test_a_cached_prefix_burst_is_within_its_bound_and_a_staircase_of_admissions_is_not():
    """FCFS admits a burst that needs only its tails computed in a step or two; an engine that charges the
    cached tokens to the step's budget (vLLM PR #7753's review) admits a couple a step: the later members'
    first tokens come steps late."""
    import asyncio

    from paper_target import PaperTarget

    from fuzzer.oracle.calibrate import calibrate
    from fuzzer.oracle.judge import candidates

    cal = asyncio.run(calibrate(PaperTarget(seed=99), rng=random.Random(0), clock=lambda: 0.0))
    step = cal.model.step_s(0, 1, 16)
    flagged = clean = 0
    for i, parent, child in _children(shapes.cached_prefix_burst, 10):
        (name,) = set(child.prefixes) - set(parent.prefixes)
        burst = [r.id for r in child.requests if r.prefix == name][1:]
        target = PaperTarget(seed=i)
        target._idle_s = target.idle_gap_s  # warm
        ok = candidates(child, target.run(child), cal)
        clean += not any(c.request_id in burst for c in ok)
        # Two admissions a step, each step one overhead long: the k-th member waits k // 2 steps more.
        stair = PaperTarget(seed=i, delay_s={rid: (k // 2) * step for k, rid in enumerate(burst)})
        stair._idle_s = stair.idle_gap_s
        flagged += any(c.request_id in burst for c in candidates(child, stair.run(child), cal))
    assert clean == 10 and flagged >= 8, (clean, flagged)



def test_the_resent_prefix_seeds_turns_are_within_their_bounds_and_a_lost_history_is_not():
    """The seed corpus/resent-prefix.json: a conversation's next turns re-send a finished turn's 3008-token
    history after a short request. A prefix cache that keeps freed blocks answers them from it; a free queue
    that hands out the most recently freed block first loses it to the request in between (heldout12's bug3),
    and the turn pays the history's prefill again."""
    import asyncio

    from conftest import CORPUS
    from paper_target import PaperTarget

    from fuzzer.oracle.calibrate import calibrate
    from fuzzer.oracle.judge import candidates

    cal = asyncio.run(calibrate(PaperTarget(seed=99), rng=random.Random(0), clock=lambda: 0.0))
    trace = tf.load(CORPUS / "resent-prefix.json")
    history = trace.prefixes["chat"]
    turns = [r.id for r in trace.requests if r.prefix == "chat"][1:]
    for seed in range(3):
        target = PaperTarget(seed=seed)
        target._idle_s = target.idle_gap_s  # warm
        assert not [c for c in candidates(trace, target.run(trace), cal) if c.request_id in turns]
        lost = PaperTarget(seed=seed, delay_s={rid: cal.model.step_s(history, 0, 0) for rid in turns})
        lost._idle_s = lost.idle_gap_s
        assert {c.request_id for c in candidates(trace, lost.run(trace), cal)} >= set(turns)


def test_abandoned_queue_leaves_long_prompts_while_queued_and_reaches_its_pathology():
    reached = tried = 0
    for i, parent, child in _children(shapes.abandoned_queue, 30):
        left = [r for r in child.requests if r.id.startswith("left")]
        behind = next(r for r in child.requests if r.id.startswith("behind_left"))
        assert 4 <= len(left) <= 6 and all(r.disconnect_after_ms <= 300 for r in left)
        assert all(r.prompt_tokens >= 4 * LIMITS.token_budget for r in left)
        assert behind.at_ms > max(r.at_ms for r in left) and behind.prompt_tokens <= 128
        target = VirtualTarget(pathologies=("queued-abort-late",), seed=i)
        if any(target.run(parent).ground_truth.values()):
            continue
        tried += 1
        result = target.run(child)
        reached += "queued-abort-late" in result.ground_truth.get(behind.id, ())
        assert not any(VirtualTarget(seed=i).run(child).ground_truth.values())
    assert tried >= 10 and reached >= 0.6 * tried, (reached, tried)


def test_abandoned_queue_s_clients_leave_once_the_frontend_has_queued_most_of_their_prompts():
    # heldout3's frontend tokenizes one prompt at a time, 60 us + 0.9 us a token: clients that left 10 ms after
    # sending dropped most of six 16k-token prompts before the engine saw them, and its queued-abort bug never ran.
    limits = Limits(token_budget=8192)
    for _, _, child in _children(shapes.abandoned_queue, 30, limits=limits):
        left = sorted((r for r in child.requests if r.id.startswith("left")), key=lambda r: r.at_ms)
        reached_ms, queued = left[0].at_ms, 0
        for r in left:
            reached_ms = max(reached_ms, r.at_ms) + 0.06 + 0.0009 * r.prompt_tokens
            queued += reached_ms <= r.at_ms + r.disconnect_after_ms
        assert queued >= len(left) // 2, [(r.at_ms, r.prompt_tokens, r.disconnect_after_ms) for r in left]


def test_reservation_under_load_fills_the_reported_kv_then_asks_for_a_whole_output_and_needs_its_size():
    limits = _sim_limits()
    reached = tried = 0
    for i, parent, child in _kv_children(shapes.reservation_under_load, 30):
        fill = [r for r in child.requests if r.id.startswith("fill")]
        whole = next(r for r in child.requests if r.id.startswith("whole"))
        after = [r for r in child.requests if r.id.startswith("after_whole")]
        assert sum(r.prompt_tokens for r in fill) >= 0.55 * limits.kv_tokens
        assert whole.prompt_tokens + whole.max_tokens == limits.max_model_len and whole.cancel_after_tokens <= 4
        assert after and min(r.at_ms for r in after) > whole.at_ms > max(r.at_ms for r in fill)
        assert all(r.prompt_tokens + r.max_tokens <= limits.max_model_len for r in child.requests)
        target = VirtualTarget(pathologies=("head-reserve-admission",), seed=i)
        if any(target.run(parent).ground_truth.values()):
            continue
        tried += 1
        reached += any("head-reserve-admission" in target.run(child).ground_truth.get(r.id, ()) for r in after)
    assert tried >= 10 and reached >= 0.6 * tried, (reached, tried)


def test_cold_among_warm_sends_cold_prompts_among_the_first_members_of_a_computed_prefix():
    children = _children(shapes.cold_among_warm)
    assert len(children) >= 30
    for _, parent, child in children:
        (name,) = set(child.prefixes) - set(parent.prefixes)
        owner, *warm = [r for r in child.requests if r.prefix == name]
        cold = [r for r in child.requests if r.id.startswith("cold") and r not in parent.requests]
        assert owner.id.startswith("owner") and 8 <= len(warm) <= 24 and 1 <= len(cold) <= 2
        assert all(r.at_ms - owner.at_ms >= min(shapes.WARM_AFTER_MS) for r in warm)
        tails = {r.prompt_tokens - child.prefixes[name] for r in warm}
        assert len(tails) == 1 and tails.pop() in {LIMITS.token_budget // 4, LIMITS.token_budget // 2}
        # After two to four members, and before at least four more that come 20 ms (the order check's reach) later.
        assert 2 <= sum(r.at_ms < min(c.at_ms for c in cold) for r in warm) <= 4
        assert sum(r.at_ms >= max(c.at_ms for c in cold) + 20 for r in warm) >= 4
        assert all(c.prefix is None and c.prompt_tokens <= 512 for c in cold)
    # Where the server reports its KV, the warm tails stay within half of it.
    limits = Limits(kv_tokens=16000)
    for i in range(20):
        rng = random.Random(i)
        child = shapes.cold_among_warm(generate(rng, limits), rng, limits)
        if child is not None:
            (name,) = {r.prefix for r in child.requests if r.id.startswith("owner")}
            warm = [r for r in child.requests if r.prefix == name and not r.id.startswith("owner")]
            assert child.prefixes[name] + sum(r.prompt_tokens - child.prefixes[name] for r in warm) <= 8000
