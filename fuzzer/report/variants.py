"""The report's "Configurations" section: the finding on each configuration of the server.

Rows come from ``fuzz export --launch CMD --variant NAME="ARGS"`` (each configuration started
fresh, calibrated and run); for vLLM without variants the section suggests its documented
mitigation knobs instead.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

HEADING = "## Configurations"


def section(rows: Sequence[Mapping[str, str]], *, runs: int, command: str) -> str:
    """configuration -> reproduced k/n, effect, as a markdown table."""
    lines = [HEADING, "", f"The trace on `{command}` (base) and on each variant (its extra arguments), each "
             f"server started fresh and calibrated, {runs} runs each:", "",
             "| configuration | extra args | reproduced | effect |", "|---|---|---|---|"]
    for r in rows:
        args = f"`{r['args']}`" if r["args"] else "-"
        lines.append(f"| {r['configuration']} | {args} | {r['reproduced']} | {_cell(r['effect'])} |")
    return "\n".join(lines) + "\n"


def suggestion(finding_id: int, suggested: Mapping[str, str]) -> str:
    """The mitigation knobs worth a run, as the export command that runs them."""
    flags = " ".join(f'--variant {name}="{args}"' for name, args in suggested.items())
    return (f"{HEADING}\n\nNot run. vLLM documents scheduler knobs that may mitigate this; to see whether it "
            f"survives them:\n\n    fuzz export {finding_id} --launch \"vllm serve ... --port {{port}}\" {flags}\n")


def append(report: Path, text: str) -> None:
    with open(report, "a", encoding="utf-8") as f:
        f.write("\n" + text)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")
