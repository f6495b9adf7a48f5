"""The stand-alone repro script of a finding (ARCHITECTURE.md, "Shrink and report"): one file, Python standard library only.

The script's source lives in three real, lintable modules of this package
(``_script_net``, ``_script_run``, ``_script_main``); everything below each one's
``repro.py begins`` line is copied, in that order, under the union of their
standard-library imports, and the ``DATA`` line is replaced by the finding's data:
the trace, the criterion, what is known of the server, and the word list of
:mod:`fuzzer.execute.prompts` (so prompts are built the same way).

The criterion comes from the stored verdict (:meth:`fuzzer.oracle.verdict.Verdict.to_dict`):

- latency kinds (ttft-outlier, itl-stall, e2e-outlier): the victim's metric is at
  least ``max(factor x FCFS bound, bound + margin)`` in a run;
- a ttft-outlier decided by the order of first tokens (its verdict names ``overtakers``):
  the victim's first token at least ``margin`` after that of one of them sent at least
  ``reach_s`` after it;
- cold-start: the same, each run after ``idle_before_s`` of idleness;
- option-slowdown: a run is a pair, the trace and the same trace with the option
  (``ablate``: seed or logprobs) removed from every request; the median ITL (mean token
  gap; ``metric`` itl) or e2e of the requests without the option is at least ``factor`` x
  that without it;
- error / hang / protocol: the victim request fails the same way;
- crash: the server stops answering /health after the trace;
- leak: running + waiting do not return to 0 within ``leak_wait_s``, stretched by ``leak_stretch`` to the
  run's median token gaps (the executor's leak window, fuzzer.execution.leak_window_s), or they do and the KV
  cache in use stays ``kv_margin`` above its level before the run (vLLM's gauge) that long.

A run reproduces or not; the script exits 1 when a majority of runs reproduce,
0 when not, 125 when it cannot test (for ``git bisect run``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from fuzzer import __version__
from fuzzer import trace as trace_format
from fuzzer.errors import ConfigError
from fuzzer.execute.http import DEFAULT_IDLE_AFTER_TIMEOUT_S
from fuzzer.execution import KV_HELD_MARGIN, LEAK_WINDOW_MAX_S, LEAK_WINDOW_MIN_GAPS, LEAK_WINDOW_STEPS
from fuzzer.execute.prompts import WORDS
from fuzzer.oracle.ablation import OPTIONS
from fuzzer.oracle.policy import CANDIDATE_FACTOR, COLD_IDLE_S, MIN_MARGIN_S, OPTION_FACTOR, ORDER_REACH_S
from fuzzer.trace import Trace

__all__ = ["DATA_FORMAT", "Criterion", "criterion_from_verdict", "script_data", "script_source"]

#: Version of the DATA object embedded in a script.
#:     1 - finding, criterion, server, trace, words (criterion.ablate added later, optional).
DATA_FORMAT = 1

_PARTS = ("_script_net.py", "_script_run.py", "_script_main.py")
_BEGIN = "# --- repro.py begins ---"
_DATA_LINE = "DATA = None  # <<repro-data>>"
_IMPORT = re.compile(r"^(import \w[\w.]*|from (?!fuzzer\b)[\w.]+ import [\w, ]+)$")
_LATENCY = ("ttft-outlier", "itl-stall", "e2e-outlier", "cold-start")
_FAILURE_OUTCOMES = {
    "error": ("http-error", "connection-error"),
    "hang": ("timeout",),
    "protocol": ("malformed", "missing-done", "token-mismatch"),
}
_OPTION = "option-slowdown"
_KINDS = (*_LATENCY, _OPTION, *_FAILURE_OUTCOMES, "crash", "leak")
# The JSON's words are wrapped at this width, so the script stays readable in a diff.
_WORD_LINE_CHARS = 100


@dataclass(frozen=True)
class Criterion:
    """What one run of the script must show to count as reproduced."""

    kind: str
    request_id: str | None = None
    #: ttft | max_itl | e2e, for latency kinds; for an option-slowdown, what of the other requests
    #: it compares: itl (their median mean token gap) or e2e.
    metric: str | None = None
    #: The candidate factor over the FCFS bound (the verdict's threshold); for an
    #: option-slowdown, over the other requests' median ITL (or e2e) without the option.
    factor: float = CANDIDATE_FACTOR
    #: The victim's FCFS bound in the verdict's runs (median), seconds; for an option-slowdown,
    #: the other requests' median ITL (or e2e) without the option (informational: each run measures its own).
    expected_s: float | None = None
    #: The absolute margin above the bound, as in the oracle.
    margin_s: float = MIN_MARGIN_S
    #: For error/hang/protocol: the exact outcome the victim ended with, when known.
    outcome: str | None = None
    #: Idle seconds before every run (cold-start findings).
    idle_before_s: float = 0.0
    #: How long a leak check waits for running + waiting to return to 0.
    leak_wait_s: float = DEFAULT_IDLE_AFTER_TIMEOUT_S
    #: ... at least, or (steps, min gaps, cap s): that many of the run's median token gaps, where the run had
    #: that many gaps, up to the cap (the executor's leak window, fuzzer.execution.leak_window_s).
    leak_stretch: tuple[int, int, float] = (LEAK_WINDOW_STEPS, LEAK_WINDOW_MIN_GAPS, LEAK_WINDOW_MAX_S)
    #: A leak is also KV still in use this much over its level before the run with nothing running or waiting
    #: (on a server that reports vLLM's KV usage; fuzzer.execution.KV_HELD_MARGIN); None: not checked.
    kv_margin: float | None = None
    #: Said in the script's summary (e.g. where the bound comes from).
    note: str = ""
    #: For a finding decided by the order of first tokens: the requests that overtook the
    #: victim (the criterion is then the inversion, not a threshold), and how much later
    #: than the victim one must have been sent.
    overtakers: tuple[str, ...] = ()
    reach_s: float = ORDER_REACH_S
    #: For an option-slowdown: the option (seed, logprobs) removed from every request to make
    #: the baseline run of each pair; ``request_id`` is a request that has it.
    ablate: str | None = None

    @property
    def threshold_s(self) -> float | None:
        """The victim's latency that counts as reproduced; None when there is no fixed one."""
        if self.expected_s is None or self.ablate is not None:
            return None
        return max(self.factor * self.expected_s, self.expected_s + self.margin_s)


def criterion_from_verdict(kind: str, verdict: Mapping[str, Any], *, note: str = "") -> Criterion:
    """The script's criterion for a finding of ``kind`` judged by ``verdict`` (Verdict.to_dict())."""
    if kind not in _KINDS:
        raise ConfigError(f"no repro criterion for finding kind {kind!r} (known: {', '.join(_KINDS)})")
    request_id = verdict.get("request_id")
    if kind in _LATENCY:
        metric = verdict.get("metric")
        if metric not in ("ttft", "max_itl", "e2e") or not request_id:
            raise ConfigError(f"a {kind} verdict must name its request and metric (ttft, max_itl or e2e), got {metric!r}")
        return Criterion(
            kind=kind,
            request_id=request_id,
            metric=metric,
            factor=float(verdict.get("threshold") or CANDIDATE_FACTOR),
            expected_s=verdict.get("expected_s"),
            margin_s=max(MIN_MARGIN_S, verdict.get("min_excess_s") or 0.0),
            idle_before_s=COLD_IDLE_S if kind == "cold-start" else 0.0,
            note=note,
            overtakers=tuple(verdict.get("overtakers") or ()),
        )
    if kind == _OPTION:
        option = verdict.get("ablated")
        if option not in OPTIONS or not request_id:
            raise ConfigError(f"an {kind} verdict must name a request and the option it ablates "
                              f"({', '.join(OPTIONS)}), got {option!r}")
        return Criterion(kind=kind, request_id=request_id, metric="itl" if verdict.get("compared") == "itl" else "e2e",
                         factor=float(verdict.get("threshold") or OPTION_FACTOR),
                         expected_s=verdict.get("expected_s"), note=note, ablate=option)
    if kind in _FAILURE_OUTCOMES:
        if not request_id:
            raise ConfigError(f"a {kind} verdict must name its request")
        detail = verdict.get("detail")
        outcome = detail if detail in _FAILURE_OUTCOMES[kind] else None
        return Criterion(kind=kind, request_id=request_id, outcome=outcome, note=note)
    return Criterion(kind=kind, note=note, kv_margin=KV_HELD_MARGIN if kind == "leak" else None)


def script_data(
    *,
    finding: Mapping[str, Any],
    criterion: Criterion,
    trace: Trace,
    server: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The DATA object of a script. ``server``: kind, version, model, features (capabilities)."""
    if criterion.ablate is not None:
        # An option-slowdown names a request with the option: one of this trace's.
        mine = [r.id for r in trace.requests if getattr(r, criterion.ablate) is not None]
        if not mine:
            raise ConfigError(f"the trace has no request with {criterion.ablate}, the option of the finding")
        if criterion.request_id not in mine:
            criterion = replace(criterion, request_id=mine[0])
    if criterion.request_id is not None:
        try:
            trace.request(criterion.request_id)
        except KeyError:
            raise ConfigError(
                f"the trace has no request {criterion.request_id!r}, the victim of the finding"
            ) from None
    server = dict(server or {})
    return {
        "format": DATA_FORMAT,
        "generator": f"fuzzer {__version__}",
        "finding": {k: finding.get(k) for k in ("id", "kind", "signature", "reproduced", "slowdown")},
        "criterion": asdict(criterion),
        "server": {
            "kind": server.get("kind"),
            "version": server.get("version"),
            "model": server.get("model"),
            "features": {k: bool(v) for k, v in (server.get("features") or {}).items()},
        },
        "trace": trace.to_dict(),
        "words": list(WORDS),
    }


def script_source(data: Mapping[str, Any]) -> str:
    """The text of repro.py for a DATA object (see :func:`script_data`)."""
    imports: set[str] = set()
    bodies = []
    here = Path(__file__).parent
    for name in _PARTS:
        text = (here / name).read_text()
        head, sep, body = text.partition(_BEGIN + "\n")
        if not sep:
            raise RuntimeError(f"{name} lacks the line {_BEGIN!r}")  # a broken package, not user input
        imports.update(line for line in head.splitlines() if _IMPORT.match(line))
        bodies.append(body.strip("\n"))
    source = "\n\n\n".join(bodies)
    if source.count(_DATA_LINE) != 1:
        raise RuntimeError(f"the script parts must hold the line {_DATA_LINE!r} exactly once")
    source = source.replace(_DATA_LINE, "DATA = json.loads(r'''\n" + _data_json(data) + "\n''')")
    plain = sorted(i for i in imports if i.startswith("import "))
    froms = sorted(i for i in imports if i.startswith("from "))
    finding = data.get("finding", {})
    header = _HEADER.format(
        id=finding.get("id"), kind=finding.get("kind"), generator=data.get("generator", "fuzzer")
    )
    return header + "\n".join(plain + froms) + "\n\n" + source + "\n"


def _data_json(data: Mapping[str, Any]) -> str:
    """JSON of DATA, laid out for reading: a line per section, a line per request, words wrapped."""
    parts = []
    for key, value in data.items():
        if key == "trace":
            text = trace_format.dumps(trace_format.from_dict(value)).rstrip("\n")
        elif key == "words":
            text = _wrap_list(value)
        else:
            text = json.dumps(value, sort_keys=True, ensure_ascii=True, allow_nan=False)
        parts.append(f"{json.dumps(key)}: {text}")
    text = "{" + ",\n".join(parts) + "}"
    # A raw triple-quoted string holds any JSON except one with ''' in it; \u0027 is the same JSON.
    text = text.replace("'", "\\u0027")
    if json.loads(text) != json.loads(json.dumps(data)):
        raise RuntimeError("the embedded JSON does not read back as the data")  # a generator bug
    return text


def _wrap_list(words: list[str]) -> str:
    lines, line = [], []
    for w in words:
        item = json.dumps(w)
        if line and sum(len(x) + 2 for x in line) + len(item) > _WORD_LINE_CHARS:
            lines.append(", ".join(line))
            line = []
        line.append(item)
    if line:
        lines.append(", ".join(line))
    return "[" + ",\n ".join(lines) + "]"


_HEADER = '''#!/usr/bin/env python3
"""Reproduce finding {id} ({kind}) of a serving-latency fuzzing campaign.

Python standard library only (3.9+). Replays the embedded trace against an
OpenAI-compatible server the way the fuzzer did: every request sent on an absolute
open-loop schedule, prompts of exact token length (fitted with the server's
/tokenize when it has one) and fresh prompt text on every run, streams read event
by event. Then it applies the finding's criterion (DATA["criterion"]) to each run.

Exit status, for `git bisect run`:
    1    RESULT: REPRODUCED in a majority of the runs (this commit is bad)
    0    RESULT: NOT REPRODUCED (this commit is good)
    125  RESULT: CANNOT TEST: server unreachable, model not served, requests rejected

Usage:
    python3 repro.py --base-url http://127.0.0.1:8000 [--model M] [--runs 5]
    git bisect run python3 repro.py --base-url http://127.0.0.1:8000

The API key comes from --api-key or the OPENAI_API_KEY environment variable and
is never printed. Generated by {generator} (`fuzz export`).
"""

'''
