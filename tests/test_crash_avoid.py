"""After a confirmed crash the campaign learns what the crash needs and runs its later traces without it
(fuzzer.search.crashes): vLLM 0.32's CPU build crashed on a seeded request and a campaign then stopped
on the crash loop because its mutants kept the seed."""

from __future__ import annotations

from dataclasses import replace

from fuzzer.execute.managed import SERVER_DIED
from fuzzer.execution import ExecutionResult
from fuzzer.report.export import export_finding
from fuzzer.search.campaign import Campaign
from fuzzer.search.crashes import LEAVING, avoiding, crash_needs, traits_of, without_trait
from fuzzer.search.settings import Settings
from fuzzer.sim import VirtualTarget
from fuzzer.store import Store
from fuzzer.trace import Request, Trace


def _trace(*requests: Request) -> Trace:
    return Trace(requests=requests)


def _req(i: int, **kw) -> Request:
    return Request(id=f"r{i}", at_ms=10.0 * i, prompt_tokens=kw.pop("prompt_tokens", 64),
                   max_tokens=kw.pop("max_tokens", 16), **kw)


def test_a_traces_traits_and_the_trace_without_them():
    trace = _trace(_req(0, seed=3, temperature=1.0), _req(1, logprobs=2), _req(2, cancel_after_tokens=4),
                   _req(3))
    assert traits_of(trace) == ("seed", "logprobs", "sampling", LEAVING)
    plain = avoiding(trace, traits_of(trace))
    assert traits_of(plain) == ()
    assert [r.prompt_tokens for r in plain.requests] == [r.prompt_tokens for r in trace.requests]
    # One trait goes, the others stay; a trait no request carries changes nothing.
    assert traits_of(without_trait(trace, "seed")) == ("logprobs", "sampling", LEAVING)
    assert without_trait(trace, "n") is trace
    # A client that left early asks for what it read and is served to its end.
    assert without_trait(trace, LEAVING).requests[2].max_tokens == 4


def _crashing_when(needs: set[str], restarts: list[int | None]):
    """A run that crashes while the trace keeps every trait of ``needs``; restarts_left counts down."""
    ran: list[tuple[str, ...]] = []

    async def run(trace: Trace) -> bool:
        ran.append(traits_of(trace))
        down = needs <= set(traits_of(trace))
        if down and restarts[0] is not None:
            restarts[0] -= 1
        return down

    return run, ran, (lambda: restarts[0])


async def test_the_trait_whose_removal_alone_lets_the_trace_run_is_what_the_crash_needs():
    trace = _trace(_req(0, seed=3, temperature=1.0, prompt_tokens=2048), _req(1, logprobs=2), _req(2))
    run, ran, left = _crashing_when({"seed"}, [3])
    assert await crash_needs(trace, run, left) == ("seed",)
    assert ran == [(), ("logprobs", "sampling")]  # all traits off first (it ran), then the seed alone off


async def test_a_crash_of_the_shape_alone_avoids_nothing():
    trace = _trace(_req(0, seed=3, temperature=1.0), _req(1))
    run, ran, left = _crashing_when(set(), [3])
    assert await crash_needs(trace, run, left) == ()
    assert ran == [()]
    assert await crash_needs(_trace(_req(0)), run, left) == ()  # no trait: nothing to try


async def test_with_no_restart_to_spare_every_trait_is_avoided():
    trace = _trace(_req(0, seed=3, temperature=1.0), _req(1, logprobs=2), _req(2), _req(3))
    needs = {"logprobs"}
    # The seed is tried first and crashes (one death), leaving none: the rest is not tried.
    run, ran, left = _crashing_when(needs, [1])
    assert await crash_needs(trace, run, left) == ("seed", "logprobs", "sampling")
    assert ran == [(), ("logprobs", "sampling")]
    # With deaths to spare the try goes on to the trait the crash needs.
    run, ran, left = _crashing_when(needs, [5])
    assert await crash_needs(trace, run, left) == ("logprobs",)
    # A server nobody restarts (not launched): one try.
    run, ran, left = _crashing_when(needs, [None])
    assert await crash_needs(trace, run, left) == ("seed", "logprobs", "sampling")
    assert len(ran) == 2


class _SeedCrash:
    """The simulator, whose server 'dies' (as a launched server's death note says) on any trace with a
    seeded request of 256 prompt tokens or more, the way vLLM 0.32's CPU build did on a chunked one."""

    def __init__(self, inner: VirtualTarget):
        self._inner = inner
        self.name = inner.name
        self.idle = inner.idle
        self.crashes = 0
        self.executed: list[Trace] = []

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    async def execute(self, trace: Trace, *, cut_s: float | None = None) -> ExecutionResult:
        self.executed.append(trace)
        result = await self._inner.execute(trace, cut_s=cut_s)
        if any(r.seed is not None and r.prompt_tokens >= 256 for r in trace.requests):
            self.crashes += 1
            return replace(result, warnings=result.warnings + (f"{SERVER_DIED}: seeded chunked prefill",))
        return result


async def test_a_campaign_stops_running_what_its_confirmed_crash_needs(tmp_path):
    seed = _trace(*(_req(i, prompt_tokens=512, max_tokens=32) for i in range(6)))
    crashing = replace(seed, requests=(replace(seed.requests[0], seed=7, temperature=1.0), *seed.requests[1:]),
                       name="seeded")
    store = Store.memory()
    target = _SeedCrash(VirtualTarget(seed=3))
    campaign = Campaign(target, store, Settings(seed=2, max_execs=40, idle_share=0.0), seeds=[seed, crashing],
                        target_key="sim:test")
    await campaign.run()
    crash = [f for f in store.list_findings() if f.kind == "crash"]
    assert len(crash) == 1, [f.kind for f in store.list_findings()]
    assert crash[0].details["crash_needs"] == ["seed"]
    assert campaign.confirmer.crash_avoid == ["seed"]
    # Once the crash was learnt, no trace ran with a seed again: the crash's runs and the try that
    # found what it needs are the only crashes. It is learnt after both: the try without the seed, and the
    # confirmation runs of the crash's trace (in either order: the draws decide which comes first).
    crashed = store.get_trace(crash[0].trace_hash)
    tried = next(i for i, t in enumerate(target.executed) if traits_of(t) == ("sampling",)
                 and t.requests[0].prompt_tokens == 512)
    learnt = max(tried, max(i for i, t in enumerate(target.executed) if t.requests == crashed.requests)) + 1
    assert all(not any(r.seed is not None for r in t.requests) for t in target.executed[learnt:])
    assert len(target.executed) > learnt + 10  # and the campaign went on searching
    # The checkpoint keeps it: a resumed campaign avoids it too.
    assert store.latest_campaign()["state"]["crash_avoid"] == ["seed"]
    # The report says so to the maintainer.
    report = (export_finding(store, crash[0].id, tmp_path) / "report.md").read_text()
    assert "- Needs a sampling `seed`: the same trace without it ran without taking the server down" in report


async def test_a_launched_server_says_how_many_deaths_it_may_still_have():
    from test_launch_crash import _FakeServer, _KillingTarget

    from fuzzer.execute.managed import ManagedTarget

    async def sleep(s: float) -> None:
        return None

    server = _FakeServer(max_restarts=2)
    target = ManagedTarget(_KillingTarget(server), server, sleep=sleep, clock=lambda: 0.0)
    trace = _trace(_req(0))
    assert target.restarts_left() == 2
    await target.execute(trace)  # the server died during it: down now, which counts
    assert target.restarts_left() == 1
    await target.execute(trace)  # started again (a death counted), and died again
    assert target.restarts_left() == 0


class _LaunchedSeedCrash(_SeedCrash):
    """As a launched server: it says how many more deaths it may have (the fleet's worker asks)."""

    info = None

    def restarts_left(self) -> int:
        return 5


def test_a_fleet_learns_what_its_confirmed_crash_needs_too(tmp_path):
    from test_fleet_option import LIMITS, _fleet

    seed = _trace(*(_req(i, prompt_tokens=512, max_tokens=32) for i in range(6)))
    crashing = replace(seed, requests=(replace(seed.requests[0], seed=7, temperature=1.0), *seed.requests[1:]),
                       name="seeded")
    target = _LaunchedSeedCrash(VirtualTarget(seed=3))
    with Store.open(tmp_path / "fleet.db") as store:
        _fleet(store, {"a": (target, "k")}, Settings(max_execs=30, seed=2, limits=LIMITS), [seed, crashing])
        [crash] = [f for f in store.list_findings() if f.kind == "crash"]
        assert crash.details["crash_needs"] == ["seed"]
        assert store.latest_campaign()["state"]["crash_avoid"] == ["seed"]
        # The confirmation's runs and the tries are stored under the traces they ran.
        ran = [store.get_trace(store.get_execution(i).trace_hash) for i in range(1, store.count_executions() + 1)]
        assert any(traits_of(t) == ("sampling",) for t in ran)  # the try without the seed
    learnt = max(i for i, t in enumerate(target.executed) if traits_of(t) == ("sampling",))
    assert all(not any(r.seed is not None for r in t.requests) for t in target.executed[learnt:])
    assert len(target.executed) > learnt + 5
