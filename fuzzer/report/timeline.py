"""The timeline picture of one execution (``timeline.png`` of ``fuzz export``, ARCHITECTURE.md, "Shrink and report").

One horizontal bar per request, on the execution's clock (seconds from t0): a
thin tick where it was scheduled, then what the client measured from the moment
it was sent: *waiting* (queued + prefill: send to first token) and *decode*
(first token to the end), with a dot per content-bearing event. A non-streaming
request has no first token, so its bar is one *whole request* span. The victim is
drawn in red and labelled. A black-box client cannot split queueing from
prefill; the legend says so rather than pretend.

matplotlib is the optional ``plot`` extra: :func:`available` tells whether it is
installed, and :func:`render` raises :class:`~fuzzer.errors.OutputError` when not.
"""

from __future__ import annotations

import importlib.util
import io
from pathlib import Path

from fuzzer.errors import OutputError
from fuzzer.execution import ExecutionResult, RequestResult

# Inches per request row and the fixed margins around them: readable from 1 to ~60 requests.
_ROW_INCHES = 0.38
_BASE_INCHES = 2.0
_WIDTH_INCHES = 10.0
_DPI = 110
#: Room under the axes for the two-row legend.
_LEGEND_INCHES = 0.55
_COLORS = {"wait": "#f2a541", "decode": "#4a90d9", "whole": "#9aa5b1", "victim": "#d62728"}


def available() -> bool:
    """Whether matplotlib (the ``plot`` extra) is installed."""
    return importlib.util.find_spec("matplotlib") is not None


def render(result: ExecutionResult, *, victim: str | None = None, title: str = "") -> bytes:
    """The PNG bytes of the timeline of ``result``."""
    if not available():
        raise OutputError("timeline.png needs matplotlib: pip install 'fuzzer[plot]'")
    import matplotlib  # noqa: PLC0415 - optional dependency

    matplotlib.use("Agg")
    from matplotlib.figure import Figure  # noqa: PLC0415
    from matplotlib.patches import Patch  # noqa: PLC0415

    requests = sorted(result.requests, key=lambda r: (r.scheduled_s, r.sent_s))
    fig = Figure(figsize=(_WIDTH_INCHES, _BASE_INCHES + _ROW_INCHES * len(requests)), dpi=_DPI)
    ax = fig.add_subplot(1, 1, 1)
    for row, r in enumerate(requests):
        y = len(requests) - 1 - row
        _bar(ax, y, r, is_victim=r.request_id == victim)
    ax.set_yticks(range(len(requests)))
    labels = [r.request_id for r in reversed(requests)]
    ax.set_yticklabels(labels)
    for tick, label in zip(ax.get_yticklabels(), labels):
        if label == victim:
            tick.set_color(_COLORS["victim"])
            tick.set_fontweight("bold")
    ax.set_xlabel("seconds from the start of the execution (client clock)")
    ax.set_ylim(-0.7, len(requests) - 0.3)
    ax.grid(axis="x", alpha=0.3)
    handles = [
        Patch(color=_COLORS["wait"], label="waiting: queued + prefill (send to first token)"),
        Patch(color=_COLORS["decode"], label="decode (first token to end)"),
        Patch(color=_COLORS["whole"], label="non-streaming request (send to answer)"),
    ]
    if victim is not None:
        handles.append(Patch(facecolor="white", edgecolor=_COLORS["victim"], linewidth=2, label=f"victim: {victim}"))
    fig.legend(handles=handles, loc="lower center", ncol=2, fontsize="small", frameon=False)
    if title:
        ax.set_title(title, fontsize="medium")
    height = _BASE_INCHES + _ROW_INCHES * len(requests)
    fig.tight_layout(rect=(0, _LEGEND_INCHES / height, 1, 1))
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


def write(path: str | Path, result: ExecutionResult, *, victim: str | None = None, title: str = "") -> Path:
    """Render and write the timeline; an unwritable path is an OutputError."""
    data = render(result, victim=victim, title=title)
    target = Path(path)
    try:
        target.write_bytes(data)
    except OSError as e:
        raise OutputError(f"cannot write {target}: {e.strerror}") from None
    return target


def _bar(ax, y: float, r: RequestResult, *, is_victim: bool) -> None:
    edge = {"edgecolor": _COLORS["victim"], "linewidth": 2} if is_victim else {"edgecolor": "none"}
    ax.plot([r.scheduled_s, r.scheduled_s], [y - 0.35, y + 0.35], color="black", linewidth=0.8)
    end = r.sent_s + r.e2e_s if r.e2e_s is not None else None
    first = r.sent_s + r.ttft_s if r.ttft_s is not None else None
    if first is not None:
        ax.barh(y, first - r.sent_s, left=r.sent_s, height=0.6, color=_COLORS["wait"], **edge)
        if end is not None and end > first:
            ax.barh(y, end - first, left=first, height=0.6, color=_COLORS["decode"], **edge)
        if r.token_times_s:
            ax.plot([r.sent_s + t for t in r.token_times_s], [y] * len(r.token_times_s), linestyle="none",
                    marker="|", markersize=6, color="white", alpha=0.8)
    elif end is not None:
        ax.barh(y, end - r.sent_s, left=r.sent_s, height=0.6, color=_COLORS["whole"], **edge)
    if r.outcome.failed:
        x = end if end is not None else r.sent_s
        ax.annotate(f" {r.outcome.value}", (x, y), color=_COLORS["victim"], va="center", fontsize="small")
