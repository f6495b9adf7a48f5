"""The simulator seen through a pathology's ground truth, for tests that ask whether a campaign
found the right thing (the campaign and oracle never read it)."""

from __future__ import annotations

from conftest import CORPUS

from fuzzer import trace as tf
from fuzzer.execution import ExecutionResult
from fuzzer.sim import VirtualTarget
from fuzzer.trace import Trace


class GroundTruth:
    """A VirtualTarget that remembers which requests of which trace ``pathology`` delayed."""

    def __init__(self, target: VirtualTarget, pathology: str):
        self._target = target
        self._pathology = pathology
        self.name = target.name
        self.idle = target.idle
        self.kv_cache = target.kv_cache  # the capacity the oracle's KV-aware bound models
        self.delayed: dict[str, set[str]] = {}

    async def execute(self, trace: Trace, *, cut_s: float | None = None) -> ExecutionResult:
        result = await self._target.execute(trace, cut_s=cut_s)
        hit = {rid for rid, names in result.ground_truth.items() if self._pathology in names}
        self.delayed.setdefault(trace.content_hash(), set()).update(hit)
        return result

    async def aclose(self) -> None:
        return None


def seeds_without(pathology: str, seed: int) -> list[Trace]:
    """The committed corpus minus the traces that trigger ``pathology`` on a warm simulator."""
    probe = VirtualTarget(pathologies=(pathology,), seed=seed)
    probe.run(tf.load(CORPUS / "stream-mix.json"))  # warm
    out = []
    for path in sorted(CORPUS.glob("*.json")):
        trace = tf.load(path)
        if not any(pathology in names for names in probe.run(trace).ground_truth.values()):
            out.append(trace)
    return out
