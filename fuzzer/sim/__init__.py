"""The built-in simulated LLM server (ARCHITECTURE.md, "Simulator").

A vLLM-v1-like engine (continuous batching, chunked prefill, KV blocks with
prefix caching, recompute preemption) with planted pathologies, served over
HTTP (``fuzzer.sim.server``, ``fuzzer.sim.process``) or run in-process on a
virtual clock (:class:`VirtualTarget`).
"""

from fuzzer.sim.config import SimConfig
from fuzzer.sim.pathologies import NAMES as PATHOLOGIES
from fuzzer.sim.pathologies import PathologyInfo, describe, parse
from fuzzer.sim.request import GroundTruth
from fuzzer.sim.virtual import DEFAULT_IDLE_GAP_S, VirtualTarget

__all__ = [
    "DEFAULT_IDLE_GAP_S",
    "GroundTruth",
    "PATHOLOGIES",
    "PathologyInfo",
    "SimConfig",
    "VirtualTarget",
    "describe",
    "parse",
]
