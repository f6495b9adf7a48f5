"""Calibration: probes, robust fits, noise, baseline, stored form."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest
from paper_target import TRUE_MODEL, PaperTarget

from fuzzer.errors import ConfigError, TargetError
from fuzzer.execution import Outcome
from fuzzer.oracle.calibrate import calibrate, reuse_or_calibrate
from fuzzer.oracle.fitting import theil_sen
from fuzzer.oracle.calibration import REFRESH_AFTER_S, Calibration
from fuzzer.oracle.kinds import Metric
from fuzzer.oracle.model import SchedulerAssumption
from fuzzer.sim import VirtualTarget

TRUE = TRUE_MODEL


async def test_calibration_recovers_a_known_step_model():
    cal = await calibrate(PaperTarget(), rng=random.Random(1), clock=lambda: 1234.0)
    m = cal.model
    assert m.prefill_token_s == pytest.approx(TRUE.prefill_token_s, rel=0.05)
    assert m.overhead_s == pytest.approx(TRUE.overhead_s, rel=0.15)
    assert m.decode_seq_s == pytest.approx(TRUE.decode_seq_s, rel=0.25)
    assert m.context_token_s == pytest.approx(TRUE.context_token_s, rel=0.35)
    assert m.request_overhead_s == pytest.approx(TRUE.request_overhead_s, abs=0.001)
    assert TRUE.prefill_pair_s == 0.0 and m.prefill_pair_s == 0.0  # a linear server: no attention invented
    assert cal.created_at == 1234.0 and cal.target == "paper://known-model"
    # The measured noise is of the order of the planted 3% and the baseline sits at 1.
    assert 0.005 < cal.noise[Metric.TTFT] < 0.08
    assert len(cal.baseline[Metric.TTFT]) >= 36
    assert np.median(cal.baseline[Metric.TTFT]) == pytest.approx(1.0, abs=0.05)
    assert cal.cached_fit is not None


async def test_noise_free_calibration_is_exact_and_stable():
    a = await calibrate(PaperTarget(noise=0.0), rng=random.Random(1), clock=lambda: 0.0)
    assert a.model.prefill_token_s == pytest.approx(TRUE.prefill_token_s, rel=1e-6)
    assert a.model.decode_seq_s == pytest.approx(TRUE.decode_seq_s, rel=1e-3)
    assert a.noise[Metric.TTFT] == pytest.approx(0.0, abs=1e-9)


async def test_calibration_round_trips_and_reproduces_from_its_seed():
    a = await calibrate(PaperTarget(seed=3), rng=random.Random(7), clock=lambda: 5.0)
    b = await calibrate(PaperTarget(seed=3), rng=random.Random(7), clock=lambda: 5.0)
    assert a == b
    assert Calibration.from_dict(a.to_dict()) == a
    assert not a.is_stale(5.0 + 60) and a.is_stale(5.0 + 7200)


async def test_a_failing_target_is_a_target_error():
    with pytest.raises(TargetError, match="calibration probe .* failed .http-error"):
        await calibrate(PaperTarget(fail={f's{i}': Outcome.HTTP_ERROR for i in range(200)}), rng=random.Random(1))


async def test_a_dropped_connection_is_run_again_once_and_a_server_that_keeps_dropping_them_fails():
    # CI, stop 36: llama-server dropped one batch probe's connection under load and the command failed.
    dropping = {f"s{i}": Outcome.CONNECTION_ERROR for i in range(200)}
    cal = await calibrate(PaperTarget(fail=dropping, fail_every_run=False), rng=random.Random(1))
    assert cal.reliable
    with pytest.raises(TargetError, match="calibration probe .* failed .connection-error"):
        await calibrate(PaperTarget(fail=dropping), rng=random.Random(1))


async def test_attention_is_measured_where_the_context_holds_no_prompt_of_two_budgets():
    # llama-server's 4096-token slots with its 2048-token batch: no prompt of two budgets fits, and
    # without a longer-than-one-step probe the fit saw no attention term (a 4063-token prompt's
    # second chunk cost 2.6x its first on a CPU, and streams beside it were "stalled" 2x their bound).
    from fuzzer.oracle.calibrate import long_prefill_lengths

    assert long_prefill_lengths(2048, 4094) == (4032,)
    assert long_prefill_lengths(2048, 8190) == (4096, 6144)
    assert long_prefill_lengths(2048, 2500) == ()  # under 1.5 budgets: one step and a sliver, no probe
    assert long_prefill_lengths(2048, 4094, fallback=False) == ()  # 4096 guessed, not reported: no probe
    # A 2048-token chunk after 2048 computed ones: 72 ms of tokens and 250 ms of attention pairs.
    true = replace(TRUE, prefill_pair_s=4e-8)
    cal = await calibrate(PaperTarget(true, noise=0.01), rng=random.Random(1), clock=lambda: 0.0,
                          max_model_len=4096)
    assert cal.model.prefill_pair_s == pytest.approx(true.prefill_pair_s, rel=0.3)
    # The control: the same server calibrated as before, without the long probe, measures no attention.
    import fuzzer.oracle.calibrate as calibrate_module

    blind = calibrate_module.long_prefill_lengths
    calibrate_module.long_prefill_lengths = lambda budget, longest, fallback: ()
    try:
        before = await calibrate(PaperTarget(true, noise=0.01), rng=random.Random(1), clock=lambda: 0.0,
                                 max_model_len=4096)
    finally:
        calibrate_module.long_prefill_lengths = blind
    assert before.model.prefill_pair_s == 0.0


def test_stored_calibration_of_another_format_is_refused():
    with pytest.raises(TargetError, match="run `fuzz calibrate` again"):
        Calibration.from_dict({"format": 99})


class _Draws:
    """An ``rng`` for reuse_or_calibrate that counts how often it is drawn (only to measure)."""

    def __init__(self) -> None:
        self.drawn = 0

    def __call__(self) -> random.Random:
        self.drawn += 1
        return random.Random(self.drawn)


async def test_a_fresh_stored_calibration_is_reused_without_measuring_or_drawing():
    stored = await calibrate(PaperTarget(), rng=random.Random(1), clock=lambda: 1000.0)
    draws, saved = _Draws(), []
    got = await reuse_or_calibrate(PaperTarget(), stored, rng=draws, save=saved.append,
                                   clock=lambda: 1000.0 + REFRESH_AFTER_S)
    assert got is stored and draws.drawn == 0 and saved == []


async def test_a_stale_calibration_is_measured_again_under_its_assumption_and_saved():
    override = replace(SchedulerAssumption(), token_budget=1024)  # as `fuzz calibrate --token-budget 1024` stores
    stale = replace(await calibrate(PaperTarget(), rng=random.Random(1), clock=lambda: 0.0), assumption=override)
    draws, saved, told = _Draws(), [], []
    got = await reuse_or_calibrate(PaperTarget(), stale, rng=draws, save=saved.append,
                                   clock=lambda: REFRESH_AFTER_S + 1.0, on_measure=told.append)
    assert told == [stale] and draws.drawn == 1 and saved == [got]
    assert got.created_at == REFRESH_AFTER_S + 1.0 and got.assumption.token_budget == 1024
    # With nothing stored it measures under the target's defaults, and says there was nothing.
    told.clear()
    fresh = await reuse_or_calibrate(PaperTarget(), None, rng=draws, on_measure=told.append)
    # (This target reports no context length: the cap probe's prompt would not fit, so the cap is not known.)
    unknown = replace(SchedulerAssumption(), admission_stops=False, seats_seen=64,
                      source=f"{SchedulerAssumption().source}; long-prefill cap not known")
    assert told == [None] and fresh.assumption == unknown


async def test_a_failed_refresh_keeps_the_stale_calibration_only_when_asked():
    stale = await calibrate(PaperTarget(), rng=random.Random(1), clock=lambda: 0.0)
    broken = PaperTarget(fail={f"s{i}": Outcome.HTTP_ERROR for i in range(200)})

    def later() -> float:
        return 2 * REFRESH_AFTER_S

    with pytest.raises(TargetError):
        await reuse_or_calibrate(broken, stale, rng=_Draws(), clock=later)
    failures = []
    assert await reuse_or_calibrate(broken, stale, rng=_Draws(), clock=later, on_refresh_failed=failures.append) is stale
    assert len(failures) == 1 and isinstance(failures[0], TargetError)
    with pytest.raises(TargetError):  # nothing to fall back on
        await reuse_or_calibrate(broken, None, rng=_Draws(), on_refresh_failed=failures.append)


def test_theil_sen_ignores_an_outlier_and_refuses_too_few_points():
    x = [1, 2, 3, 4, 5, 6, 7, 8]
    y = [2 * v + 1 for v in x]
    y[3] = 100.0
    f = theil_sen(x, y)
    assert f.slope == pytest.approx(2.0) and f.intercept == pytest.approx(1.0)
    assert f.slope_low <= f.slope <= f.slope_high
    with pytest.raises(TargetError, match="usable probe measurements"):
        theil_sen([1, 1, 1, 1], [1, 2, 3, 4])


async def test_calibration_recovers_the_simulators_step_time_parameters():
    from fuzzer.sim import SimConfig, VirtualTarget

    config = SimConfig()
    contexts = []
    for seed in (4, 5, 6):
        target = VirtualTarget(config, seed=seed)
        cal = await calibrate(target, rng=random.Random(seed), max_model_len=config.max_model_len)
        m = cal.model
        assert m.overhead_s == pytest.approx(config.step_overhead_s, rel=0.05)
        assert m.prefill_token_s == pytest.approx(config.prefill_token_s, rel=0.05)
        assert m.decode_seq_s == pytest.approx(config.decode_seq_s, rel=0.25)
        # The frontend's per-token tokenization shows up as the cost of a cached token.
        assert m.frontend_token_s == pytest.approx(config.tokenize_token_s, rel=0.25)
        # The simulator's 3% step noise is what the residuals measure.
        assert 0.01 < cal.noise[Metric.TTFT] < 0.06
        contexts.append(m.context_token_s)
    # The context cost is tiny here (82 us per step at 8192 tokens against a 3.5 ms overhead):
    # single fits land 6e-9 to 1.1e-8 for 1e-8 (seeds 4-6, with the probes paced by their own
    # durations and, before, by the slowest of their kind alike); their median is close.
    assert all(c == pytest.approx(config.context_token_s, rel=0.5) for c in contexts)
    assert sorted(contexts)[1] == pytest.approx(config.context_token_s, rel=0.2)


def test_fuzz_calibrate_fits_stores_and_prints_the_model(tmp_path):
    from click.testing import CliRunner

    from fuzzer.cli import cli
    from fuzzer.sim.process import SimProcess
    from fuzzer.store import Store

    db = tmp_path / "c.db"
    with SimProcess(speed=10.0) as sim:
        result = CliRunner().invoke(
            cli, ["calibrate", "--target", sim.url, "--db", str(db), "--repeats", "1", "--token-budget", "2048"]
        )
    assert result.exit_code == 0, result.output
    assert "step model" in result.output and "per prefill token" in result.output
    assert "user override of token_budget" in result.output
    with Store.open(db) as store:
        from fuzzer.oracle.calibration import calibration_key

        stored = store.latest_calibration(calibration_key(sim.url, "sim-qwen2.5-0.5b"))
    cal = Calibration.from_dict(stored)
    # At --speed 10 every engine time is a tenth (~3 µs per prefill token); on a busy
    # 2-core host the HTTP jitter of a one-repeat calibration blurs it, never to 30.
    assert cal.model.prefill_token_s < 20e-6
    assert cal.assumption.token_budget == 2048 and len(cal.baseline[Metric.TTFT]) >= 9


def test_fuzz_calibrate_on_an_unreachable_target_is_one_clear_error(tmp_path):
    from click.testing import CliRunner

    from fuzzer.cli import cli

    result = CliRunner().invoke(cli, ["calibrate", "--target", "http://127.0.0.1:9", "--db", str(tmp_path / "c.db")])
    assert result.exit_code == 2
    assert result.output.startswith("error: ") and "Traceback" not in result.output


class _TokenizingPaperTarget(PaperTarget):
    """A paper target whose server tokenizes on request at ``tokenize_s`` per token."""

    def __init__(self, tokenize_s: float, **kw):
        super().__init__(**kw)
        self.tokenize_s = tokenize_s

    async def tokenize_seconds(self, tokens: int) -> float:
        return 0.002 + self.tokenize_s * tokens


async def test_the_servers_own_tokenizer_caps_the_frontend_share():
    # Cached prompt tokens cost 10 us each beyond the prefill they skip; the server tokenizes at
    # 1 us per token: most of that time is the engine's, and the frontend gets at most 2 us.
    model = replace(TRUE_MODEL, frontend_token_s=10e-6)
    free = await calibrate(PaperTarget(model, noise=0.0), rng=random.Random(1), clock=lambda: 0.0)
    capped = await calibrate(_TokenizingPaperTarget(1e-6, model=model, noise=0.0), rng=random.Random(1),
                             clock=lambda: 0.0)
    assert free.model.frontend_token_s == pytest.approx(10e-6, rel=0.1)  # without a tokenizer to time
    assert capped.model.frontend_token_s == pytest.approx(2e-6, rel=0.05)
    # The per-token total is kept: what leaves the frontend goes to the prefill.
    total = lambda m: m.frontend_token_s + m.prefill_token_s  # noqa: E731
    assert total(capped.model) == pytest.approx(total(free.model), rel=0.02)
    # The tokenizer's own time is kept in the model, and stored (the uncertain frontend starts from it).
    assert capped.model.tokenizer_token_s == pytest.approx(1e-6, rel=0.01) and free.model.tokenizer_token_s == 0.0
    assert type(capped.model).from_dict(capped.model.to_dict()) == capped.model


# --- the context cost of long sequences decoding together -------------------------------------


async def _round_with_long_batch(target, *, long_batch=(8, 4096)):
    """One probe round on ``target`` with the long-context batch, paced generously."""
    from fuzzer.oracle.calibrate import _probe_round
    from fuzzer.oracle.probes import Pace

    pace = Pace((1, 2.0), (8192, 2.0))
    return await _probe_round(target, SchedulerAssumption(), random.Random(3), 2,
                              {"prefill": pace, "decode": pace, "batch": pace}, (16, 64, 256, 512, 1024, 2048),
                              (256, 512, 1024), (16, 512, 1024, 2048, 4096), long_batch)


def _fitted(probes):
    from fuzzer.oracle.fitting import fit

    return fit(target="t", created_at=0.0, assumption=SchedulerAssumption(), prefill=probes.prefill,
               cached=probes.cached, single=probes.single, batched=probes.batched)


def _slower_after_all_started(probes, extra_s):
    """The long batches' probes with every gap once all of a batch decode ``extra_s`` longer."""
    from fuzzer.oracle.probes import Probe

    out = []
    by_run: dict = {}
    for p in probes.batched:
        if p.prompt > 16:
            by_run.setdefault(p.result.x_request_id.split("-")[-1] + p.result.request_id.split("b")[0], []).append(p)
    together = {k: max(q.result.sent_s + q.result.ttft_s for q in v) for k, v in by_run.items()}
    for p in probes.batched:
        r = p.result
        if p.prompt > 16:
            start = together[r.x_request_id.split("-")[-1] + r.request_id.split("b")[0]] - r.sent_s
            times, late = [], 0.0
            for i, t in enumerate(r.token_times_s):
                if i and t > start:
                    late += extra_s
                times.append(t + late)
            r = replace(r, token_times_s=tuple(times), e2e_s=times[-1])
        out.append(Probe(p.prompt, p.cached, p.max_tokens, p.batch, r))
    return replace(probes, batched=tuple(out))


async def test_the_context_cost_of_a_long_batch_is_measured_where_one_sequence_shows_none():
    # The vLLM-like server written for issue 16: one 7000-token stream decoded 0.06 ms slower than a
    # 16-token one, eight such streams together 4 ms slower; with the context cost read off one
    # sequence the calibration fitted none, and the paper schedule emptied a KV burst's queue 0.7 s
    # early (a confirmed false positive of the clean server, tests/data/fp-kv-burst-batched-context.json).
    flat = replace(TRUE, context_token_s=0.0)
    probes = await _round_with_long_batch(PaperTarget(flat, noise=0.0))
    assert len([p for p in probes.batched if p.prompt == 4096]) == 8  # one batch of eight a round
    assert _fitted(probes).model.context_token_s == pytest.approx(0.0, abs=1e-10)
    extra = 0.0014  # each step of the eight 4096-token sequences together takes 1.4 ms more
    cal = _fitted(_slower_after_all_started(probes, extra))
    per_token = extra / (8 * (4096 + 16))
    assert cal.model.context_token_s == pytest.approx(per_token, rel=0.05)
    assert cal.context_fit.slope == pytest.approx(0.0, abs=1e-10)  # the one-sequence line still shows none
    # A server whose one sequence shows the cost already (the paper target's linear model) keeps it.
    linear = await _round_with_long_batch(PaperTarget(noise=0.0))
    assert _fitted(linear).model.context_token_s == pytest.approx(TRUE.context_token_s, rel=0.05)


def test_the_long_batch_fits_the_servers_kv_cache_its_slots_and_its_context():
    from fuzzer.oracle.calibrate import LONG_BATCH, long_batch_shape

    assert long_batch_shape(SchedulerAssumption(), None) == (LONG_BATCH, 4096 - 34)  # the default context
    assert long_batch_shape(SchedulerAssumption(), 32768) == (LONG_BATCH, 4096)
    small_kv = SchedulerAssumption(kv_blocks=1200, block_size=16)  # 19200 tokens: 60% of it is 11520
    batch, context = long_batch_shape(small_kv, 32768)
    assert batch * (context + 32) <= 0.6 * 1200 * 16 and context >= 1024 and batch >= 2
    assert long_batch_shape(SchedulerAssumption(max_num_seqs=4), 8192) == (4, 4096)  # llama.cpp's slots
    assert long_batch_shape(SchedulerAssumption(kv_blocks=100, block_size=16), 8192) is None  # no room
    assert long_batch_shape(SchedulerAssumption(max_num_seqs=1), 8192) is None


async def test_a_token_budget_larger_than_the_assumed_one_is_measured():
    # Issue 16's third held-out server ran vLLM with an 8192-token budget (its default on large GPUs)
    # where the vLLM adapter assumed 2048: a stream's gaps beside a long prompt were 120 ms against
    # 40 ms steps on paper, four confirmed itl-stall false positives in four minutes.
    large = PaperTarget(assumption=SchedulerAssumption(token_budget=8192))
    cal = await calibrate(large, rng=random.Random(1), clock=lambda: 0.0)
    assert cal.assumption.token_budget == 8192 and "token budget measured" in cal.assumption.source
    # The budget goes into the fit's assumption: a server that keeps no prefix keeps that finding too
    # (the budget and the cap once replaced the fit's assumption with the one before the fit).
    bare = PaperTarget(noise=0.01, assumption=SchedulerAssumption(token_budget=8192, prefix_caching=False))
    cal = await calibrate(bare, rng=random.Random(1), clock=lambda: 0.0)
    assert cal.assumption.token_budget == 8192 and cal.assumption.prefix_caching is False, cal.assumption
    # Controls: a server at the assumed budget keeps it (and the probe costs it one run); a budget
    # the user names stands.
    default = PaperTarget()
    cal = await calibrate(default, rng=random.Random(1), clock=lambda: 0.0)
    assert cal.assumption.token_budget == 2048 and "measured" not in cal.assumption.source
    named = await calibrate(PaperTarget(assumption=SchedulerAssumption(token_budget=8192)), rng=random.Random(1),
                            assumption=SchedulerAssumption(token_budget=4096), measure_budget=False)
    assert named.assumption.token_budget == 4096


async def test_a_token_budget_smaller_than_the_assumed_one_is_measured():
    # heldout10 (issue 16's tenth held-out server) computes 1536 prompt tokens a step, with a 768-token
    # cap per request, where 2048 was assumed: a short prompt sent just after two long ones waited for
    # their prefill, 2.2x its bound; two of its clean campaign's findings were that.
    from fuzzer.oracle.chunkcap import smaller_budget

    for assumption in (SchedulerAssumption(token_budget=1536), SchedulerAssumption(token_budget=1536, long_prefill_threshold=768)):
        cal = await calibrate(PaperTarget(noise=0.01, assumption=assumption), rng=random.Random(1), clock=lambda: 0.0)
        # The smallest budget under which the paper needs no more steps than counted (never above the
        # server's), held beside the assumed one.
        a = cal.assumption
        assert 1366 <= a.low_budget <= 1536 and a.token_budget == 2048 and "smaller token budget measured" in a.source
        assert SchedulerAssumption.from_dict(a.to_dict()) == a and f"(or {a.low_budget}" in a.describe()
    # Controls: a busy host (every step 3x longer) at the assumed budget, and a server at it, keep it.
    target = PaperTarget(noise=0.01)
    cal = await calibrate(target, rng=random.Random(1), clock=lambda: 0.0, measure_budget=False)
    busy = replace(TRUE, overhead_s=TRUE.overhead_s * 3, prefill_token_s=TRUE.prefill_token_s * 3,
                   decode_seq_s=TRUE.decode_seq_s * 3)
    assert await smaller_budget(PaperTarget(busy, noise=0.01), cal) == 0
    assert await smaller_budget(target, cal) == 0
    # Read to within a step of the burst: here 715 (a full step is half-way from a decode step to the longest).
    assert 680 <= await smaller_budget(PaperTarget(noise=0.01, assumption=SchedulerAssumption(token_budget=768)), cal) <= 768


class _Named(VirtualTarget):
    """A virtual simulator that keeps the name of every trace it ran."""

    names: list[str]

    async def execute(self, trace, **options):
        self.__dict__.setdefault("names", []).append(trace.name)
        return await super().execute(trace, **options)


@pytest.mark.parametrize("budget, cap, partials", [(2048, 256, 1), (2048, 0, 0), (1536, 0, 0)])
async def test_a_cap_is_no_smaller_budget_and_a_server_at_the_assumed_steps_is_not_probed_for_one(budget, cap, partials):
    # The full CI of stop 44 at the first version of the probe: a simulator capping long prompts at 256
    # tokens, one in partial prefill at a time, read as a 243-token budget (its quarter-budget prompts were
    # long ones), and the bound held the capped prefills under that budget besides. Its prompts are now
    # within the cap measured before it. And a server whose budget probe counts the steps the assumed
    # budget takes is not probed at all (two runs of every calibration, and a simulator's random draws
    # for the rest of its campaign, spent on nothing).
    from fuzzer.sim.config import SimConfig

    config = SimConfig(max_num_batched_tokens=budget, long_prefill_token_threshold=cap, max_long_partial_prefills=partials,
                       step_overhead_s=0.015, prefill_token_s=3e-6)
    target = _Named(config, seed=4)
    a = (await calibrate(target, rng=random.Random(4), max_model_len=config.max_model_len)).assumption
    probed = any(name.startswith("calibration-small-budget") for name in target.names)
    assert a.token_budget == 2048 and (a.long_prefill_threshold > 0) is (cap > 0)
    if budget < 2048:  # the control: a smaller budget is measured, never above the server's
        assert probed and 1366 <= a.low_budget <= 1536, a
    else:
        assert a.low_budget == 0 and probed is (cap > 0), (a, target.names)


async def test_a_budget_and_seats_the_server_reports_are_not_probed_for():
    # A server that reports its scheduler's budget and seats (vllm:cache_config_info's labels on four of
    # the vLLM-like servers written for this project) is held to them: no probe reads a planted bug's
    # behaviour as the engine's configuration (heldout6: a 16384-token budget read off a bug).
    from fuzzer.execute import adapters
    from fuzzer.sim.config import SimConfig

    config = SimConfig(max_num_batched_tokens=1536, max_num_seqs=48)
    target = _Named(config, seed=4)
    target.info = adapters.ServerInfo(kind="vllm", version=None, model=None, max_model_len=config.max_model_len,
                                      scheduler={"max_num_batched_tokens": 1536, "max_num_seqs": 48})
    a = (await calibrate(target, rng=random.Random(4))).assumption
    assert (a.token_budget, a.low_budget, a.max_num_seqs, a.seats_seen) == (2048, 1536, 48, 0), a
    assert not any(n.startswith(("calibration-budget", "calibration-small-budget", "calibration-seats"))
                   for n in target.names), target.names
    # The control: unreported, the same server is probed for both (its 48 seats under the probe's 64 streams).
    blind = _Named(config, seed=4)
    blind.info = adapters.ServerInfo(kind="vllm", version=None, model=None, max_model_len=config.max_model_len)
    b = (await calibrate(blind, rng=random.Random(4))).assumption
    assert b.max_num_seqs == 48 and "max_num_seqs measured" in b.source, b
    assert any(n.startswith("calibration-budget") for n in blind.names), blind.names


@pytest.mark.parametrize("budget", [2048, 4096, 8192])
async def test_a_larger_budget_is_measured_where_a_step_costs_mostly_its_overhead(budget):
    # heldout11 (issue 16's eleventh held-out server): 12 ms a step and 1.5 us a prompt token, so a step of its
    # 4096 tokens is 18 ms against 15 ms on paper at 2048, short of the longer-step evidence: its budget read as
    # 2048, and with it the cap probe's fewer steps than an uncapped engine takes left the cap unknown. There are
    # half the steps, and the burst is done sooner.
    from fuzzer.sim.config import SimConfig

    config = SimConfig(max_num_batched_tokens=budget, step_overhead_s=0.012, prefill_token_s=1.5e-6)
    a = (await calibrate(VirtualTarget(config, seed=1), rng=random.Random(1), max_model_len=config.max_model_len)).assumption
    assert a.token_budget == budget and ("token budget measured" in a.source) is (budget > 2048), a
    assert a.low_budget == 0  # the control (2048): neither larger nor smaller
    if budget == 4096:
        assert a.long_prefill_threshold == 0 and a.admission_stops, a  # no cap, known


@pytest.mark.parametrize("pathology", ["unchunked-prefill", "decode-starvation"])
async def test_a_stream_left_out_of_steps_is_not_a_larger_token_budget(pathology):
    # An engine that computes a long prompt's steps without its running decodes (whole, or chunk by chunk
    # before them) leaves the probe's stream one long gap: it was read as a 16384-token budget, and the stalls
    # of every live stream behind a long prompt were then inside the bound. The burst's first prompt got its
    # first token in the middle of that gap: a step computed it without the stream.
    from fuzzer.sim.config import SimConfig

    config = SimConfig()
    cal = await calibrate(VirtualTarget(config, pathologies=(pathology,), seed=4), rng=random.Random(4),
                          max_model_len=config.max_model_len)
    assert cal.assumption.token_budget == 2048 and "token budget measured" not in cal.assumption.source
    # The control: a clean engine with a larger budget is read as one.
    larger = SimConfig(max_num_batched_tokens=8192)
    cal = await calibrate(VirtualTarget(larger, seed=4), rng=random.Random(4), max_model_len=larger.max_model_len)
    assert cal.assumption.token_budget == 8192


async def test_a_busy_host_is_not_a_larger_token_budget():
    # CI, stop 36: llama-server at its 2048-token n_batch was measured at 8192 while other jobs
    # shared the machine's two cores. A busy host makes every step longer; a larger budget makes
    # fewer of them.
    from fuzzer.oracle.chunkcap import token_budget

    target = PaperTarget(noise=0.01)
    cal = await calibrate(target, rng=random.Random(1), clock=lambda: 0.0, measure_budget=False)
    busy = replace(TRUE, overhead_s=TRUE.overhead_s * 3, prefill_token_s=TRUE.prefill_token_s * 3,
                   decode_seq_s=TRUE.decode_seq_s * 3)
    assert await token_budget(PaperTarget(busy, noise=0.01), cal, 16384) == 0
    # The control: the same probe on a server whose budget is larger measures it.
    larger = PaperTarget(noise=0.01, assumption=SchedulerAssumption(token_budget=8192))
    assert await token_budget(larger, cal, 16384) == 8192


async def test_a_steps_cost_for_computing_any_prompt_is_moved_from_the_request_overhead_into_the_steps():
    # The third held-out server, a 30B mixture-of-experts model: a step computing a 128-token prompt
    # reads every expert (26 ms) where a decode step reads a few (5.7 ms). Idle probes put those 20 ms
    # in the request overhead, which delays nobody else, and a stream beside prompts was 2.5-7x its
    # bound on a clean server (five confirmed false positives in nine minutes).
    moe = replace(TRUE, prefill_step_s=0.02)
    cal = await calibrate(PaperTarget(moe, noise=0.01), rng=random.Random(1), clock=lambda: 0.0)
    assert cal.model.prefill_step_s == pytest.approx(0.02, rel=0.2)
    assert cal.model.request_overhead_s == pytest.approx(TRUE.request_overhead_s, abs=0.004)
    # An idle request's TTFT is what it was (the floor moved, not added), a stream's step beside a prompt is longer.
    from fuzzer.oracle.expectation import idle_expectation

    assert idle_expectation(512, 2, cal.model, cal.assumption).ttft_s == pytest.approx(
        idle_expectation(512, 2, moe, cal.assumption).ttft_s, rel=0.1)
    assert cal.model.step_s(128, 1, 100) - cal.model.step_s(0, 1, 100) > 0.015
    # The control: a server whose steps cost what the model says keeps its request overhead.
    plain = await calibrate(PaperTarget(noise=0.01), rng=random.Random(1), clock=lambda: 0.0)
    assert plain.model.prefill_step_s == 0.0


async def test_a_fit_with_no_decode_step_skips_the_prefill_step_probe():
    # CI, stop 32: the simulator at speed 20 on a loaded machine fitted a decode step of 0 and the
    # probe divided by it (a traceback from `fuzz replay`). No step: no stream gaps to measure, no floor.
    from fuzzer.oracle.chunkcap import prefill_step_floor

    cal = await calibrate(PaperTarget(noise=0.01), rng=random.Random(1), clock=lambda: 0.0)
    flat = replace(cal, model=replace(cal.model, overhead_s=0.0, decode_seq_s=0.0, context_token_s=0.0))
    target = PaperTarget()
    assert await prefill_step_floor(target, flat) == 0.0
    assert target.executions == 0


async def test_fewer_seats_than_assumed_are_measured_and_bound_the_waits():
    # Stop 36: a clean vLLM-like server started with --max-num-seqs 16 gave three confirmed
    # ttft-outliers (29-362x) in a 10-minute campaign, each a request that waited for a seat the
    # assumed 256 gave it on paper.
    from fuzzer.oracle import judge
    from fuzzer.oracle.seats import SEAT_PROBE_STREAMS, seat_count
    from fuzzer.trace import Request, Trace

    small = PaperTarget(noise=0.01, assumption=SchedulerAssumption(max_num_seqs=16))
    assert await seat_count(small) == 16
    cal = await calibrate(small, rng=random.Random(1), clock=lambda: 0.0)
    assert cal.assumption.max_num_seqs == 16 and "max_num_seqs measured" in cal.assumption.source
    crowd = Trace(requests=tuple(Request(id=f"q{i}", at_ms=float(i), prompt_tokens=64, max_tokens=64)
                                 for i in range(40)))
    result = small.run(crowd)
    assert judge.candidates(crowd, result, cal) == []
    unmeasured = await calibrate(PaperTarget(noise=0.01, assumption=SchedulerAssumption(max_num_seqs=16)),
                                 rng=random.Random(1), clock=lambda: 0.0, measure_seats=False)
    assert unmeasured.assumption.max_num_seqs == 256
    assert any(c.request_id.startswith("q") for c in judge.candidates(crowd, result, unmeasured))
    # Controls: a server that seats all the probe's streams keeps the assumed count, the probe's
    # streams seen beside it (one run); a count the user names stands.
    default = PaperTarget(noise=0.01)
    assert await seat_count(default) == SEAT_PROBE_STREAMS and default.executions == 1
    named = await calibrate(small, assumption=SchedulerAssumption(max_num_seqs=8, source="user override of max_num_seqs"),
                            rng=random.Random(1), clock=lambda: 0.0)
    assert named.assumption.max_num_seqs == 8


async def test_more_seats_than_the_probe_sends_bound_a_crowds_waits_by_the_seats_it_saw():
    # Stop 46: heldout11 runs 64 sequences of the documented 256; the probe's 64 streams all got
    # seats, so a trace running more would have held a request waiting for a seat to a bound that
    # gave it one. The probe's streams are now a floor the slot rule counts seats from.
    from fuzzer.oracle import judge
    from fuzzer.oracle.seats import SEAT_PROBE_STREAMS
    from fuzzer.trace import Request, Trace

    eighty = PaperTarget(noise=0.01, assumption=SchedulerAssumption(max_num_seqs=80))
    cal = await calibrate(eighty, rng=random.Random(1), clock=lambda: 0.0)
    a = cal.assumption
    assert (a.max_num_seqs, a.seats_seen) == (256, SEAT_PROBE_STREAMS) and f"({SEAT_PROBE_STREAMS} seen" in a.describe()
    assert SchedulerAssumption.from_dict(a.to_dict()) == a
    crowd = Trace(requests=tuple(Request(id=f"q{i}", at_ms=float(i) / 4, prompt_tokens=32, max_tokens=96)
                                 for i in range(120)))
    result = eighty.run(crowd)
    assert judge.candidates(crowd, result, cal) == []
    # Control: without the floor the requests that waited for the 80 seats are held to the 256.
    blind = cal.with_assumption(replace(a, seats_seen=0))
    assert any(c.request_id.startswith("q") for c in judge.candidates(crowd, result, blind))
    with pytest.raises(ConfigError):
        SchedulerAssumption(max_num_seqs=32, seats_seen=64)


async def test_a_server_that_keeps_no_prefix_is_fitted_so_and_gives_no_cache_hit():
    # Stop 36: on a clean paper server without prefix caching, the cached probes' extra time was
    # taken for the frontend's (the whole prefill became frontend time, none of it in the steps)
    # and the bound gave shared prefixes cache hits: 39 of 48 corpus and random traces had latency
    # candidates, 8-36x.
    from fuzzer.oracle import judge
    from fuzzer.search.mutators import Limits, generate

    keeps_none = PaperTarget(noise=0.01, assumption=SchedulerAssumption(prefix_caching=False))
    cal = await calibrate(keeps_none, rng=random.Random(1), clock=lambda: 0.0)
    assert cal.assumption.prefix_caching is False and "no prefix-cache hit seen" in cal.assumption.source
    assert cal.model.prefill_token_s == pytest.approx(TRUE.prefill_token_s, rel=0.1) and cal.model.frontend_token_s == 0.0
    traces = [generate(random.Random(i), Limits()) for i in range(12)]
    assert not any(c.metric is not None for t in traces for c in judge.candidates(t, keeps_none.run(t), cal))
    # The control: a server with prefix caching keeps it (and its prefill in the steps).
    cached = await calibrate(PaperTarget(noise=0.01), rng=random.Random(1), clock=lambda: 0.0)
    assert cached.assumption.prefix_caching is True and "prefix-cache" not in cached.assumption.source
    assert cached.model.prefill_token_s == pytest.approx(TRUE.prefill_token_s, rel=0.1)


async def test_a_server_of_one_seat_is_calibrated_with_its_step_as_the_overhead():
    # llama-server -np 1: one sequence decodes at a time, so the batched probes all had one size, and the
    # batch line refused to fit ("2 usable probe measurements at 1 distinct sizes"): no campaign could start.
    from fuzzer.oracle import judge
    from fuzzer.trace import Request, Trace

    one = PaperTarget(noise=0.01, assumption=SchedulerAssumption(max_num_seqs=1))
    cal = await calibrate(one, rng=random.Random(1), clock=lambda: 0.0)
    assert cal.assumption.max_num_seqs == 1 and cal.model.decode_seq_s == 0.0
    assert cal.model.overhead_s == pytest.approx(TRUE.overhead_s + TRUE.decode_seq_s, rel=0.25)
    queue = Trace(requests=tuple(Request(id=f"q{i}", at_ms=float(i), prompt_tokens=64, max_tokens=32) for i in range(6)))
    assert judge.candidates(queue, one.run(queue), cal) == []  # each waits its turn for the seat, by design


def test_a_small_pilot_probe_slower_than_the_large_one_does_not_pace_every_probe_of_its_kind():
    """A probe's cost grows with its size: the small one's outlier (a cold first request) is capped at the large one's."""
    from fuzzer.oracle.probes import MIN_SPACING_S, SPACING_FACTOR, Pace

    outlier = Pace((16, 1.2), (8190, 0.12))
    assert outlier.spacing_s(16) == pytest.approx(SPACING_FACTOR * 0.12)
    assert outlier.spacing_s(8190) == pytest.approx(SPACING_FACTOR * 0.12)
    usual = Pace((16, 0.01), (8190, 0.2))
    assert usual.spacing_s(16) == pytest.approx(max(MIN_SPACING_S, SPACING_FACTOR * 0.01))
    assert usual.spacing_s(4103) == pytest.approx(SPACING_FACTOR * (0.01 + 0.19 * 4087 / 8174))
    assert Pace((16, 0.3), (8190, 0.0)).spacing_s(16) == pytest.approx(SPACING_FACTOR * 0.3)  # the large one unmeasured
