"""Part 3 of the generated repro.py: the finding's criterion, the output, the command line.

Everything below the ``repro.py begins`` line is copied into the script; the
``DATA`` line is replaced by the finding's data.
"""

import argparse
import http.client
import os
import random
import statistics
import sys
import time
import traceback

from fuzzer.report.repro._script_net import (
    DEFAULT_RUNS,
    DEFAULT_TIMEOUT_S,
    EXIT_CANNOT_TEST,
    EXIT_NOT_REPRODUCED,
    EXIT_REPRODUCED,
    FAILURE_OUTCOMES,
    IDLE_BARRIER_S,
    LATENCY_KINDS,
    METRIC_NAMES,
    MIN_OTHERS,
    OPTION_KIND,
    POLL_S,
    CannotTest,
    Counter,
    Server,
    check_server,
    say,
)
from fuzzer.report.repro._script_run import carriers, idle_barrier, others_value, run_once, without_option

# --- repro.py begins ---

# --- the finding (filled in by the generator) ---

DATA = None  # <<repro-data>>


def metric_value(res, metric):
    if metric == "ttft":
        return res["ttft_s"]
    if metric == "max_itl":  # the longest silence of any choice (choice_gap_s: the others', n > 1)
        t = res["token_times_s"]
        gaps = [b - a for a, b in zip(t, t[1:])] + [g for g in [res.get("choice_gap_s")] if g is not None]  # noqa: RUF007
        return max(gaps) if gaps else None
    return res["e2e_s"] if res["outcome"] in ("ok", "cancelled") else None


def threshold_s(criterion, override_ms):
    if override_ms is not None:
        return override_ms / 1000.0
    expected = criterion.get("expected_s")
    if expected is None:
        return None
    return max(criterion["factor"] * expected, expected + criterion["margin_s"])


def unmeasured(victim, name):
    """The verdict of a run whose victim has no ``name`` to judge: a victim that ended ok had no text in its
    stream (a model's invisible tokens), so the run tests nothing; one that failed does not reproduce."""
    if victim["outcome"] == "ok":
        return None, "%s ended ok but its stream carried no text to time its %s by" % (victim["id"], name)
    return False, "%s measured no %s (%s)" % (victim["id"], name, victim["outcome"])


def judge_run(criterion, results, server, limit_s, leak_wait_s):
    """(verdict, words): verdict True (reproduced), False (not) or None (this run tests nothing)."""
    kind = criterion["kind"]
    by_id = {res["id"]: res for res in results}
    victim = by_id.get(criterion.get("request_id")) if criterion.get("request_id") else None
    if victim is None and kind not in ("crash", "leak"):
        raise CannotTest("the trace has no request %r to judge" % criterion.get("request_id"))
    if kind in LATENCY_KINDS and criterion.get("overtakers"):
        return judge_order(criterion, victim, by_id)
    if kind in LATENCY_KINDS:
        if victim["outcome"] == "rejected":
            return None, "%s was rejected (HTTP %s): %s" % (victim["id"], victim["status"], victim["detail"][:80])
        value = metric_value(victim, criterion["metric"])
        name = METRIC_NAMES.get(criterion["metric"], criterion["metric"])
        if value is None:
            return unmeasured(victim, name)
        hit = value >= limit_s
        return hit, "%s %s %.1f ms %s %.1f ms" % (victim["id"], name, value * 1000, ">=" if hit else "<", limit_s * 1000)
    if kind in FAILURE_OUTCOMES:
        wanted = (criterion["outcome"],) if criterion.get("outcome") else FAILURE_OUTCOMES[kind]
        hit = victim["outcome"] in wanted
        return hit, "%s ended %s%s" % (victim["id"], victim["outcome"], " as the finding says" if hit else
                                       " (the finding: %s)" % " or ".join(wanted))
    if kind == "crash":
        for _ in range(3):
            try:
                status, _ = server.call("GET", "/health", timeout_s=2.0)
                if status < 500:
                    return False, "the server still answers /health (HTTP %d)" % status
            except (OSError, http.client.HTTPException):
                pass
            time.sleep(0.5)
        return True, "the server stopped answering /health after the trace"
    if kind == "leak":
        # A slow run (a busy host) frees as slowly as it steps: the window stretches with its median token gap.
        steps, min_gaps, cap_s = criterion.get("leak_stretch") or (0, 1, 0.0)
        gaps = sorted(b - a for res in results for a, b in zip(res["token_times_s"], res["token_times_s"][1:]))
        if len(gaps) >= max(min_gaps, 1):
            leak_wait_s = max(leak_wait_s, min(steps * gaps[len(gaps) // 2], cap_s))
        # Idle is running + waiting at 0 and, on vLLM, the KV cache in use back to its level before the run.
        margin, before = criterion.get("kv_margin"), server.kv_before
        judge_kv = margin is not None and before is not None

        def held(kv):
            return judge_kv and kv is not None and kv > before + margin

        deadline = time.monotonic() + leak_wait_s
        busy, kv = server.load()
        while busy is not None and (busy > 0 or held(kv)) and time.monotonic() < deadline:
            time.sleep(POLL_S)
            busy, kv = server.load()
        if busy is None:
            raise CannotTest("a leak is judged from /metrics running + waiting, and this server exports neither")
        if busy > 0:
            return True, "running + waiting still %g, %g s after every request ended" % (busy, leak_wait_s)
        if held(kv):
            return True, ("running + waiting returned to 0, but %.1f%% of the KV cache was still in use %g s after "
                          "every request ended (%.1f%% before the run)" % (100 * kv, leak_wait_s, 100 * before))
        with_kv = " and the KV cache in use with them" if judge_kv and kv is not None else ""
        return False, "running + waiting returned to 0" + with_kv
    raise CannotTest("this script does not know how to judge a %r finding" % kind)


def judge_order(criterion, victim, by_id):
    """An ordering inversion: the victim's first token came at least margin_s after that of a
    request the finding names, sent at least reach_s after the victim (FCFS serves the victim first)."""
    if victim["outcome"] == "rejected":
        return None, "%s was rejected (HTTP %s): %s" % (victim["id"], victim["status"], victim["detail"][:80])
    if victim["ttft_s"] is None:
        return unmeasured(victim, "first token")
    first = victim["sent_s"] + victim["ttft_s"]
    seen = []
    for name in criterion["overtakers"]:
        other = by_id.get(name)
        if other is None or other["ttft_s"] is None or other["sent_s"] - victim["sent_s"] < criterion["reach_s"]:
            continue
        lead = first - (other["sent_s"] + other["ttft_s"])
        seen.append((lead, name, other["sent_s"] - victim["sent_s"]))
    if not seen:
        return None, "none of %s got a first token sent %.0f ms or more after %s" % (
            ", ".join(criterion["overtakers"]), criterion["reach_s"] * 1000, victim["id"])
    lead, name, gap = max(seen)
    hit = lead >= criterion["margin_s"]
    return hit, "%s's first token %.1f ms %s that of %s, sent %.1f ms after it" % (
        victim["id"], abs(lead) * 1000, "after" if lead >= 0 else "before", name, gap * 1000)


def judge_option(criterion, trace, with_results, without_results):
    """(verdict, words, medians) of one pair: the other requests' median ITL (or E2E, the criterion's
    metric) with the option at least factor x that of the same trace without it; medians is (with,
    without) or None."""
    option = criterion["ablate"]
    with_s, without_s = others_value(criterion, trace, with_results), others_value(criterion, trace, without_results)
    if with_s is None or without_s is None or without_s <= 0:
        return None, "fewer than %d requests without %s completed in the run %s it" % (
            MIN_OTHERS, option, "with" if with_s is None else "without"), None
    ratio = with_s / without_s
    hit = ratio >= criterion["factor"]
    return hit, "median %s of the others %.1f ms with %s, %.1f ms without: %.2fx %s %gx" % (
        others_name(criterion), with_s * 1000, option, without_s * 1000, ratio, ">=" if hit else "<",
        criterion["factor"]), (with_s, without_s)


def others_name(crit):
    """What of the other requests an option-slowdown compares."""
    return "ITL (mean token gap)" if crit.get("metric") == "itl" else "E2E"


# --- output ---------------------------------------------------------------------------------------


def ms(value):
    return "-" if value is None else "%.1f" % (value * 1000)


def show_run(results, marks):
    """A row per request; ``marks``: request id -> what to point at ("victim", "has seed")."""
    say("  %-14s %9s %9s %11s %9s  %s" % ("request", "sent_ms", "ttft_ms", "max_itl_ms", "e2e_ms", "outcome"))
    for res in results:
        mark = "  <- " + marks[res["id"]] if res["id"] in marks else ""
        detail = (": " + res["detail"][:60]) if res["outcome"] not in ("ok", "cancelled") and res["detail"] else ""
        say("  %-14s %9s %9s %11s %9s  %s%s%s" % (
            res["id"], ms(res["sent_s"]), ms(res["ttft_s"]), ms(metric_value(res, "max_itl")),
            ms(res["e2e_s"]), res["outcome"], detail, mark))


def parse_args(argv):
    class Parser(argparse.ArgumentParser):
        def error(self, message):  # a usage error must not read as "bad commit" to git bisect
            self.print_usage(sys.stderr)
            sys.stderr.write("repro.py: error: %s\n" % message)
            sys.exit(EXIT_CANNOT_TEST)

    crit = DATA["criterion"]
    p = Parser(description="Reproduce finding %s (%s). Exit 1 reproduced, 0 not, 125 cannot test."
               % (DATA["finding"].get("id"), crit["kind"]))
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server base URL (default %(default)s)")
    p.add_argument("--model", default=None, help="model to request (default: the first of GET /v1/models)")
    p.add_argument("--runs", type=int, default=DEFAULT_RUNS, help="executions of the trace (default %(default)s)")
    p.add_argument("--api-key", default=None, help="API key (default: $OPENAI_API_KEY; never printed)")
    p.add_argument("--threshold-ms", type=float, default=None,
                   help="victim latency that counts as reproduced, overriding the embedded criterion")
    p.add_argument("--timeout-s", type=float, default=DEFAULT_TIMEOUT_S,
                   help="seconds without a byte before a request counts as hung (default %(default)s)")
    p.add_argument("--idle-s", type=float, default=crit.get("idle_before_s", 0.0),
                   help="idle seconds before every run (default %(default)s; a cold-start finding needs it)")
    p.add_argument("--leak-wait-s", type=float, default=crit.get("leak_wait_s", 5.0),
                   help="how long a leak check waits for the server to return to idle (default %(default)s)")
    p.add_argument("--seed", type=int, default=None, help="seed of the prompt text (default: a fresh one)")
    args = p.parse_args(argv)
    if args.runs < 1:
        p.error("--runs must be >= 1")
    if args.timeout_s <= 0:
        p.error("--timeout-s must be > 0")
    return args


def execute(server, trace, args, model, counter, rng, tag, kind):
    """One execution of ``trace`` after the idle barrier: (results, running + waiting when the barrier gave up)."""
    waiting = idle_barrier(server, args.idle_s, args.leak_wait_s if kind == "leak" else IDLE_BARRIER_S)
    server.kv_before = server.load()[1] if kind == "leak" else None  # what a leak check compares with
    results = run_once(server, trace, DATA["words"], model, counter, rng, DATA["server"].get("features") or {},
                       tag, args.timeout_s)
    if all(res["outcome"] == "rejected" for res in results):
        raise CannotTest("every request was rejected (HTTP %s: %s)" % (results[0]["status"], results[0]["detail"][:120]))
    if kind != "crash" and all(res["outcome"] == "connection-error" for res in results):
        raise CannotTest("no request got through: %s" % results[0]["detail"][:120])
    return results, waiting


def show(results, waiting, trace, marks, counter):
    if waiting:
        say("  note: the server was not idle before this run (running + waiting = %g)" % waiting)
    show_run(results, marks)
    if not counter.exact:
        off = [res["id"] for res, r in zip(results, trace["requests"])
               if isinstance((res["usage"] or {}).get("prompt_tokens"), int)
               and res["usage"]["prompt_tokens"] != r["prompt_tokens"]]
        if off:
            say("  note: the server counted other prompt lengths for %s (no /tokenize to fit them)" % ", ".join(off))


def run_pair(server, trace, crit, args, model, counter, rng, run):
    """One run of an option-slowdown: the trace as is and without the option, each after the idle
    barrier, the order alternating run by run (a server that drifts favours neither)."""
    option = crit["ablate"]
    ablated = without_option(trace, option)
    marks = {rid: "has " + option for rid in carriers(trace, option)}
    order = [(True, trace), (False, ablated)] if run % 2 == 1 else [(False, ablated), (True, trace)]
    out = {}
    say("run %d/%d" % (run, args.runs))
    for has, t in order:
        results, waiting = execute(server, t, args, model, counter, rng, "repro%d%s-" % (run, "w" if has else "o"),
                                   crit["kind"])
        say("  with %s (the trace as found):" % option if has else
            "  without %s (removed from every request):" % option)
        show(results, waiting, t, marks if has else {}, counter)
        out[has] = results
    return judge_option(crit, trace, out[True], out[False])


def reproduce(args):
    crit = DATA["criterion"]
    trace = DATA["trace"]
    kind = crit["kind"]
    server = Server(args.base_url, args.api_key or os.environ.get("OPENAI_API_KEY"), args.timeout_s)
    limit_s = threshold_s(crit, args.threshold_ms) if kind in LATENCY_KINDS else None
    if kind in LATENCY_KINDS and limit_s is None:
        raise CannotTest("the finding has no embedded FCFS bound; pass --threshold-ms")
    if kind == OPTION_KIND:
        mine = carriers(trace, crit.get("ablate"))
        if not mine or len(trace["requests"]) - len(mine) < MIN_OTHERS:
            raise CannotTest("the trace needs a request with %s and %d without it" % (crit.get("ablate"), MIN_OTHERS))
    model = check_server(server, args.model)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 32)
    counter = Counter(server, model, DATA["server"].get("kind"), DATA["words"])
    finding = DATA["finding"]
    say("finding %s: %s (%s), %d requests, seen %s in the fuzzer" % (
        finding.get("id"), kind, finding.get("signature"), len(trace["requests"]), finding.get("reproduced")))
    say("server: %s  model: %s  prompts: %s  seed: %d" % (
        server.base_url, model, "exact lengths via /tokenize" if counter.exact else "1 token per word (no /tokenize)",
        seed))
    say("criterion: " + describe(crit, limit_s))
    if kind == OPTION_KIND and args.threshold_ms is not None:
        say("note: --threshold-ms does not apply: each run is judged against the same trace without %s" % crit["ablate"])
    master = random.Random(seed)
    hits, tested, lines, values, pairs = 0, 0, [], [], []
    for run in range(1, args.runs + 1):
        rng = random.Random(master.getrandbits(64))
        if kind == OPTION_KIND:
            verdict, words, medians = run_pair(server, trace, crit, args, model, counter, rng, run)
            if medians is not None:
                pairs.append(medians)
        else:
            results, waiting = execute(server, trace, args, model, counter, rng, "repro%d-" % run, kind)
            say("run %d/%d" % (run, args.runs))
            show(results, waiting, trace, {crit["request_id"]: "victim"} if crit.get("request_id") else {}, counter)
            verdict, words = judge_run(crit, results, server, limit_s, args.leak_wait_s)
            if kind in LATENCY_KINDS and crit.get("request_id"):
                victim = next(res for res in results if res["id"] == crit["request_id"])
                value = metric_value(victim, crit["metric"])
                if value is not None:
                    values.append(value)
        say("  -> %s: %s" % ({True: "reproduced", False: "not reproduced", None: "not tested"}[verdict], words))
        lines.append(words)
        if verdict is not None:
            tested += 1
            hits += int(verdict)
        if kind == "crash" and verdict:
            break  # the server is down: there is nothing left to run against
    if tested == 0:
        raise CannotTest("no run could test the finding: " + lines[-1])
    reproduced = hits * 2 > tested or (kind == "crash" and hits > 0)
    say("")
    say("summary: reproduced in %d/%d runs (a majority is needed)" % (hits, tested))
    if values and not crit.get("overtakers"):
        say("  %s of %s: median %.1f ms, min %.1f ms, max %.1f ms; threshold %.1f ms" % (
            METRIC_NAMES.get(crit["metric"]), crit["request_id"], statistics.median(values) * 1000,
            min(values) * 1000, max(values) * 1000, limit_s * 1000))
    if pairs:
        ratios = [a / b for a, b in pairs]
        say("  median %s of the others, median over runs: %.1f ms with %s, %.1f ms without; ratio median %.2fx "
            "(min %.2fx, max %.2fx); factor %gx" % (
                others_name(crit), statistics.median(a for a, _ in pairs) * 1000, crit["ablate"],
                statistics.median(b for _, b in pairs) * 1000, statistics.median(ratios), min(ratios), max(ratios),
                crit["factor"]))
    if crit.get("note"):
        say("  note: " + crit["note"])
    say("RESULT: REPRODUCED" if reproduced else "RESULT: NOT REPRODUCED")
    return EXIT_REPRODUCED if reproduced else EXIT_NOT_REPRODUCED


def describe(crit, limit_s):
    kind = crit["kind"]
    if kind == OPTION_KIND:
        option = crit["ablate"]
        mine = carriers(DATA["trace"], option)
        how = ("median %s of the %d requests without %s >= %g x that of the same trace with %s removed from every "
               "request (%s has it), in a majority of runs; a run is a pair of executions, each after the idle "
               "barrier, in alternating order" % (others_name(crit), len(DATA["trace"]["requests"]) - len(mine),
                                                  option, crit["factor"],
                                                  option, ", ".join(mine)))
        if crit.get("expected_s") is not None:
            how += " (in the fuzzer: %.1f ms without %s)" % (crit["expected_s"] * 1000, option)
        return how
    if kind in LATENCY_KINDS and crit.get("overtakers"):
        return ("first token of %s at least %.0f ms after that of %s, sent %.0f ms or more later "
                "(FCFS serves %s first), in a majority of runs" % (
                    crit["request_id"], crit["margin_s"] * 1000, " or ".join(crit["overtakers"]),
                    crit["reach_s"] * 1000, crit["request_id"]))
    if kind in LATENCY_KINDS:
        name = METRIC_NAMES.get(crit["metric"], crit["metric"])
        how = "%s of %s >= %.1f ms" % (name, crit["request_id"], limit_s * 1000)
        if crit.get("expected_s") is not None:
            how += " (max(%g x FCFS bound %.1f ms, bound + %.0f ms))" % (
                crit["factor"], crit["expected_s"] * 1000, crit["margin_s"] * 1000)
        if kind == "cold-start":
            how += ", each run after %g s idle" % crit.get("idle_before_s", 0)
        return how + ", in a majority of runs"
    if kind in FAILURE_OUTCOMES:
        wanted = (crit["outcome"],) if crit.get("outcome") else FAILURE_OUTCOMES[kind]
        return "%s ends %s, in a majority of runs" % (crit["request_id"], " or ".join(wanted))
    if kind == "crash":
        return "the server stops answering /health after the trace"
    if kind == "leak":
        return "running + waiting do not return to 0 within %g s after every request ended" % crit.get("leak_wait_s", 5)
    return kind


def main(argv=None):
    args = parse_args(argv)
    try:
        return reproduce(args)
    except CannotTest as e:
        say("cannot test: %s" % e)
        say("RESULT: CANNOT TEST")
        return EXIT_CANNOT_TEST
    except Exception:  # noqa: BLE001 - a bug in this script must not read as "bad commit" to git bisect
        traceback.print_exc()
        say("RESULT: CANNOT TEST (internal error in repro.py, see above)")
        return EXIT_CANNOT_TEST


if __name__ == "__main__":
    if DATA is None:
        sys.stderr.write("this is the template of repro.py; `fuzz export ID` writes a runnable one\n")
        sys.exit(EXIT_CANNOT_TEST)
    sys.exit(main())
