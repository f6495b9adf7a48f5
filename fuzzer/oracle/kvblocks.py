"""The KV blocks of the paper schedule (fuzzer.oracle.paper; ARCHITECTURE.md, "Oracle").

Each running request holds the blocks of the tokens it has computed (each further choice its
own output blocks). A prefix group's full blocks are paid for once, by the running member that
computed (or revived) them; a member admitted while they are resident shares them and needs free
blocks only for the rest of its chunk, as vLLM's and SGLang's block allocators count it. When
the payer leaves, the member sharing the most keeps them. A preempted request shares them again
when it is re-admitted while they are resident (vLLM looks a re-admitted request up in its prefix
cache as a new one, and blocks a running request holds are hits: counted without sharing, a member
preempted once waited on paper for its whole prompt's blocks until the long requests beside it
ended, the held-out server's bug6 inside its bound), but never pays for them.

Blocks nobody holds stay in the prefix cache until they are reused: vLLM's block pool hands out
free blocks oldest-freed first (its free queue is FIFO, a request's blocks going in tail first)
and a reused block loses its cached contents. So a prefix group whose last holder left is hit
again in full only while the blocks handed out since have not reached it: those free when it
left are handed out first, then its own, tail first. On a server its own execution had filled,
a prompt sharing a 7824-token prefix freed 5 s earlier hit 2960 of its tokens (the held-out
vLLM-like server of issue 16, clean): counted as a full hit, its prefill of the rest was a
confirmed false positive.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

import numpy as np

from fuzzer.trace import ceil_div


class Job(Protocol):
    """What the KV bookkeeping reads and writes of a request of the paper schedule (fuzzer.oracle.paper.Job)."""

    group: str | None
    prompt: int
    n: int
    cached: int
    computed: int
    tokens: int
    recompute: int
    admitted: bool
    held: int
    shared: int
    preemptions: int
    churn: int
    preempted_sequences: int

    @property
    def prefilled(self) -> bool: ...


class KVBlocks:
    """The KV blocks of the paper schedule: how many are free, who holds how many."""

    #: Blocks kept free per running request when admitting (each decode may need one next step).
    HEADROOM_PER_SEQ = 1

    def __init__(self, capacity: int, block_size: int, token_budget: int, *, whole_readmission: bool = True,
                 chunk: int = 0) -> None:
        self.free = capacity
        self.block = block_size
        self.budget = token_budget
        #: A preempted request is re-admitted with its whole recompute (an engine with a prefix cache finds
        #: its own blocks there); False: a chunk at a time, as a fresh request (no prefix cache), so that
        #: it is preempted again at the next block a decode needs, as the engine does (see :meth:`preempt`).
        self.whole_readmission = whole_readmission
        #: The most prompt tokens one request computes in a step (a long-prefill cap; 0: the budget).
        self.chunk = chunk
        #: prefix group -> (the running request that pays for its resident blocks, how many).
        self.payer: dict[str, tuple[Job, int]] = {}
        #: prefix group -> its running members that share the payer's blocks.
        self.sharers: dict[str, list[Job]] = {}
        #: Blocks handed out from the free queue so far.
        self.handed_out = 0
        #: prefix group nobody holds -> (its blocks, the free blocks ahead of them when it was freed,
        #: handed_out then).
        self.released: dict[str, tuple[int, int, int]] = {}

    def surviving(self, group: str, hit: int) -> int:
        """Of a prefix ``hit`` (tokens) of ``group``, what is still cached: all while a running request
        holds its blocks; once nobody does, less the tail blocks the free queue has handed out since."""
        freed = self.released.get(group) if group not in self.payer else None
        if freed is None:
            return hit
        blocks, ahead, handed_out = freed
        evicted = min(blocks, max(0, self.handed_out - handed_out - ahead))
        return min(hit, (blocks - evicted) * self.block)

    def resident(self, j: Job, cached: int) -> int:
        """Blocks of ``j``'s prefix hit that a running request holds: they take no free block."""
        paid = self.payer.get(j.group) if j.group is not None and cached > 0 else None
        return min(cached // self.block, paid[1]) if paid is not None else 0

    def admit(self, j: Job, tokens: int) -> None:
        """Let the newly admitted ``j`` hold the blocks of ``tokens``, sharing its resident prefix blocks."""
        shared = self.resident(j, j.cached)
        if shared:
            j.held = j.shared = shared
            self.sharers.setdefault(j.group, []).append(j)
        revived = j.cached // self.block if not shared and j.cached else 0
        self.hold(j, tokens)
        self.handed_out -= min(revived, j.held)  # cached blocks taken back out of the queue evict nothing
        if not shared and j.cached and not j.preemptions:
            self.computed_prefix(j, j.cached)  # a hit on free cached blocks: it revived them, it pays

    def computed_prefix(self, j: Job, tokens: int) -> None:
        """``j`` holds the first ``tokens`` of its prefix group's blocks, paid: later members share them
        (the payer's count grows as it computes more of them: partial hits, fuzzer.oracle.paper)."""
        paid = self.payer.get(j.group) if j.group is not None else None
        if paid is not None and paid[0] is j:
            self.payer[j.group] = (j, max(paid[1], tokens // self.block))
        elif j.group is not None and j.group not in self.payer and not j.shared and not j.preemptions:
            self.payer[j.group] = (j, tokens // self.block)
            self.released.pop(j.group, None)

    def release(self, j: Job) -> None:
        """``j`` leaves (ends or is preempted): its blocks are free but those another member still shares."""
        freed = j.held - j.shared
        # By identity: jobs are dataclasses, and two of them (waves of one request) may compare equal.
        sharers = [s for s in self.sharers.get(j.group, ()) if s is not j] if j.group is not None else []
        if j.group is not None:
            self.sharers[j.group] = sharers
        paid = self.payer.get(j.group)
        if paid is not None and paid[0] is j:
            del self.payer[j.group]
            heir = max(sharers, key=lambda s: s.shared, default=None)
            if heir is not None:  # the member sharing the most blocks keeps them and pays from now on
                sharers[:] = [s for s in sharers if s is not heir]
                freed -= heir.shared
                self.payer[j.group] = (heir, heir.shared)
                heir.shared = 0
            else:  # nobody holds the prefix now: its blocks join the free queue behind those free already
                self.released[j.group] = (paid[1], self.free, self.handed_out)
        self.free += freed
        j.held = j.shared = 0

    def blocks(self, j: Job, tokens: int) -> int:
        """Blocks that hold ``tokens`` of the job's sequence (each further choice its own output)."""
        b = self.block
        out = ceil_div(tokens, b)
        if j.n > 1:
            out += (j.n - 1) * ceil_div(max(0, tokens - j.prompt), b)
        return out

    def hold(self, j: Job, tokens: int) -> None:
        """Let ``j`` hold the blocks of ``tokens`` (it never gives any back before it leaves)."""
        need = self.blocks(j, tokens) - j.held
        if need > 0:
            j.held += need
            self.free -= need
            self.handed_out += need

    def admit_blocks(self, j: Job, cached: int, budget: int, running: int) -> int | None:
        """Blocks the waiting ``j`` would take if admitted now with ``cached`` prompt tokens from the
        prefix cache; None when they do not fit with the headroom.

        A fresh request needs the blocks of its first chunk, less the prefix blocks a running
        request holds (shared, as vLLM's and SGLang's allocators share them); a preempted one
        those of its whole recompute (vLLM finds the head of its own sequence in the prefix cache
        and allocates the rest at once, so it is not re-admitted only to be preempted again).
        """
        need = self.blocks(j, self.admitted_tokens(j, cached, budget)) - self.resident(j, cached)
        return need if need + running * self.HEADROOM_PER_SEQ <= self.free else None

    def admitted_tokens(self, j: Job, cached: int, budget: int) -> int:
        """Tokens whose blocks a job takes when admitted (see :meth:`admit_blocks`)."""
        if j.preemptions and self.whole_readmission:
            return j.prompt + j.recompute
        return cached + min(j.prompt + j.recompute - cached, budget)

    def make_room(self, running: list[Job], waiting: deque[Job], token_budget: int, limit: int) -> dict[int, int]:
        """Give every running request the blocks of this step's work, preempting the newest when short.

        ``limit``: the most prompt tokens one request computes in the step (the long-prefill cap).
        Returns id(job) -> the prefill chunk its blocks cover (decodes are not listed).
        """
        budget = token_budget - sum(j.n for j in running if j.prefilled)
        room: dict[int, int] = {}
        i = 0
        while i < len(running):
            j = running[i]
            if j.prefilled:
                want = j.prompt + j.tokens
            else:
                c = min(j.prompt + j.recompute - j.computed, max(budget, 0), limit)
                budget -= c
                room[id(j)] = c
                want = j.computed + c
            need = self.blocks(j, want) - j.held
            while need > self.free and len(running) > 1:
                victim = running.pop()  # the newest running request
                self.preempt(victim, waiting)
                if victim is j:
                    break
            if i >= len(running):
                break  # j itself was preempted
            self.hold(j, want)
            i += 1
        return room

    def preempt(self, j: Job, waiting: deque[Job]) -> None:
        """Recompute preemption: free the blocks, back to the front of the queue.

        With ``whole_readmission`` this schedule re-admits a preempted request only when its whole
        recompute fits. vLLM v1 (and the simulator) re-admit it a chunk at a time as soon as a chunk
        fits, so a request preempted in its prefill, or in its decode (its prompt and output are
        computed again), may be preempted again at each of its later chunks until the streams beside
        it leave room: ``churn`` counts those, for the thrash check, in chunks of the long-prefill cap
        where there is one (heldout7, clean: streams of 512-token prompts preempted in their decode,
        re-admitted 472 tokens at a time, preempted 38 times where the count without churn was 6). Without
        it the schedule re-admits a chunk at a time itself, and each chunk it computes and loses again
        costs the steps it costs the engine (a server without a prefix cache: the waste of its thrash).
        """
        redo = j.prompt + (j.tokens if j.prefilled else j.recompute)
        churn = max(0, ceil_div(redo, min(self.budget, self.chunk or self.budget)) - 1) if self.whole_readmission else 0
        j.churn += churn
        j.preempted_sequences += (1 + churn) * j.n
        self.release(j)
        j.admitted = False
        j.computed = 0
        j.recompute = j.tokens
        j.preemptions += 1
        waiting.appendleft(j)

    def decode_steps(self, decoding: list[Job], count: int) -> int:
        """How many of ``count`` pure decode steps fit the free blocks (at least 1: step 0 was made room for)."""
        b = self.block
        prompt = np.array([j.prompt for j in decoding], dtype=np.int64)
        tokens = np.array([j.tokens for j in decoding], dtype=np.int64)
        extra = np.array([j.n - 1 for j in decoding], dtype=np.int64)
        held = np.array([j.held for j in decoding], dtype=np.int64)

        def need(s: int) -> int:  # blocks beyond those held that steps 0..s need
            blocks = ceil_div(prompt + tokens + s, b) + extra * ceil_div(tokens + s, b)  # elementwise
            return int(np.maximum(0, blocks - held).sum())

        if count <= 1 or need(count - 1) <= self.free:
            return count
        lo, hi = 0, count - 1  # need(lo) fits, need(hi) does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if need(mid) <= self.free else (lo, mid)
        return hi
