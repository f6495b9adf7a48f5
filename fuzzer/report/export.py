"""``fuzz export``: write out what a maintainer needs for one finding (ARCHITECTURE.md, "Shrink and report").

:func:`export_finding` writes ``<out>/<ID>/``:

- ``repro.py``: the script stored with the finding (``fuzz minimize`` stores it), or
  one generated now from the finding's minimized trace (else its original trace);
- ``report.md``: the write-up for a bug tracker (:mod:`fuzzer.report.markdown`);
- ``timeline.png``: one bar per request of a stored execution (:mod:`fuzzer.report.timeline`),
  skipped with a note in report.md when matplotlib is not installed;
- ``trace.json``: the trace, for ``fuzz replay``.

:func:`repro_script` is what the minimizer calls to store a script with the finding.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fuzzer import trace as trace_format
from fuzzer.errors import FuzzError, NotFoundError, OutputError
from fuzzer.execution import ExecutionResult
from fuzzer.oracle.ablation import OPTIONS, carriers, others_value, without_option
from fuzzer.oracle.calibration import Calibration, calibration_keys
from fuzzer.oracle.judge import observe
from fuzzer.oracle.kinds import FindingKind, Metric
from fuzzer.report import markdown as bugreport
from fuzzer.report import timeline
from fuzzer.report.repro import (
    Criterion,
    criterion_from_verdict,
    script_data,
    script_source,
)
from fuzzer.store import Store, StoredFinding
from fuzzer.trace import Trace

__all__ = ["export_finding", "repro_script", "verdict_for"]

#: Stored executions of a trace looked at to pick the one drawn in timeline.png (the newest ones).
MAX_EXECUTIONS_EXAMINED = 20

_METRIC_OF = {"ttft": lambda r: r.ttft_s, "max_itl": lambda r: r.max_itl_s, "e2e": lambda r: r.e2e_s}


def repro_script(
    finding: StoredFinding,
    trace: Trace,
    verdict: Mapping[str, Any] | None = None,
    *,
    target: Mapping[str, Any] | None = None,
) -> str:
    """The text of a stand-alone repro.py for ``finding`` replaying ``trace``.

    ``verdict`` (Verdict.to_dict()) gives the criterion; by default the finding's own.
    When ``trace`` is not the finding's original trace (a minimized one) and no verdict
    for it is given, the victim's FCFS bound is the original trace's, and the script
    says so. ``target`` (Store.get_target) tells the script the server kind and features.
    """
    note = ""
    if verdict is None:
        verdict = finding.verdict
        bound = finding.kind != FindingKind.OPTION_SLOWDOWN  # its baseline is measured by every run of the script
        if bound and trace.content_hash() != finding.trace_hash and verdict.get("expected_s") is not None:
            note = ("the FCFS bound is the one measured on the original trace, not on this minimized one; "
                    "use --threshold-ms to judge against another")
    criterion = criterion_from_verdict(finding.kind, verdict, note=note)
    return _script(finding, trace, criterion, target)


def export_finding(store: Store, finding_id: int | str, out_dir: str | Path) -> Path:
    """Write repro.py, report.md, timeline.png and trace.json into ``out_dir/<ID>/``; returns that folder."""
    finding = store.get_finding(finding_id)
    trace = store.get_trace(finding.minimized_trace_hash or finding.trace_hash)
    target = _target(store, finding)
    verdict, note = verdict_for(store, finding, trace, target)
    criterion = criterion_from_verdict(finding.kind, verdict, note=note)
    folder = _folder(Path(out_dir) / str(finding.id))

    script = finding.repro_script or _script(finding, trace, criterion, target)
    _write(folder / "repro.py", script, mode=0o755)
    _write(folder / "trace.json", trace_format.dumps(trace))

    execution_id, execution = _pick_execution(store, trace, verdict, criterion)
    picture = _timeline(folder, execution, execution_id, verdict)
    original = store.get_trace(finding.trace_hash) if finding.minimized else trace
    exhibit = bugreport.Exhibit(
        finding_id=finding.id,
        kind=finding.kind,
        signature=finding.signature,
        trace=trace,
        verdict=verdict,
        target=target,
        execution=execution,
        execution_id=execution_id,
        original_requests=len(original.requests) if finding.minimized else None,
        minimized=finding.details.get("minimized") if finding.minimized else None,
        timeline=picture,
        repro_threshold_s=criterion.threshold_s,
        crash_needs=tuple(finding.details.get("crash_needs") or ()),
        held_choice=bool(finding.details.get("held_choice")),
    )
    _write(folder / "report.md", bugreport.markdown(exhibit))
    return folder


# --- pieces ------------------------------------------------------------------------------------


def _script(finding: StoredFinding, trace: Trace, criterion: Criterion, target: Mapping[str, Any] | None) -> str:
    server = None
    if target:
        server = {"kind": target.get("kind"), "version": target.get("version"), "model": target.get("model"),
                  "features": target.get("capabilities") or {}}
    info = {"id": finding.id, "kind": finding.kind, "signature": finding.signature,
            "reproduced": finding.reproduced, "slowdown": finding.slowdown}
    return script_source(script_data(finding=info, criterion=criterion, trace=trace, server=server))


def _target(store: Store, finding: StoredFinding) -> dict[str, Any] | None:
    if finding.target_id is None:
        return None
    try:
        return store.get_target(finding.target_id)
    except NotFoundError:
        return None


def verdict_for(
    store: Store, finding: StoredFinding, trace: Trace, target: Mapping[str, Any] | None
) -> tuple[dict[str, Any], str]:
    """The verdict to report for ``trace``, and a note on where its bound comes from.

    ``fuzz minimize`` can pass this verdict to :func:`repro_script` so the stored script
    judges the minimized trace against its own bound.

    For a minimized trace of a latency finding, the victim's bound, idle expectation
    and observed time are recomputed by the oracle from the stored executions of the
    minimized trace with the target's stored calibration, when both exist.
    """
    verdict = dict(finding.verdict)
    if not finding.minimized or trace.content_hash() == finding.trace_hash:
        return verdict, ""
    if finding.kind == FindingKind.OPTION_SLOWDOWN:
        return _option_verdict(store, verdict, trace), ""
    metric, victim = verdict.get("metric"), verdict.get("request_id")
    calibration = _calibration(store, target)
    if metric and victim and calibration is not None:
        observations = []
        for execution_id in store.execution_ids(trace_hash=trace.content_hash())[-MAX_EXECUTIONS_EXAMINED:]:
            result = store.get_execution(execution_id)
            for report in observe(trace, result, calibration):
                if report.request_id == victim and Metric(metric) in report.observations:
                    observations.append(report.observations[Metric(metric)])
        if verdict.get("overtakers"):
            # Decided by the order of first tokens: the minimized trace's runs that show the inversion.
            inverted = [o for o in observations if o.order is not None]
            if inverted:
                observed = statistics.median(o.observed_s for o in inverted)
                verdict.update(expected_s=statistics.median(o.order.bound_s for o in inverted if o.order),
                               observed_s=observed, idle_s=statistics.median(o.idle_s for o in inverted),
                               overtakers=sorted({n for o in inverted if o.order for n in o.order.overtakers}))
                return verdict, ""
            observations = []
        if observations:
            expected = statistics.median(o.expected_s for o in observations)
            observed = statistics.median(o.observed_s for o in observations)
            idle = statistics.median(o.idle_s for o in observations)
            verdict.update(expected_s=expected, observed_s=observed, idle_s=idle, excess_s=observed - expected,
                           slowdown=observed / idle if idle else None)
            return verdict, ""
    if metric:
        return verdict, ("the FCFS bound is the one measured on the original trace (no stored executions or "
                         "calibration to recompute it for the minimized one); use --threshold-ms to judge against another")
    return verdict, ""


def _option_verdict(store: Store, verdict: dict[str, Any], trace: Trace) -> dict[str, Any]:
    """An option-slowdown's verdict for its minimized trace: the request named is one with the
    option, and the other requests' median ITL (or e2e: the verdict's ``compared``) with and without it
    are those of the stored runs of the minimized trace and of its ablation (the minimizer stores both),
    when there are some."""
    option = verdict.get("ablated")
    if option not in OPTIONS:
        return verdict
    mine = carriers(trace, option)
    if mine and verdict.get("request_id") not in mine:
        verdict["request_id"] = mine[0]

    def medians(t: Trace) -> list[float]:
        ids = store.execution_ids(trace_hash=t.content_hash())[-MAX_EXECUTIONS_EXAMINED:]
        values = [others_value(verdict.get("compared") or "e2e", trace, store.get_execution(i), option) for i in ids]
        return [v for v in values if v is not None]

    with_s, without_s = medians(trace), medians(without_option(trace, option))
    if with_s and without_s:
        observed, expected = statistics.median(with_s), statistics.median(without_s)
        verdict.update(observed_s=observed, expected_s=expected, idle_s=expected, excess_s=observed - expected,
                       slowdown=observed / expected if expected else None)
    return verdict


def _calibration(store: Store, target: Mapping[str, Any] | None) -> Calibration | None:
    if not target:
        return None
    stored = store.latest_calibration(*calibration_keys(str(target.get("url") or ""), target.get("model")))
    if stored is None:
        return None
    try:
        return Calibration.from_dict(stored)
    except FuzzError:
        return None


def _pick_execution(
    store: Store, trace: Trace, verdict: Mapping[str, Any], criterion: Criterion
) -> tuple[int | None, ExecutionResult | None]:
    """The newest stored execution that shows the finding (else the newest one), for the timeline."""
    ids = store.execution_ids(trace_hash=trace.content_hash())[-MAX_EXECUTIONS_EXAMINED:]
    if not ids:
        return None, None
    measure = _METRIC_OF.get(str(verdict.get("metric")))
    victim = verdict.get("request_id")
    limit = criterion.threshold_s
    for execution_id in reversed(ids):
        result = store.get_execution(execution_id)
        if measure is None or victim is None or limit is None:
            return execution_id, result
        shown = [measure(r) for r in result.requests if r.request_id == victim]
        if shown and shown[0] is not None and shown[0] >= limit:
            return execution_id, result
    return ids[-1], store.get_execution(ids[-1])


def _timeline(folder: Path, execution: ExecutionResult | None, execution_id: int | None,
              verdict: Mapping[str, Any]) -> str:
    """Draw timeline.png; the Markdown that shows it, or says why there is none."""
    (folder / "timeline.png").unlink(missing_ok=True)  # never leave a picture of an earlier export
    if execution is None:
        return "_No execution of this trace is stored, so there is no timeline; run `repro.py` to measure one._"
    if not timeline.available():
        return "_timeline.png was not drawn: matplotlib is not installed (`pip install 'fuzzer[plot]'`)._"
    title = f"execution {execution_id}: one bar per request"
    timeline.write(folder / "timeline.png", execution, victim=verdict.get("request_id"), title=title)
    outlined = (f"the request with `{verdict['ablated']}` is outlined in red (the others are the ones it slows)"
                if verdict.get("ablated") else "the victim is outlined in red")
    return (f"![timeline of execution {execution_id}](timeline.png)\n\n"
            "One bar per request on the client's clock: waiting (queued + prefill, send to first token), "
            f"decode (first token to end); ticks mark the scheduled send; {outlined}.")


def _folder(path: Path) -> Path:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f"cannot create output folder {path}: {e.strerror or e}") from None
    return path


def _write(path: Path, text: str, *, mode: int | None = None) -> None:
    try:
        path.write_text(text)
        if mode is not None:
            path.chmod(mode)
    except OSError as e:
        raise OutputError(f"cannot write {path}: {e.strerror or e}") from None
