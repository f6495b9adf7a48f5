"""The ``--goodput`` option (vLLM's SLO syntax) and how ``replay`` and ``report`` show SLO results."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import click

from fuzzer.errors import ConfigError
from fuzzer.execution import ExecutionResult
from fuzzer.oracle.slo import Slo, goodput
from fuzzer.oracle.verdict import Verdict

class _GoodputOption(click.Option):
    """``--goodput ttft:500 tpot:50``, vLLM's spelling: the words after the first that look like
    ``NAME:MS`` belong to the option too (click options take one value each otherwise)."""

    def add_to_parser(self, parser, ctx) -> None:
        super().add_to_parser(parser, ctx)
        for name in self.opts:
            option = getattr(parser, "_long_opt", {}).get(name)  # click's parser; else quoted/repeated only
            if option is None:
                continue
            original = option.process

            def process(value, state, original=original):
                words = [value]
                while state.rargs and _WORD.match(state.rargs[0]):
                    words.append(state.rargs.pop(0))
                original(" ".join(words), state)

            option.process = process


_WORD = re.compile(r"^(ttft|tpot|e2el):")

goodput_option = click.option(
    "--goodput",
    "goodput_specs",
    cls=_GoodputOption,
    multiple=True,
    metavar="'ttft:MS tpot:MS e2el:MS'",
    help="SLOs in ms, vLLM's --goodput words (ttft:MS tpot:MS e2el:MS, any subset): report goodput and "
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
