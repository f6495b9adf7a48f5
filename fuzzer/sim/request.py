"""One request inside the simulated engine, and the ground-truth record it leaves.

:class:`SimRequest` is the engine's mutable bookkeeping (owned and changed by
the engine only; the HTTP front end and the virtual runner read it).
:class:`GroundTruth` is the frozen record of a finished request: server-side
times and the pathologies that delayed it. It is never sent over HTTP.
"""

from __future__ import annotations

import enum
import json
from dataclasses import asdict, dataclass, field
from typing import Any

from fuzzer.sim.pathologies import NAMES


class State(enum.Enum):
    #: In the frontend (tokenizer) queue, not yet seen by the scheduler.
    PENDING = "pending"
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class SimRequest:
    """Engine-side state of one request (compared by identity)."""

    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    n: int
    logprobs: int | None
    #: Tokens per choice this request will generate (max_tokens, or an earlier EOS).
    output_len: int
    arrival_s: float
    ready_s: float
    #: Full-block hashes of the prompt (prefix-cache keys).
    hashes: list[int]
    #: Hash of the first full block: requests sharing it share a prefix (None: shorter than a block).
    group_key: int | None
    state: State = State.PENDING
    num_computed: int = 0
    generated: int = 0
    blocks: list[int] = field(default_factory=list)
    #: How many leading prompt blocks are registered in the prefix cache.
    committed_blocks: int = 0
    cached_tokens: int | None = None
    admitted_s: float | None = None
    #: Order of first admission (FCFS checks); None until admitted.
    admit_seq: int | None = None
    first_token_s: float | None = None
    #: Server time of every generated token (one per step, all choices at once).
    token_times_s: list[float] = field(default_factory=list)
    finish_s: float | None = None
    finish_reason: str | None = None
    preemptions: int = 0
    delayed_by: set[str] = field(default_factory=set)
    #: kv-reserve-admission: blocks reserved at admission for the prompt and all of max_tokens.
    reserved_blocks: int = 0
    #: The pathology (disconnect-leak, early-abort-leak) that lost the abort of a client gone away;
    #: empty while the engine heard of every disconnect.
    leaked: str = ""
    #: The sampling seed the client sent (None: none) and its temperature (0: greedy, no sampling).
    seed: int | None = None
    temperature: float = 0.0
    #: Whether its client reads a stream (logprobs-redetokenize rebuilds each streamed chunk's logprobs).
    stream: bool = False

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        """Tokens of the sequence so far: the prompt and every generated token."""
        return len(self.prompt_ids) + self.generated

    @property
    def decoding(self) -> bool:
        return self.generated > 0 and self.num_tokens - self.num_computed == 1

    @property
    def finished(self) -> bool:
        return self.state is State.FINISHED

    def record(self) -> "GroundTruth":
        return GroundTruth(
            request_id=self.request_id,
            arrival_s=self.arrival_s,
            ready_s=self.ready_s,
            admitted_s=self.admitted_s,
            first_token_s=self.first_token_s,
            finish_s=self.finish_s,
            finish_reason=self.finish_reason,
            prompt_tokens=self.prompt_len,
            cached_tokens=self.cached_tokens or 0,
            completion_tokens=self.generated * self.n,
            preemptions=self.preemptions,
            pathologies=tuple(n for n in NAMES if n in self.delayed_by),
        )


@dataclass(frozen=True)
class GroundTruth:
    """What the server knows about one finished request (server clock, seconds)."""

    request_id: str
    arrival_s: float
    #: When the tokenizer handed it to the scheduler.
    ready_s: float
    admitted_s: float | None
    first_token_s: float | None
    finish_s: float | None
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    preemptions: int
    #: Planted pathologies that delayed this request (registry order).
    pathologies: tuple[str, ...]

    def to_json(self) -> str:
        data: dict[str, Any] = asdict(self)
        data["pathologies"] = list(self.pathologies)
        return json.dumps(data, sort_keys=True)
