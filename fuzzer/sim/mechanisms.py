"""How the planted pathologies change the engine (``fuzzer.sim.pathologies`` names them).

:class:`Mechanisms` is a mixin of :class:`fuzzer.sim.engine.Engine`: the engine's
scheduler calls these hooks, each of which does nothing unless its pathology is on,
and each records the pathology's name on the requests it delays (ground truth).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterable

from fuzzer.sim import pathologies as P
from fuzzer.sim.request import SimRequest, State

if TYPE_CHECKING:
    from fuzzer.sim.config import SimConfig
    from fuzzer.sim.kv import KVCache


#: logprobs-redetokenize tags a request whose tokens reached it later than their step by more than this (s).
REDETOKENIZE_MIN_LAG_S = 0.002


class Mechanisms:
    """The pathology hooks of the engine (state lives on the engine)."""

    config: "SimConfig"
    pathologies: frozenset[str]
    _waiting: list[SimRequest]
    _running: list[SimRequest]
    _batch_full: bool
    _last_step_end_s: float | None
    _cold_extra_s: list[float]
    #: aborted-blocks-held: (when they are swept, blocks) of requests aborted mid-prefill.
    _held: list[tuple[float, list[int]]]
    #: logprobs-redetokenize: when the frontend has handled every output so far.
    _delivery_free_s: float
    kv: "KVCache"
    #: The engine's: blocks a request needs to hold so many tokens of its sequence.
    _blocks_for: Callable[[SimRequest, int], int]

    def _reservation_refuses(self, req: SimRequest, need: int, required: int) -> bool:
        """kv-reserve-admission: refuse ``req`` unless its whole output and every unused reservation fit too.

        ``need``: the blocks admission needs now (its chunk, headroom); ``required``: the
        blocks of its first chunk. The reservation is not allocated (KV usage does not
        show it); running requests grow into theirs.
        """
        if P.KV_RESERVE_ADMISSION not in self.pathologies:
            return False
        total = self._blocks_for(req, req.prompt_len + req.max_tokens)
        outstanding = sum(max(0, r.reserved_blocks - len(r.blocks)) for r in self._running)
        if need + max(0, total - required) + outstanding <= self.kv.num_free:
            req.reserved_blocks = total
            return False
        self._tag(P.KV_RESERVE_ADMISSION, self._waiting)  # it fits without the reservations
        return True

    def _head_reservation_refuses(self, req: SimRequest, need: int, required: int) -> bool:
        """head-reserve-admission: refuse a new request unless the free blocks also hold all of its max_tokens
        (its whole sequence clamped to the cache, so that it cannot wait forever). Nothing is reserved."""
        if P.HEAD_RESERVE_ADMISSION not in self.pathologies or req.num_computed or req.preemptions:
            return False
        whole = min(self._blocks_for(req, req.prompt_len + req.max_tokens), self.kv.num_blocks)
        if need + max(0, whole - required) <= self.kv.num_free:
            return False
        self._tag(P.HEAD_RESERVE_ADMISSION, self._waiting)  # its first chunk fits
        return True

    def _resident_prefix_refuses(self, required: int, headroom: int) -> bool:
        """resident-prefix-refusal: refuse a request that fits unless its whole cached prefix and first
        chunk (``required`` blocks) would fit as new blocks too, shared prefix blocks included."""
        if P.RESIDENT_PREFIX_REFUSAL not in self.pathologies or required + headroom <= self.kv.num_free:
            return False
        self._tag(P.RESIDENT_PREFIX_REFUSAL, self._waiting)  # it fits counting only the blocks it takes
        return True

    def _newest_first(self) -> None:
        """lifo-admission: enough waiting requests (never preempted) are taken newest first.

        Preempted requests keep their place at the front (by design); the requests that a
        later one overtakes are tagged when it is admitted (the engine's admission loop).
        """
        fresh = [r for r in self._waiting if not r.preemptions]
        if len(fresh) < self.config.lifo_min_waiting:
            return
        resumed = [r for r in self._waiting if r.preemptions]
        self._waiting[:] = resumed + sorted(fresh, key=lambda r: -r.ready_s)

    def _longest_prefix_first(self) -> None:
        """longest-prefix-first: two to ``lpm_max_waiting`` waiting requests (never preempted) are taken
        by the prefix-cache blocks they would hit, most first (stable); preempted ones keep the front."""
        fresh = [r for r in self._waiting if not r.preemptions]
        if not 2 <= len(fresh) <= self.config.lpm_max_waiting:
            return
        block = self.config.block_size
        hits = {id(r): len(self.kv.lookup(r.hashes, (r.num_tokens - 1) // block)) for r in fresh}
        resumed = [r for r in self._waiting if r.preemptions]
        self._waiting[:] = resumed + sorted(fresh, key=lambda r: -hits[id(r)])

    def _hold_blocks(self, req: SimRequest, now_s: float) -> None:
        """aborted-blocks-held: a request aborted mid-prefill leaves its blocks referenced until a later sweep."""
        if P.ABORTED_BLOCKS_HELD not in self.pathologies or req.generated or not req.blocks:
            return
        self._held.append((now_s + self.config.abort_hold_s / self.config.speed, req.blocks))
        req.blocks = []
        req.delayed_by.add(P.ABORTED_BLOCKS_HELD)

    def _sweep_held(self, now_s: float) -> None:
        """aborted-blocks-held: the first step at or after a hold's end releases its blocks."""
        due = [blocks for until, blocks in self._held if until <= now_s]
        if due:
            self._held = [(until, blocks) for until, blocks in self._held if until > now_s]
            for blocks in due:
                self.kv.release(blocks)

    def _tag_held_refusal(self, need: int) -> None:
        """aborted-blocks-held: the waiting requests when an admission that the held blocks would fit is refused."""
        if self._held and need <= self.kv.num_free + sum(len(blocks) for _, blocks in self._held):
            self._tag(P.ABORTED_BLOCKS_HELD, self._waiting)

    def _prefill_first(self) -> bool:
        """decode-starvation: a running request still in prefill takes the step; decodes wait."""
        return P.DECODE_STARVATION in self.pathologies and not all(r.decoding for r in self._running)

    def _leaks_abort(self, req: SimRequest) -> bool:
        """disconnect-leak: the abort never reaches the engine; the request runs on to its length.
        early-abort-leak: the same for a client gone before its request's first output token.
        queued-abort-late: a queued request's abort waits until its prompt is computed."""
        if P.DISCONNECT_LEAK in self.pathologies:
            name = P.DISCONNECT_LEAK
        elif P.EARLY_ABORT_LEAK in self.pathologies and req.generated == 0:
            name = P.EARLY_ABORT_LEAK
        elif P.QUEUED_ABORT_LATE in self.pathologies and req.state in (State.PENDING, State.WAITING):
            name = P.QUEUED_ABORT_LATE  # dropped when its first token is sampled (Engine.complete)
        else:
            return False
        req.leaked = name
        req.delayed_by.add(name)
        return True

    def _tag_leak_company(self, batch: Iterable[SimRequest]) -> None:
        """A leaked request in the batch slows its peers and holds KV from the queue (tagged with its leak)."""
        if not self.pathologies & {P.DISCONNECT_LEAK, P.EARLY_ABORT_LEAK, P.QUEUED_ABORT_LATE}:
            return
        batch = list(batch)
        for name in {r.leaked for r in batch if r.leaked}:
            self._tag(name, batch, self._waiting)


    def _seeded_sampling_extra(self, batch: Iterable[tuple[SimRequest, int]]) -> float:
        """seeded-sampling-path: the extra time of a step with a seeded request (temperature > 0) in it.

        Every sequence the step samples (a decode, or a prompt whose prefill completes) is sampled
        on its own: ``seeded_row_sample_s`` each. The batch and the waiting queue (which waits for
        the slower step) are tagged. 0 with the pathology off: a seed then costs nothing.
        """
        if P.SEEDED_SAMPLING_PATH not in self.pathologies:
            return 0.0
        batch = list(batch)
        if not any(r.seed is not None and r.temperature > 0 for r, _ in batch):
            return 0.0
        rows = sum(r.n for r, tokens in batch if r.num_computed + tokens >= r.num_tokens)
        if not rows:
            return 0.0
        self._tag(P.SEEDED_SAMPLING_PATH, (r for r, _ in batch), self._waiting)
        return rows * self.config.seeded_row_sample_s

    def _delivered_s(self, out: Iterable[SimRequest], end_s: float, ahead: int = 1) -> float:
        """When the tokens a step ending at ``end_s`` gave ``out`` reach their clients: ``end_s``, or with
        logprobs-redetokenize on, after the frontend has handled the earlier steps' outputs and this one's (each
        streaming request with logprobs re-detokenizes its output so far: ``ahead`` tokens past ``generated``)."""
        if P.LOGPROBS_REDETOKENIZE not in self.pathologies:
            return end_s
        out = list(out)
        cfg = self.config
        work = sum((r.logprobs + 1) * r.n * (r.generated + ahead) for r in out if r.stream and r.logprobs)
        delivered = max(end_s, self._delivery_free_s) + work * cfg.redetokenize_token_s / cfg.speed
        self._delivery_free_s = delivered
        if (delivered - end_s) * cfg.speed > REDETOKENIZE_MIN_LAG_S:
            self._tag(P.LOGPROBS_REDETOKENIZE, out)
        return delivered

    def _sticky_blocks(self) -> bool:
        if P.STICKY_BATCH_FULL not in self.pathologies or not self._batch_full:
            return False
        if not self._running:
            self._batch_full = False  # nothing left to shrink: the flag cannot outlive the batch
            return False
        return True

    def _is_unchunked(self, req: SimRequest) -> bool:
        return req.num_tokens > self.config.unchunked_min_prompt_tokens

    def _reorder_bursts(self) -> None:
        """Within each prefix group, waiting members go longest prompt first (stable)."""
        slots: dict[int, list[int]] = {}
        for i, req in enumerate(self._waiting):
            if req.group_key is not None:
                slots.setdefault(req.group_key, []).append(i)
        for positions in slots.values():
            if len(positions) < 2:
                continue
            members = [self._waiting[i] for i in positions]
            ordered = sorted(members, key=lambda r: -r.prompt_len)
            for pos, req in zip(positions, ordered):
                self._waiting[pos] = req
            for old, req in zip(positions, members):
                if positions[ordered.index(req)] > old:
                    req.delayed_by.add(P.HOL_PREFIX_BURST)

    def _held_by_burst(self, req: SimRequest) -> bool:
        """A longer member of the request's burst is still in prefill."""
        if req.group_key is None:
            return False
        window = self.config.hol_burst_window_s / self.config.speed
        return any(
            other.group_key == req.group_key
            and other.prompt_len > req.prompt_len
            and other.first_token_s is None
            and abs(other.arrival_s - req.arrival_s) <= window
            for other in self._running
        )

    def _cold_start_due(self, now_s: float) -> bool:
        last = self._last_step_end_s
        return last is None or (now_s - last) * self.config.speed >= self.config.cold_idle_s

    def _cold_start_extra(self, now_s: float) -> float:
        if P.COLD_START not in self.pathologies:
            return 0.0
        cfg = self.config
        if self._cold_start_due(now_s):
            self._cold_extra_s = [cfg.cold_start_s * 0.5**k for k in range(cfg.cold_start_steps + 1)]
        return self._cold_extra_s.pop(0) if self._cold_extra_s else 0.0

    @staticmethod
    def _tag(name: str, *groups: Iterable[SimRequest]) -> None:
        for group in groups:
            for req in group:
                req.delayed_by.add(name)
