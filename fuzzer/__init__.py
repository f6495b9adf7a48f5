"""A coverage-guided serving-latency fuzzer for OpenAI-compatible LLM inference servers."""

from fuzzer.errors import (
    ConfigError,
    FuzzError,
    NotFoundError,
    OutputError,
    StoreError,
    TargetError,
    TraceError,
)
from fuzzer.execution import (
    ExecutionResult,
    MetricSample,
    Outcome,
    RequestResult,
    Target,
)
from fuzzer.trace import FORMAT_VERSION, Request, Trace

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "FORMAT_VERSION",
    "ExecutionResult",
    "FuzzError",
    "MetricSample",
    "NotFoundError",
    "Outcome",
    "OutputError",
    "Request",
    "RequestResult",
    "StoreError",
    "Target",
    "TargetError",
    "Trace",
    "TraceError",
    "__version__",
]
