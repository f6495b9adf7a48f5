"""report.md of ``fuzz export``: a finding written up for an engine's bug tracker (ARCHITECTURE.md, "Shrink and report").

A pure function of stored values: the finding and its verdict, the trace, the
target as detected, and one stored execution of the trace (what one run
measured). The text is GitHub-flavoured Markdown, ready to paste into an issue;
the timeline picture is linked as ``timeline.png`` next to it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fuzzer import __version__
from fuzzer.execution import ExecutionResult
from fuzzer.oracle.verdict import reproduction_of
from fuzzer.trace import Trace

_OPTION = "option-slowdown"
_METRIC_WORDS = {"ttft": "TTFT", "max_itl": "max inter-token latency", "e2e": "end-to-end latency"}
_KIND_WORDS = {
    "ttft-outlier": "head-of-line blocking: a request waits far longer for its first token than FCFS explains",
    "itl-stall": "a stream stalls between tokens far longer than FCFS batching explains",
    "e2e-outlier": "a request takes far longer end to end than FCFS batching explains (starvation)",
    "cold-start": "the first requests after an idle period are slow; warm runs are not",
    "option-slowdown": "one request's sampling option (seed, logprobs) slows the other requests of the trace; "
                       "the baseline is the same trace with that option removed from every request, run "
                       "alternately with it on the same server (no model of the engine's costs)",
    "leak": "the server does not return to idle after every request ended",
    "error": "a request fails with a server error or a reset connection",
    "hang": "a request gets no answer within the client timeout",
    "protocol": "the server breaks the streaming protocol (malformed event, missing [DONE], wrong token count)",
    "crash": "the server stops answering after the trace",
}
#: What each request trait of fuzzer.search.crashes is, in a report.
_TRAIT_WORDS = {
    "seed": "a sampling `seed`", "logprobs": "`logprobs`", "n": "`n` > 1", "sampling": "`temperature` > 0",
    "prefix": "a shared prompt prefix", "unstreamed": "`stream: false`", "chat": "the chat API",
    "eos": "`ignore_eos: false`", "leaving": "a client that disconnects early",
}


@dataclass(frozen=True)
class Exhibit:
    """What report.md is written from."""

    finding_id: int
    kind: str
    signature: str
    trace: Trace
    verdict: Mapping[str, Any]
    #: kind, version, model, url, capabilities as the fuzzer detected them; None when unknown.
    target: Mapping[str, Any] | None = None
    #: One stored execution of ``trace`` and its id; None when none is stored.
    execution: ExecutionResult | None = None
    execution_id: int | None = None
    #: Requests of the original trace when ``trace`` is its minimized form.
    original_requests: int | None = None
    minimized: Mapping[str, Any] | None = None
    #: Markdown for the picture: an image link, or a sentence saying why there is none.
    timeline: str = ""
    #: The threshold the repro script applies, seconds (latency kinds).
    repro_threshold_s: float | None = None
    #: For a crash: the request traits without which the same trace ran (fuzzer.search.crashes).
    crash_needs: tuple[str, ...] = ()
    #: An itl-stall only in the choices after the first of an n > 1 stream (fuzzer.oracle.judge.later_choice_stall).
    held_choice: bool = False

    @property
    def option(self) -> str | None:
        """For an option-slowdown: the option whose removal from the trace is the baseline."""
        return self.verdict.get("ablated") if self.kind == _OPTION else None


def markdown(x: Exhibit) -> str:
    v = x.verdict
    lines = [f"# {title(x)}", ""]
    lines += [f"**Kind:** `{x.kind}` ({_KIND_WORDS.get(x.kind, x.kind)}). "
              f"Found by a coverage-guided serving-latency fuzzer; finding {x.finding_id}, signature `{x.signature}`.", ""]
    lines += ["## Environment", "", *_environment(x.target), ""]
    lines += ["## Trace", ""]
    size = f"{len(x.trace.requests)} requests"
    if x.original_requests is not None and x.original_requests != len(x.trace.requests):
        size += f", minimized from {x.original_requests}"
    lines += [f"{size}, each sent open-loop at `at_ms` from the start (arrival offsets, not think times). "
              "Prompts are common English words fitted to the exact token count with the server's /tokenize; "
              "requests of one prefix group share their first `prefix` tokens. "
              + (f"The request with `{x.option}` marked **bold**." if x.option else "Victim marked **bold**."), ""]
    lines += _trace_table(x.trace, v.get("request_id"))
    if x.trace.prefixes:
        lines += ["", "Shared prefixes: " + ", ".join(f"`{k}` = {n} tokens" for k, n in x.trace.prefixes.items())]
    lines += ["", "## Expected vs observed", ""]
    lines += _expected(x)
    lines += ["", "## Statistics", ""]
    lines += _statistics(x)
    lines += ["", "## Timeline", "", x.timeline or "_No timeline._", ""]
    if x.execution is not None:
        lines += [f"What the client measured in execution {x.execution_id} (ms; `sent` from the start of the "
                  "execution, the others from the request's send):", ""]
        lines += _measured_table(x.execution, v.get("request_id"))
        if x.execution.warnings:
            lines += ["", "Harness warnings of that execution (client-side, not server latency):", ""]
            lines += [f"- {w}" for w in x.execution.warnings]
        lines.append("")
    lines += ["## Reproduce", ""]
    lines += _reproduce(x)
    lines += ["", "---", f"_Generated by fuzzer {__version__} (`fuzz export {x.finding_id}`); "
              "trace.json replays with `fuzz replay trace.json --target URL`._", ""]
    return "\n".join(lines)


def title(x: Exhibit) -> str:
    v = x.verdict
    rid, metric = v.get("request_id"), v.get("metric")
    observed, bound, idle = v.get("observed_s"), v.get("expected_s"), v.get("idle_s")
    if x.option:
        others = sum(getattr(r, x.option) is None for r in x.trace.requests)
        if observed is None or not bound:
            return f"{x.kind}: `{x.option}` on request {rid} slows the other {others} requests ({reproduction_of(v)} pairs)"
        return (f"{x.kind}: `{x.option}` on request {rid} makes the other {others} requests' "
                f"{_compared(v)} {observed / bound:.1f}x that of the same trace without it ({_ms(observed)} ms vs "
                f"{_ms(bound)} ms), with {len(x.trace.requests)} requests")
    if metric and observed is not None and v.get("overtakers"):
        what = (f"{_METRIC_WORDS.get(metric, metric)} of request {rid} is {_ms(observed)} ms: served after "
                f"{', '.join(v['overtakers'])}, sent later with no less work")
        return f"{x.kind}: {what}, with {len(x.trace.requests)} requests"
    if metric and observed is not None and bound:
        what = f"{_METRIC_WORDS.get(metric, metric)} of request {rid} is {_ms(observed)} ms, {observed / bound:.1f}x its FCFS bound ({_ms(bound)} ms)"
        if idle:
            what += f", {observed / idle:.0f}x idle"
        return f"{x.kind}: {what}, with {len(x.trace.requests)} requests"
    if rid:
        return f"{x.kind}: request {rid} ends {v.get('detail') or x.kind} ({reproduction_of(v)} runs)"
    return f"{x.kind}: {_KIND_WORDS.get(x.kind, x.kind)} ({reproduction_of(v)} runs)"


def _environment(target: Mapping[str, Any] | None) -> list[str]:
    if not target:
        return ["- Server: unknown (the finding has no recorded target)"]
    caps = target.get("capabilities") or {}
    rejected = sorted(k for k, ok in caps.items() if not ok)
    out = [
        f"- Server: `{target.get('kind') or 'unknown'}` {target.get('version') or '(version not reported)'}",
        f"- Model: `{target.get('model') or 'unknown'}`",
        f"- Endpoint: `{target.get('url')}`",
    ]
    if caps:
        out.append("- Features rejected by the server: " + (", ".join(rejected) if rejected else "none"))
    return out


def _trace_table(trace: Trace, victim: str | None) -> list[str]:
    rows = ["| id | at_ms | prompt_tokens | prefix | max_tokens | stream | api | n | logprobs | cancel_after | ignore_eos |"
            " leaves_after_ms | seed |",
            "|---|---:|---:|---|---:|---|---|---:|---:|---:|---|---:|---:|"]
    for r in trace.requests:
        rid = f"**{r.id}**" if r.id == victim else r.id
        rows.append(
            f"| {rid} | {r.at_ms:g} | {r.prompt_tokens} | {r.prefix or ''} | {r.max_tokens} | {_yes(r.stream)} | {r.api} "
            f"| {r.n} | {'' if r.logprobs is None else r.logprobs} | {r.cancel_after_tokens or ''} | {_yes(r.ignore_eos)} "
            f"| {'' if r.disconnect_after_ms is None else f'{r.disconnect_after_ms:g}'} | {'' if r.seed is None else r.seed} |"
        )
    return rows


def _expected(x: Exhibit) -> list[str]:
    v = x.verdict
    metric = v.get("metric")
    if not metric:
        return [f"Expected: every request answered and the server idle afterwards. Observed: {v.get('detail') or x.kind} "
                f"in {reproduction_of(v)} runs."]
    name = _METRIC_WORDS.get(metric, metric)
    if x.option:
        return _expected_option(x)
    if v.get("overtakers"):
        return _expected_order(v, name)
    rows = [f"| {name} of {v.get('request_id')} | ms |", "|---|---:|"]
    rows.append(f"| idle expectation (alone on a warm server) | {_ms(v.get('idle_s'))} |")
    rows.append(f"| FCFS bound (a reasonable FCFS chunked-prefill scheduler, given the work before it) | {_ms(v.get('expected_s'))} |")
    rows.append(f"| observed (median over the confirmation runs) | {_ms(v.get('observed_s'))} |")
    if v.get("excess_s") is not None:
        rows.append(f"| excess over the FCFS bound | {_ms(v.get('excess_s'))} |")
    out = rows + [""]
    if v.get("slowdown") is not None:
        out.append(f"Slowdown versus idle (what a user feels): **{v['slowdown']:.1f}x**. ")
    if v.get("observed_s") is not None and v.get("expected_s"):
        out.append(f"Observed over the FCFS bound (what queueing by design does not explain): "
                   f"**{v['observed_s'] / v['expected_s']:.1f}x**; a finding needs {v.get('threshold') or '?'}x"
                   + (f" and {_ms(v['min_excess_s'])} ms above it (far beyond its own work)." if v.get("min_excess_s")
                      else "."))
    if x.held_choice:
        out.append(f"The silence was in a choice after the first of request {v.get('request_id')}'s `n` choices: "
                   "choice 0's own gaps stayed within the bound while another choice streamed nothing for that long.")
    return out + _notes(v, "Scheduler assumption of the bound", "Evidence that set the bound")


def _notes(v: Mapping[str, Any], assumption: str, evidence: str) -> list[str]:
    """The verdict's assumption, evidence and detail, each a paragraph under its label."""
    out: list[str] = []
    for label, key in ((assumption, "assumption"), (evidence, "evidence"), ("Note", "detail")):
        if v.get(key):
            out += ["", f"{label}: {v[key]}."]
    return out


def _expected_order(v: Mapping[str, Any], name: str) -> list[str]:
    """Expected vs observed of a finding decided by the order of first tokens."""
    rid, others = v.get("request_id"), ", ".join(v["overtakers"])
    rows = [f"| {name} of {rid} | ms |", "|---|---:|",
            f"| idle expectation (alone on a warm server) | {_ms(v.get('idle_s'))} |",
            f"| had it been served no later than {v['overtakers'][0]} (its first token, from {rid}'s send) "
            f"| {_ms(v.get('expected_s'))} |",
            f"| observed (median over the runs that showed the inversion) | {_ms(v.get('observed_s'))} |", ""]
    out = rows + [f"Expected: under first-come-first-served admission {rid}, which reached the server first and needs "
                  f"no more work (prompt tokens without any shared prefix, max_tokens, n), gets its first token no "
                  f"later than {others}. Observed: after them, in {reproduction_of(v)} runs. No step-cost model "
                  "enters this: the order itself is the evidence."]
    return out + _notes(v, "Scheduler assumption", "Evidence")


def _compared(verdict: Mapping[str, Any]) -> str:
    """What of the other requests an option-slowdown compared (fuzzer.oracle.ablation.statistic_of)."""
    if verdict.get("compared") == "itl":
        return "median inter-token latency (each one's mean gap between tokens)"
    return "median end-to-end latency"


def _expected_option(x: Exhibit) -> list[str]:
    """Expected vs observed of an option-slowdown: the trace against itself without the option."""
    v, option = x.verdict, x.option
    others = sum(getattr(r, option) is None for r in x.trace.requests)
    rows = [f"| {_compared(v)} of the {others} requests without `{option}` | ms |", "|---|---:|",
            f"| without `{option}` (removed from every request: the baseline) | {_ms(v.get('expected_s'))} |",
            f"| with `{option}` on {v.get('request_id')} (the trace as found) | {_ms(v.get('observed_s'))} |", ""]
    out = rows + [f"Expected: `{option}` changes no token work, so the other requests take as long with it as "
                  f"without it. Observed: {reproduction_of(v)} alternating pairs of runs at least "
                  f"{v.get('threshold') or '?'}x slower with it."]
    if v.get("observed_s") is not None and v.get("expected_s"):
        out[-1] += f" Median with over without: **{v['observed_s'] / v['expected_s']:.2f}x**."
    return out + _notes(v, "Assumption", "Evidence")


def _statistics(x: Exhibit) -> list[str]:
    v = x.verdict
    out = [f"- Reproduction rate: **{reproduction_of(v)}** {'pairs of runs' if x.option else 'runs'}"]
    if x.minimized:
        out.append(f"- Minimized trace: reproduced **{x.minimized.get('reproduced')}** in the final confirmation "
                   f"({x.minimized.get('executions')} executions to minimize)")
    if x.crash_needs:
        needs = " and ".join(_TRAIT_WORDS.get(t, t) for t in x.crash_needs)
        out.append(f"- Needs {needs}: the same trace without {'them' if len(x.crash_needs) > 1 else 'it'} "
                   "ran without taking the server down")
    if v.get("p_value") is not None:
        out.append(f"- p-value: {v['p_value']:.2g} ({v.get('method')})")
    elif v.get("method"):
        out.append(f"- Method: {v['method']}")
    if v.get("effect") is not None:
        ci = v.get("effect_ci")
        interval = f", {int(ci[2] * 100)}% CI {ci[0]:.2f}-{ci[1]:.2f}" if ci and None not in ci[:2] else ""
        if v.get("overtakers"):
            out.append(f"- Effect size: {v['effect']:.2f}x (the victim's TTFT over its TTFT had it been served no later "
                       "than the requests that overtook it: a lower bound on what the inversion cost it)")
        elif x.option:
            out.append(f"- Effect size: {v['effect']:.2f}x (geometric mean over the pairs of the other requests' "
                       f"{_compared(v)} with `{x.option}` over that without it)")
        else:
            out.append(f"- Effect size: {v['effect']:.2f}x (the victim's median observed/bound ratio over the calibration baseline's median{interval})")
    if v.get("n_sample") and x.option:
        out.append(f"- Samples: {v['n_sample']} pairs of runs, the trace with and without `{x.option}`, alternating")
    elif v.get("n_sample"):
        out.append(f"- Samples: {v['n_sample']} runs against a baseline of {v.get('n_baseline', 0)} calibration probes")
    return out


def _measured_table(result: ExecutionResult, victim: str | None) -> list[str]:
    rows = ["| id | sent | TTFT | max ITL | E2E | outcome | prompt / completion tokens |",
            "|---|---:|---:|---:|---:|---|---|"]
    for r in sorted(result.requests, key=lambda r: r.sent_s):
        rid = f"**{r.request_id}**" if r.request_id == victim else r.request_id
        tokens = f"{_blank(r.prompt_tokens)} / {_blank(r.completion_tokens)}"
        outcome = r.outcome.value + (f": {r.detail}" if r.detail and r.outcome.failed else "")
        rows.append(f"| {rid} | {_ms(r.sent_s)} | {_ms(r.ttft_s)} | {_ms(r.max_itl_s)} | {_ms(r.e2e_s)} | {outcome} | {tokens} |")
    return rows


def _reproduce(x: Exhibit) -> list[str]:
    url = (x.target or {}).get("url") or "http://127.0.0.1:8000"
    if "://" not in url or url.startswith("sim+"):
        url = "http://127.0.0.1:8000"
    out = ["`repro.py` needs only Python 3.9+ (standard library). It replays the trace open-loop with fresh "
           "prompt text each run and applies the criterion below; it exits 1 when the problem reproduces in a "
           "majority of runs, 0 when not, 125 when it cannot test (server unreachable, model not served).", "",
           "```sh", f"python3 repro.py --base-url {url} --runs 5", "```", ""]
    if x.repro_threshold_s is not None:
        metric = _METRIC_WORDS.get(str(x.verdict.get("metric")), "latency")
        out += [f"Criterion: {metric} of {x.verdict.get('request_id')} >= {_ms(x.repro_threshold_s)} ms in a run "
                "(override with `--threshold-ms`).", ""]
    elif x.option:
        out += [f"Criterion: a run is a pair, the trace as is and with `{x.option}` removed from every request (each "
                f"after the server is idle, in alternating order); it reproduces when the {_compared(x.verdict)} of "
                f"the requests without `{x.option}` is at least {x.verdict.get('threshold') or '?'}x that without it.",
                ""]
    out += ["Bisect a regression (build and start the server at each step, then):", "",
            "```sh", f"git bisect run python3 repro.py --base-url {url}", "```"]
    return out


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}"


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _blank(value: Any) -> str:
    return "?" if value is None else str(value)

