"""``fuzz report``: one self-contained HTML page about a campaign (ARCHITECTURE.md, "Store and CLI").

:func:`gather` reads what the store holds about the latest campaign (executions,
corpus entries with their features, findings) into a frozen :class:`CampaignData`;
:func:`render_html` turns it into one HTML file: a summary, plots of coverage and
findings over time, executions per minute by purpose and corpus growth (PNG
images inlined as base64, drawn with matplotlib when it is installed), and the
findings table. No external assets: the file opens anywhere, offline.
"""

from __future__ import annotations

import base64
import datetime as dt
import html
import io
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fuzzer import __version__
from fuzzer.report import timeline
from fuzzer.store import Store, StoredFinding

# Bins of the executions-per-minute plot: about this many over the campaign, never under a minute
# (a per-minute rate over a shorter bin is noise).
_RATE_BINS = 40
_MIN_BIN_S = 60.0
_FIG_INCHES = (9.0, 3.2)
_DPI = 100


@dataclass(frozen=True)
class CampaignData:
    """What the report shows, read from the store."""

    campaign: Mapping[str, Any] | None
    #: (started_at, purpose, number) of every execution of the campaign, by id.
    executions: tuple[tuple[float, str, int | None], ...] = ()
    #: Finding id -> start of its first confirmation run (the clock of the executions).
    found_at: Mapping[int, float] = field(default_factory=dict)
    #: (found_at_exec, features) of every corpus entry.
    corpus: tuple[tuple[int, tuple[str, ...]], ...] = ()
    features: int = 0
    findings: tuple[StoredFinding, ...] = ()
    #: Findings of other campaigns or of no campaign in the same database.
    other_findings: int = 0
    purposes: Mapping[str, int] = field(default_factory=dict)
    #: Wall seconds of the campaign by phase (its last checkpoint's ``time_s``).
    time_s: Mapping[str, float] = field(default_factory=dict)


def gather(store: Store) -> CampaignData:
    """The latest campaign of ``store`` and its findings (every finding when there is no campaign)."""
    campaign = store.latest_campaign()
    everything = tuple(store.list_findings())
    if campaign is None:
        return CampaignData(campaign=None, findings=everything)
    cid = campaign["id"]
    rows = store.execution_rows(campaign_id=cid)
    corpus = tuple((int(r["found_at_exec"] or 0), tuple(r["features"])) for r in store.corpus_rows(cid))
    mine = tuple(f for f in everything if f.campaign_id == cid)
    confirmations: dict[str, float] = {}
    for r in rows:
        if r["purpose"] == "confirm":
            confirmations.setdefault(r["trace_hash"], r["started_at"])
    found_at = {f.id: confirmations[f.trace_hash] for f in mine if f.trace_hash in confirmations}
    return CampaignData(
        campaign=campaign,
        executions=tuple((r["started_at"], r["purpose"] or "?", r["number"]) for r in rows),
        corpus=tuple(sorted(corpus)),
        features=store.count_features(cid),
        findings=mine,
        found_at=found_at,
        other_findings=len(everything) - len(mine),
        purposes=store.purposes(campaign_id=cid),
        time_s=dict((campaign["state"].get("stats") or {}).get("time_s") or {}),
    )


# --- series -----------------------------------------------------------------------------------------


def _start(data: CampaignData) -> float:
    """Time zero of the plots: the first execution (executions of a virtual-time campaign carry
    virtual time, so the campaign's wall-clock start is not on their axis)."""
    return min((t for t, _, _ in data.executions), default=0.0)


def _exec_time(data: CampaignData) -> dict[int, float]:
    """Execution number -> minutes since the start (numbers count the campaign's executions)."""
    t0 = _start(data)
    return {n: (t - t0) / 60.0 for t, _, n in data.executions if n is not None}


def coverage_series(data: CampaignData) -> list[tuple[float, int]]:
    """(minutes, features covered so far), one point per corpus entry that added coverage."""
    at = _exec_time(data)
    seen: set[str] = set()
    out = []
    for number, features in data.corpus:
        before = len(seen)
        seen.update(features)
        if len(seen) > before:
            out.append((at.get(number, _nearest(at, number)), len(seen)))
    return out


def corpus_series(data: CampaignData) -> list[tuple[float, int]]:
    at = _exec_time(data)
    return [(at.get(n, _nearest(at, n)), i + 1) for i, (n, _) in enumerate(data.corpus)]


def findings_series(data: CampaignData) -> list[tuple[float, int]]:
    """(minutes, findings so far): a finding is placed at its first confirmation run."""
    t0 = _start(data)
    times = sorted(data.found_at[f.id] for f in data.findings if f.id in data.found_at)
    return [((t - t0) / 60.0, i + 1) for i, t in enumerate(times)]


def rate_series(data: CampaignData) -> tuple[list[float], dict[str, list[float]], float]:
    """(bin starts in minutes, executions per minute by purpose, bin width in minutes)."""
    if not data.executions:
        return [], {}, 1.0
    t0 = _start(data)
    span = max(t for t, _, _ in data.executions) - t0
    width = max(_MIN_BIN_S, span / _RATE_BINS)
    bins = int(span // width) + 1
    counts: dict[str, list[float]] = {}
    for t, purpose, _ in data.executions:
        counts.setdefault(purpose, [0.0] * bins)[min(bins - 1, int((t - t0) // width))] += 1
    per_min = {p: [c * 60.0 / width for c in cs] for p, cs in counts.items()}
    return [i * width / 60.0 for i in range(bins)], per_min, width / 60.0


def _nearest(at: Mapping[int, float], number: int) -> float:
    if not at:
        return 0.0
    return at[min(at, key=lambda n: abs(n - number))]


# --- plots --------------------------------------------------------------------------------------------


def plots(data: CampaignData) -> dict[str, bytes]:
    """PNG bytes of each plot by title; empty when matplotlib is missing or there is nothing to draw."""
    if not timeline.available() or not data.executions:
        return {}
    import matplotlib  # noqa: PLC0415 - optional dependency

    matplotlib.use("Agg")
    from matplotlib.figure import Figure  # noqa: PLC0415

    out: dict[str, bytes] = {}

    def save(fig) -> bytes:
        fig.tight_layout()
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=_DPI)
        return buffer.getvalue()

    fig = Figure(figsize=_FIG_INCHES)
    ax = fig.add_subplot(1, 1, 1)
    cov = coverage_series(data)
    if cov:
        ax.step([0.0] + [t for t, _ in cov], [0] + [n for _, n in cov], where="post", color="#4a90d9")
    ax.set_xlabel("minutes since the campaign started")
    ax.set_ylabel("features covered", color="#4a90d9")
    right = ax.twinx()
    found = findings_series(data)
    right.step([0.0] + [t for t, _ in found], [0] + [n for _, n in found], where="post", color="#d62728")
    right.set_ylabel("findings", color="#d62728")
    right.set_ylim(bottom=0, top=max(1, len(found)) * 1.2)
    out["Coverage and findings over time"] = save(fig)

    fig = Figure(figsize=_FIG_INCHES)
    ax = fig.add_subplot(1, 1, 1)
    starts, per_min, width = rate_series(data)
    bottom = [0.0] * len(starts)
    for purpose in sorted(per_min):
        ax.bar(starts, per_min[purpose], width=width, bottom=bottom, align="edge", label=purpose)
        bottom = [b + v for b, v in zip(bottom, per_min[purpose])]
    ax.set_xlabel("minutes since the campaign started")
    ax.set_ylabel("executions / minute")
    ax.legend(fontsize="small", ncol=min(4, len(per_min)))
    out["Executions per minute, by purpose"] = save(fig)

    spent = [(k, v) for k, v in data.time_s.items() if v > 0]
    if spent:
        fig = Figure(figsize=_FIG_INCHES)
        ax = fig.add_subplot(1, 1, 1)
        total = sum(v for _, v in spent)
        names = [k for k, _ in spent][::-1]
        minutes = [v / 60.0 for _, v in spent][::-1]
        bars = ax.barh(names, minutes, color="#4a90d9")
        for bar, m in zip(bars, minutes):
            ax.annotate(f"{60.0 * m / total:.0%}", (bar.get_width(), bar.get_y() + bar.get_height() / 2),
                        xytext=(3, 0), textcoords="offset points", va="center", fontsize="small")
        ax.set_xlabel("minutes")
        out["Time by phase"] = save(fig)

    fig = Figure(figsize=_FIG_INCHES)
    ax = fig.add_subplot(1, 1, 1)
    growth = corpus_series(data)
    ax.step([0.0] + [t for t, _ in growth], [0] + [n for _, n in growth], where="post", color="#2ca02c")
    ax.set_xlabel("minutes since the campaign started")
    ax.set_ylabel("corpus entries")
    out["Corpus growth"] = save(fig)
    return out


# --- HTML ----------------------------------------------------------------------------------------------


def render_html(data: CampaignData, *, images: Mapping[str, bytes] | None = None, generated_at: float,
                sections: Sequence[str] = ()) -> str:
    """The report page; ``images`` (title -> PNG) are inlined as base64; ``sections`` (HTML) go before the findings."""
    images = plots(data) if images is None else images
    e = html.escape
    c = data.campaign
    parts = [_HEAD.format(title=e(f"Fuzzing campaign {c['id']}" if c else "Fuzzing report"))]
    parts.append(f"<h1>{'Campaign ' + str(c['id']) if c else 'No campaign in this database'}</h1>")
    parts.append(f"<p class=meta>Generated {e(_when(generated_at))} by fuzzer {e(__version__)}.</p>")
    if c:
        parts.append("<h2>Summary</h2>" + _summary(data))
    parts.append("<h2>Plots</h2>")
    if images:
        for name, png in images.items():
            src = "data:image/png;base64," + base64.b64encode(png).decode("ascii")
            parts.append(f"<figure><img alt='{e(name)}' src='{src}'><figcaption>{e(name)}</figcaption></figure>")
    elif not data.executions:
        parts.append("<p>No executions recorded, so nothing to plot.</p>")
    else:
        parts.append("<p>No plots: matplotlib is not installed (<code>pip install 'fuzzer[plot]'</code>).</p>")
    parts.extend(sections)
    parts.append(f"<h2>Findings ({len(data.findings)})</h2>" + _findings(data))
    if data.other_findings:
        parts.append(f"<p>{data.other_findings} more finding(s) in this database belong to other campaigns "
                     "or to none; <code>fuzz findings</code> lists them all.</p>")
    parts.append("</body></html>\n")
    return "\n".join(parts)


def _summary(data: CampaignData) -> str:
    c = data.campaign or {}
    n = len(data.executions)
    span_min = (max((t for t, _, _ in data.executions), default=_start(data)) - _start(data)) / 60.0
    rate = f"{n / span_min:.1f}" if span_min > 0 else "-"
    last_find = max((f.created_at for f in data.findings), default=None)
    rows: Sequence[tuple[str, Any]] = [
        ("target", c.get("target")),
        ("status", c.get("status")),
        ("seed", c.get("seed")),
        ("started", _when(c.get("started_at"))),
        ("last update", _when(c.get("updated_at"))),
        ("executions", f"{n} ({', '.join(f'{k} {v}' for k, v in sorted(data.purposes.items())) or 'none'})"),
        ("executions / minute", rate),
        ("time by phase", ", ".join(f"{k} {v:.0f} s" for k, v in data.time_s.items() if v > 0) or "not recorded"),
        ("corpus entries", len(data.corpus)),
        ("features covered", data.features),
        ("findings", len(data.findings)),
        ("last find", _when(last_find) if last_find is not None else "none"),
    ]
    return _table(("", ""), [(k, v) for k, v in rows], header=False)


def _findings(data: CampaignData) -> str:
    if not data.findings:
        return "<p>No findings.</p>"
    t0 = _start(data)
    kinds = Counter(f.kind for f in data.findings)
    rows = []
    for f in data.findings:
        victim = f.verdict.get("request_id") or ""
        if f.verdict.get("ablated"):  # an option-slowdown: the victims are the others
            victim = f"the others ({f.verdict['ablated']} on {victim})"
        rows.append((
            f.id, f.kind, victim, f.verdict.get("metric") or "",
            "" if f.slowdown is None else f"{f.slowdown:.1f}x", f.reproduced or "", f.requests,
            "yes" if f.minimized else "no",
            f"{(data.found_at[f.id] - t0) / 60.0:.1f}" if f.id in data.found_at else _when(f.created_at),
            f.signature,
        ))
    when = "found (min, or date)"
    head = ("id", "kind", "victim", "metric", "slowdown", "reproduced", "requests", "minimized", when, "signature")
    by_kind = ", ".join(f"{k} {v}" for k, v in sorted(kinds.items()))
    return (f"<p>By kind: {html.escape(by_kind)}. Export one with <code>fuzz export ID</code>.</p>"
            + _table(head, rows))


def _table(head: Sequence[str], rows: Sequence[Sequence[Any]], *, header: bool = True) -> str:
    e = html.escape
    out = ["<table>"]
    if header:
        out.append("<tr>" + "".join(f"<th>{e(str(h))}</th>" for h in head) + "</tr>")
    for row in rows:
        out.append("<tr>" + "".join(f"<td>{e('' if v is None else str(v))}</td>" for v in row) + "</tr>")
    out.append("</table>")
    return "\n".join(out)


def _when(epoch: float | None) -> str:
    if epoch is None:
        return "-"
    return dt.datetime.fromtimestamp(epoch, tz=dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


_HEAD = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em auto; max-width: 72em; padding: 0 1em; color: #222; }}
table {{ border-collapse: collapse; margin: 0.5em 0 1.5em; }}
th, td {{ border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; font-size: 0.92em; }}
th {{ background: #f3f3f3; }}
figure {{ margin: 1em 0; }} img {{ max-width: 100%; }}
figcaption, .meta {{ color: #666; font-size: 0.9em; }}
code {{ background: #f3f3f3; padding: 0 0.2em; }}
</style></head><body>"""
