"""The ``--goodput`` option (vLLM's SLO syntax) and how ``replay`` and ``report`` show SLO results."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import click

from fuzzer.errors import ConfigError
from fuzzer.execution import ExecutionResult
from fuzzer.oracle.slo import Slo, goodput
from fuzzer.oracle.verdict import Verdict

goodput_option = click.option(
    "--goodput",
    "goodput_specs",
    multiple=True,
    metavar="'ttft:MS tpot:MS e2el:MS'",
    help="SLOs in ms, vLLM's --goodput words (quoted together, or the option repeated): report goodput and "
         "SLO attainment and judge slo-violation findings beside the scheduler ones.",
)


def parse_slo(specs: Sequence[str]) -> Slo | None:
    return Slo.parse(specs)


def slo_json(slo: Slo, results: Sequence[ExecutionResult], verdicts: Sequence[Verdict]) -> dict[str, Any]:
    runs = [goodput(r, slo) for r in results]
    return {
        "slo_ms": dict(slo.items()),
        "runs": runs,
        "attainment": _mean([r["attainment"] for r in runs]),
        "goodput_rps": _mean([r["goodput_rps"] for r in runs]),
        "verdicts": [v.to_dict() for v in verdicts],
        "findings": [v.to_dict() for v in verdicts if v.is_finding],
    }


def slo_lines(slo: Slo, results: Sequence[ExecutionResult], verdicts: Sequence[Verdict]) -> list[str]:
    data = slo_json(slo, results, verdicts)
    att = data["attainment"]
    rate = data["goodput_rps"]
    lines = [f"SLO {slo.describe()} (ms): attainment {'-' if att is None else f'{att:.0%}'}, goodput "
             f"{'-' if rate is None else f'{rate:.2f}'} requests/s, over {len(results)} run(s)"]
    for v in verdicts:
        tag = "FINDING slo-violation" if v.is_finding else f"slo {v.decision}"
        lines.append(f"{tag} on {v.request_id}: {v.detail}, p={v.p_value:.2g}")
    return lines


def _mean(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return sum(kept) / len(kept) if kept else None


def refuse_slo_finding(finding, what: str) -> None:
    """One clear line instead of a half-right result: SLO findings are not minimized or bundled (yet)."""
    if finding.kind == "slo-violation":
        raise ConfigError(f"finding {finding.id} is an slo-violation: {what} is not supported for SLO findings; "
                          f"`fuzz show {finding.id}` and `fuzz export {finding.id} --format mooncake` are")
