"""The campaign loop on the simulator's virtual time: finds, records, checkpoints, resumes."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
from conftest import CORPUS

from fuzzer import trace as tf
from fuzzer.execution import Outcome
from fuzzer.oracle.policy import OraclePolicy
from fuzzer.search.campaign import Campaign
from fuzzer.search.mutators import Limits
from fuzzer.search.settings import ExitReason, Settings
from fuzzer.sim import VirtualTarget
from fuzzer.store import Store


def _campaign(store, target, seeds, **settings):
    return Campaign(target, store, Settings(**{"seed": 5, **settings}), seeds=seeds, target_key="sim:test")


async def test_finds_the_planted_logprobs_stall_in_the_seed_phase():
    store = Store.memory()
    target = VirtualTarget(pathologies=("logprobs-batch-cost",), seed=2)
    seeds = [tf.load(CORPUS / "n-logprobs.json")]
    summary = await _campaign(store, target, seeds, max_execs=6).run()
    assert summary.reason is ExitReason.MAX_EXECS
    findings = store.list_findings()
    assert findings, "the planted pathology was not found"
    finding = findings[0]
    # A campaign tests a sampling option before the latencies it may explain: this one is logprobs.
    assert finding.kind == "option-slowdown" and finding.verdict["ablated"] == "logprobs"
    k, n = map(int, finding.reproduced.split("/"))
    assert n >= 3 and k >= 2
    # every run with logprobs closed at 4x the batch without it: the slowdown is a lower bound, and says so
    assert finding.slowdown > 4 and "lower bound" in finding.verdict["detail"]
    assert (finding.id, finding.kind) in summary.new_findings
    # every confirmation run is stored with the campaign, under its purpose
    assert store.purposes(campaign_id=summary.campaign_id)["confirm"] >= 3


async def test_an_option_test_settles_its_seed_and_once_found_the_fuzzed_children_go_without_the_option():
    """The option only slows everyone again (and each run by its slowdown): children are run without it."""
    store = Store.memory()
    target = VirtualTarget(pathologies=("logprobs-batch-cost",), seed=2)
    summary = await _campaign(store, target, [tf.load(CORPUS / "n-logprobs.json")], max_execs=30).run()
    finding = store.list_findings()[0]
    assert finding.kind == "option-slowdown" and finding.verdict["ablated"] == "logprobs"
    rows = store.execution_rows(campaign_id=summary.campaign_id)
    # the seed, then its test (pairs of the seed and its ablation): every fuzzed child comes after
    assert [r["purpose"] for r in rows[:7]] == ["seed"] + ["confirm"] * 6
    fuzzed = [store.get_trace(r["trace_hash"]) for r in rows if r["purpose"] == "fuzz"]
    assert len(fuzzed) >= 10
    assert all(r.logprobs is None for t in fuzzed for r in t.requests)
    # The seed carries the option found: it is not run again for stability (each run would take the slowdown).
    assert rows[7]["purpose"] != "stability" and not any(
        r["purpose"] == "stability" and r["trace_hash"] == finding.trace_hash for r in rows)


async def test_resume_keeps_corpus_findings_and_counts(seed_trace):
    store = Store.memory()
    target = VirtualTarget(pathologies=("hol-prefix-burst",), seed=2)
    first = _campaign(store, target, [seed_trace], max_execs=14)
    s1 = await first.run()
    corpus_before = {e.hash for e in first.corpus.entries.values()}
    findings_before = [(f.id, f.signature) for f in store.list_findings()]
    executions_before = store.count_executions()

    second = _campaign(store, target, [seed_trace], max_execs=executions_before + 8)
    s2 = await second.run()
    assert s2.resumed and s2.campaign_id == s1.campaign_id
    assert corpus_before <= {e.hash for e in second.corpus.entries.values()}
    assert store.count_executions() >= executions_before + 8
    # nothing found twice: the seed is not re-seeded and known signatures are not re-recorded
    signatures = [f.signature for f in store.list_findings()]
    assert len(signatures) == len(set(signatures))
    assert findings_before == [(f.id, f.signature) for f in store.list_findings()][: len(findings_before)]
    second.corpus._check_invariants()


async def test_interrupt_stops_after_the_current_execution(seed_trace):
    store = Store.memory()
    target = VirtualTarget(seed=4)
    stop = asyncio.Event()
    seen = []

    def on_stats(stats):
        seen.append(stats.executions)
        if stats.executions >= 5:
            stop.set()

    campaign = Campaign(target, store, Settings(seed=1, max_execs=500), seeds=[seed_trace],
                        target_key="sim:test", on_stats=on_stats, stop=stop)
    summary = await campaign.run()
    assert summary.reason is ExitReason.INTERRUPTED
    assert 5 <= store.count_executions() < 40
    latest = store.latest_campaign()
    assert latest["status"] == "stopped" and latest["state"]["rng"]


class _Unanswered:
    """A server that accepts every request and never answers: a calibration against it never ends."""

    def __init__(self, inner):
        self._inner = inner
        self.name = inner.name
        self.executions = 0

    async def execute(self, trace, *, cut_s=None):
        self.executions += 1
        await asyncio.Event().wait()

    def __getattr__(self, name):
        return getattr(self._inner, name)


async def test_a_stop_during_the_calibration_ends_the_campaign_at_once_and_stores_no_calibration(seed_trace):
    """A calibration is minutes of probes (over 290 s on a GPU llama-server): Ctrl-C does not wait for it."""
    store = Store.memory()
    target = _Unanswered(VirtualTarget(seed=1))
    stop = asyncio.Event()
    asyncio.get_running_loop().call_later(0.2, stop.set)
    campaign = Campaign(target, store, Settings(seed=1, max_execs=5), seeds=[seed_trace], target_key="sim:test",
                        stop=stop)
    # (A campaign cancelled from outside also returns as interrupted: the time tells the stop's doing from that.)
    summary = await asyncio.wait_for(campaign.run(), timeout=20)
    assert target.executions >= 1  # the calibration had begun
    assert summary.reason is ExitReason.INTERRUPTED and summary.stats.executions == 0
    assert 0.1 < summary.stats.time_s["calibrate"] < 10
    assert store.latest_calibration("sim:test") is None
    assert store.latest_campaign()["status"] == "stopped"


@pytest.mark.parametrize("mutator", ["guided", "null"])
async def test_every_child_is_recorded_with_its_purpose(seed_trace, mutator):
    store = Store.memory()
    campaign = _campaign(store, VirtualTarget(seed=1), [seed_trace], max_execs=10, mutator=mutator)
    await campaign.run()
    purposes = store.purposes(campaign_id=campaign.campaign_id)
    assert purposes.get("seed", 0) == 1  # seeds run once; their stability runs come when first fuzzed
    assert purposes.get("fuzz", 0) >= 1
    # the guided campaign re-ran the seed before mutating it; the null baseline never reads the corpus
    assert (purposes.get("stability", 0) >= 1) == (mutator == "guided")
    assert sum(purposes.values()) == store.count_executions()


async def test_the_stored_settings_say_which_thresholds_and_limits_the_campaign_ran_under(seed_trace):
    store = Store.memory()
    policy = OraclePolicy(factor=3.0, max_runs=8)
    limits = Limits(max_model_len=4096, unsupported=frozenset({"n", "chat"}), max_n=4)
    settings = Settings(seed=5, max_execs=2, policy=policy, limits=limits)
    await Campaign(VirtualTarget(seed=1), store, settings, seeds=[seed_trace], target_key="sim:test").run()
    stored = store.latest_campaign()["settings"]
    assert stored["policy"]["factor"] == 3.0 and stored["limits"]["unsupported"] == ["chat", "n"]
    assert Settings.from_dict(stored) == settings


def test_settings_stored_before_the_policy_and_limits_were_read_with_the_defaults():
    old = {"duration_s": 60.0, "max_execs": None, "seed": 7, "mutator": "null", "stability_runs": 3,
           "idle_share": 0.0, "seed_share": 0.5}
    settings = Settings.from_dict(old)
    assert settings == Settings(duration_s=60.0, seed=7, mutator="null", stability_runs=3, idle_share=0.0, seed_share=0.5)
    assert settings.policy == OraclePolicy() and settings.limits == Limits()
    assert Settings.from_dict({**settings.to_dict(), "from_a_newer_fuzzer": 1}) == settings


class _Clocked:
    """A simulator whose executions move an injected clock by their (virtual) duration, and
    whose idle periods and calibration move it too: time passes only where the server works."""

    def __init__(self, inner):
        self._inner = inner
        self.now = 0.0
        self.name = inner.name

    async def execute(self, trace, *, cut_s=None):
        result = await self._inner.execute(trace, cut_s=cut_s)
        self.now += result.duration_s
        return result

    def idle(self, seconds):
        self.now += seconds
        return self._inner.idle(seconds)

    def __getattr__(self, name):
        return getattr(self._inner, name)


async def test_every_second_is_attributed_to_a_phase_and_survives_a_resume(seed_trace):
    store = Store.memory()
    target = _Clocked(VirtualTarget(pathologies=("hol-prefix-burst",), seed=2))

    def campaign(max_execs):
        return Campaign(target, store, Settings(seed=5, max_execs=max_execs, idle_share=0.0), seeds=[seed_trace],
                        target_key="sim:test", clock=lambda: target.now)

    s1 = (await campaign(12).run()).stats
    by_purpose: dict[str, float] = {}
    for row in store.execution_rows(campaign_id=s1.campaign_id):
        by_purpose[row["purpose"]] = by_purpose.get(row["purpose"], 0.0) + row["duration_s"]
    # Executions under their purpose, to the microsecond; calibration ran on the same clock.
    for purpose, seconds in by_purpose.items():
        assert abs(s1.time_s[purpose] - seconds) < 2e-3, purpose
    assert s1.time_s["calibrate"] > 0 and s1.time_s["fuzz"] > 0 and s1.time_s["seed"] > 0
    assert abs(sum(s1.time_s.values()) - s1.elapsed_s) < 0.01 and s1.time_s["other"] < 0.01  # rounded to ms
    assert 0 < s1.fuzz_share < 1
    # A resumed campaign adds to the totals of the first run (its checkpoint kept them).
    s2 = (await campaign(store.count_executions() + 6).run()).stats
    assert s2.time_s["fuzz"] > s1.time_s["fuzz"] and s2.time_s["calibrate"] == pytest.approx(s1.time_s["calibrate"])
    assert sum(s2.time_s.values()) == pytest.approx(sum(s1.time_s.values()) + s2.elapsed_s, abs=0.02)


async def test_no_execution_runs_far_past_the_campaigns_end(seed_trace):
    # The planted logprobs batch cost makes each run of this seed 8.5 s against an FCFS bound of
    # 0.4 s: without the time cap the campaign's last runs went on past its end (stop 33: a
    # 3-minute HTTP campaign overran by 113 s). With it, a run stops at twice the execution
    # budget (3 s here), the last ones at the budget past the end, and what they measured is kept
    # (the finding is still confirmed, on lower bounds).
    from fuzzer.execution import Outcome

    store = Store.memory()
    target = _Clocked(VirtualTarget(pathologies=("logprobs-batch-cost",), seed=2))
    duration = 60.0
    campaign = Campaign(target, store, Settings(seed=5, duration_s=duration, idle_share=0.0),
                        seeds=[tf.load(CORPUS / "n-logprobs.json")], target_key="sim:test", clock=lambda: target.now)
    stats = (await campaign.run()).stats
    budget = campaign.execution_budget_s()
    assert stats.elapsed_s <= duration + budget + 0.5
    rows = store.execution_rows(campaign_id=stats.campaign_id)
    cut = [r for r in rows if any(q.outcome is Outcome.CUT for q in store.get_execution(r["id"]).requests)]
    # A run stops at twice the budget, or at twice its own FCFS end where that is longer: a mutant run over the
    # budget because none of its tries fitted (Campaign.over_budget). (The step under way ends.)
    assert cut and all(r["duration_s"] <= 2 * max(budget, campaign.expected_duration_s(store.get_trace(r["trace_hash"])))
                       + 0.5 for r in rows)
    # The requests beside the logprobs carrier are the option's victims: an option-slowdown, on runs the
    # cap closed (their latency candidates are confirmed without the option, where they are not slow).
    assert [f.kind for f in store.list_findings()] == ["option-slowdown"]


async def test_with_a_duration_mutants_longer_than_their_share_of_it_are_passed_over(seed_trace):
    from fuzzer.search.pacing import AFFORD_TRIES, EXECUTION_SHARE

    store = Store.memory()
    target = _Clocked(VirtualTarget(seed=3))
    duration = 60.0  # virtual seconds
    campaign = Campaign(target, store, Settings(seed=7, duration_s=duration, max_execs=30, idle_share=0.0),
                        seeds=[seed_trace], target_key="sim:test", clock=lambda: target.now)
    stats = (await campaign.run()).stats
    budget = campaign.execution_budget_s()
    assert budget == EXECUTION_SHARE * duration
    ran = [store.get_trace(r["trace_hash"]) for r in store.execution_rows(campaign_id=stats.campaign_id)
           if r["purpose"] == "fuzz"]
    over = sum(campaign.expected_duration_s(t) > budget for t in ran)
    # Mutants over the budget were passed over; one ran only when AFFORD_TRIES in a row were.
    assert stats.too_long > 0 and over == campaign.over_budget <= stats.too_long // AFFORD_TRIES
    assert len(ran) > over
    # Without a duration there is no budget (the benchmarks count executions, not seconds).
    assert _campaign(Store.memory(), VirtualTarget(seed=3), [seed_trace], max_execs=2).execution_budget_s() is None


class _Stalling(_Clocked):
    """As _Clocked, but every third execution says its client stalled (a client short of CPU)."""

    def __init__(self, inner, stall_s):
        super().__init__(inner)
        self.stall_s = stall_s
        self.runs = 0

    async def execute(self, trace, *, cut_s=None):
        result = await super().execute(trace, cut_s=cut_s)
        self.runs += 1
        return replace(result, client_lag_s=self.stall_s if self.runs % 3 == 0 else 0.004)


async def test_executions_whose_client_starved_are_counted_and_the_summary_says_what_to_do(seed_trace):
    from fuzzer.cli.campaign import client_stall_hint

    store = Store.memory()
    target = _Stalling(VirtualTarget(seed=3), stall_s=1.5)
    stats = (await Campaign(target, store, Settings(seed=5, max_execs=9, idle_share=0.0), seeds=[seed_trace],
                            target_key="sim:test", clock=lambda: target.now).run()).stats
    lags = [store.get_execution(r["id"]).client_lag_s for r in store.execution_rows(campaign_id=stats.campaign_id)]
    assert stats.client_stalls == sum(lag > 0.1 for lag in lags) >= 3  # the 4 ms ones are the loop's jitter
    assert stats.worst_client_stall_s == 1.5
    hint = client_stall_hint(stats)
    assert f"in {stats.client_stalls} of {stats.executions} executions" in hint and "worst 1.50 s" in hint
    assert "taskset" in hint
    # A client that never stalled past 100 ms gets no count (and the summary no hint).
    quiet = _Stalling(VirtualTarget(seed=3), stall_s=0.05)
    stats = (await Campaign(quiet, Store.memory(), Settings(seed=5, max_execs=6, idle_share=0.0), seeds=[seed_trace],
                            target_key="sim:test", clock=lambda: quiet.now).run()).stats
    assert stats.client_stalls == 0 and stats.worst_client_stall_s == 0.0


def _sleep_on(target):
    """A sleep that moves ``target``'s clock (the campaign's backoff waits, on virtual time)."""
    async def sleep(s):
        target.now += s
    return sleep


class _Dies(_Clocked):
    """As _Clocked, but after ``alive`` executions every request is refused (a server that exited)."""

    def __init__(self, inner, alive):
        super().__init__(inner)
        self.alive = alive
        self.runs = 0

    async def execute(self, trace, *, cut_s=None):
        self.runs += 1
        if self.runs > self.alive:
            self.now += 0.001
            from fuzzer.errors import TargetError

            raise TargetError("cannot connect to http://127.0.0.1:1: connection refused")
        return await super().execute(trace)


async def test_a_server_that_stays_down_stops_the_campaign_after_its_patience_with_everything_saved(seed_trace):
    # vLLM's CPU build, stop 33: its engine died mid-campaign and the API server exited; a 12-minute
    # campaign waited 724 s for it and searched nothing. Now it waits recover_patience_s and stops.
    store = Store.memory()
    target = _Dies(VirtualTarget(seed=3), alive=20)
    sleep = _sleep_on(target)
    settings = Settings(seed=7, duration_s=3600.0, idle_share=0.0, recover_patience_s=120.0)
    campaign = Campaign(target, store, settings, seeds=[seed_trace], target_key="sim:test",
                        clock=lambda: target.now, sleep=sleep)
    summary = await campaign.run()
    assert summary.reason is ExitReason.SERVER_DOWN and "connection refused" in summary.server_error
    assert 120.0 <= summary.stats.time_s["recover"] < 120.0 + 61  # one backoff past the patience at most
    assert summary.stats.elapsed_s < 3600.0 and summary.stats.server == "down"
    assert store.latest_campaign()["status"] == "stopped"
    ran = summary.stats.executions
    assert ran > 0
    # The same command resumes; a server back up is searched again.
    target.alive = 10**6
    again = await Campaign(target, store, replace(settings, max_execs=ran + 3), seeds=[seed_trace],
                           target_key="sim:test", clock=lambda: target.now, sleep=sleep).run()
    assert again.reason is ExitReason.MAX_EXECS and again.stats.executions >= ran + 3


def test_the_server_down_stop_reason():
    from fuzzer.search.settings import RECOVER_PATIENCE_S, stop_reason

    s = Settings()
    assert stop_reason(s, stopped=False, executions=1, elapsed_s=5.0, down_s=RECOVER_PATIENCE_S) is ExitReason.SERVER_DOWN
    assert stop_reason(s, stopped=False, executions=1, elapsed_s=5.0, down_s=RECOVER_PATIENCE_S - 1) is None
    assert stop_reason(s, stopped=False, executions=1, elapsed_s=5.0) is None  # up
    assert stop_reason(replace(s, recover_patience_s=None), stopped=False, executions=1, elapsed_s=5.0,
                       down_s=1e9) is None  # waits for ever
    assert stop_reason(s, stopped=True, executions=1, elapsed_s=5.0, down_s=1e9) is ExitReason.INTERRUPTED


async def test_a_long_wait_ticks_until_its_work_is_done():
    from fuzzer.search.pacing import unless_stopped

    ticks = []
    result = await unless_stopped(asyncio.sleep(0.35, result="done"), asyncio.Event(), tick=lambda: ticks.append(1),
                                  every_s=0.1)
    assert result == "done" and 2 <= len(ticks) <= 4


class _EngineDies(_Dies):
    """As _Dies, but the execution in which the server dies answers every request with an error event (vLLM
    0.32's CPU engine: its API server streams ``EngineDeadError`` to every open request, then exits)."""

    async def execute(self, trace, *, cut_s=None):
        if self.runs == self.alive:
            self.runs += 1
            result = await _Clocked.execute(self, trace, cut_s=cut_s)
            dead = "error event in stream: EngineCore encountered an issue"
            return replace(result, idle_after=None, requests=[
                replace(r, outcome=Outcome.HTTP_ERROR, http_status=200, detail=dead, ttft_s=None, token_times_s=(),
                        e2e_s=None) for r in result.requests])
        return await super().execute(trace, cut_s=cut_s)


async def test_a_server_down_when_the_duration_ends_keeps_its_candidate_and_the_summary_says_so(seed_trace):
    from fuzzer.cli.campaign import server_down_hint

    # vLLM 0.32's CPU build (stop 65, a --target campaign of benchmarks/vllm/truth.sh): the engine died in an
    # execution, the API server exited, and the campaign waited 363 s for it until its --duration ended. Its
    # summary said "duration reached" and nothing of the server, and the failure's candidate was dropped.
    store = Store.memory()
    target = _EngineDies(VirtualTarget(seed=3), alive=12)
    sleep = _sleep_on(target)
    settings = Settings(seed=7, duration_s=400.0, idle_share=0.0)
    summary = await Campaign(target, store, settings, seeds=[seed_trace], target_key="sim:test",
                             clock=lambda: target.now, sleep=sleep).run()
    assert summary.reason is ExitReason.DURATION and summary.stats.server == "down"
    assert "connection refused" in summary.server_error  # said whenever the server is down at the end
    assert summary.stats.pending == 1
    hint = server_down_hint(summary)
    assert "connection refused" in hint and "1 candidate(s) it was confirming stay pending" in hint
    assert "run the same command to confirm them" in hint
    from fuzzer.cli.status import _stats
    status = _stats(store, "fuzz.db", clock=lambda: 0.0)
    assert status["candidates_pending"] == 1 and status["server"] == "down"  # `fuzz status` says it too
    [(trace_hash, pending)] = [(p["trace_hash"], p) for p in store.latest_campaign()["state"]["pending"]]
    assert pending["kind"] in ("error", "crash")
    dead_run = store.execution_rows(campaign_id=summary.campaign_id)[-1]
    assert dead_run["trace_hash"] == trace_hash
    # The same command, once the server is back, confirms what was pending first.
    target.alive = 10**6
    again = await Campaign(target, store, replace(settings, duration_s=None, max_execs=summary.stats.executions + 2),
                           seeds=[seed_trace], target_key="sim:test", clock=lambda: target.now, sleep=sleep).run()
    assert again.stats.server == "up" and not store.latest_campaign()["state"]["pending"]
    assert server_down_hint(again) is None
