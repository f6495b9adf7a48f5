"""The registry of planted pathologies (ARCHITECTURE.md, "Simulator").

Each pathology is off unless named. Each is modelled on a public report and
documented below by a class whose docstring says what it models, what triggers
it and what a client sees. The engine (``fuzzer.sim.engine``) implements the
mechanisms; this module only names and describes them and parses ``--pathologies``.

Ground truth: when a pathology changes what happens to a request (delays its
admission, a token, or its tokenization), the engine records the pathology's
name on that request. Tests and benchmarks use it to tell a true finding from a
false one; it is never sent over HTTP.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from fuzzer.sim.config import select

HOL_PREFIX_BURST = "hol-prefix-burst"
UNCHUNKED_PREFILL = "unchunked-prefill"
LOGPROBS_BATCH_COST = "logprobs-batch-cost"
STICKY_BATCH_FULL = "sticky-batch-full"
PREEMPTION_THRASH = "preemption-thrash"
COLD_START = "cold-start"
SERIAL_TOKENIZER = "serial-tokenizer"
KV_RESERVE_ADMISSION = "kv-reserve-admission"
DISCONNECT_LEAK = "disconnect-leak"
LIFO_ADMISSION = "lifo-admission"
DECODE_STARVATION = "decode-starvation"
EARLY_ABORT_LEAK = "early-abort-leak"
RESIDENT_PREFIX_REFUSAL = "resident-prefix-refusal"
SEEDED_SAMPLING_PATH = "seeded-sampling-path"
QUEUED_ABORT_LATE = "queued-abort-late"
HEAD_RESERVE_ADMISSION = "head-reserve-admission"
LOGPROBS_REDETOKENIZE = "logprobs-redetokenize"
LONGEST_PREFIX_FIRST = "longest-prefix-first"
ABORTED_BLOCKS_HELD = "aborted-blocks-held"


@dataclass(frozen=True)
class PathologyInfo:
    """What ``fuzz sim --list`` shows about one pathology."""

    name: str
    summary: str
    models: str
    trigger: str
    effect: str
    #: The finding kind (ARCHITECTURE.md, "Oracle") an oracle should report for it.
    kind: str


class _Pathology:
    name: ClassVar[str]
    models: ClassVar[str]
    trigger: ClassVar[str]
    effect: ClassVar[str]
    kind: ClassVar[str]

    @classmethod
    def info(cls) -> PathologyInfo:
        summary = (cls.__doc__ or "").strip().splitlines()[0]
        return PathologyInfo(cls.name, summary, cls.models, cls.trigger, cls.effect, cls.kind)


class HolPrefixBurst(_Pathology):
    """Longest-first admission inside a shared-prefix burst stalls the short requests of the burst.

    Models vLLM issue 37308 ("Severe head-of-line blocking (147x TTFT) under
    prefix caching with asymmetric batches"), and SGLang's longest-prefix-first
    policy. When several requests of one prefix group wait together, the
    scheduler admits the longest prompt first (to fill the prefix cache with the
    most reusable blocks) and holds every shorter member of the group -- and,
    since admission stops at the first held request, everyone queued behind it --
    until no longer member of the burst is waiting or still in prefill.

    Trigger: short and long requests of one prefix group waiting together.
    """

    name = HOL_PREFIX_BURST
    models = "vLLM #37308 (shared-prefix asymmetric burst, 14-147x TTFT)"
    trigger = "short and long requests of one prefix group waiting together (e.g. arriving during a long prefill step)"
    effect = "short requests of the group get their first token only after every long one has prefilled"
    kind = "ttft-outlier"


class UnchunkedPrefill(_Pathology):
    """Long prompts are prefilled whole, in one step without decodes, stalling every running stream.

    Models vLLM before chunked prefill (PR #10235: "decoding throughput drops to
    zero" while a large prompt prefills), vLLM #8121 and llama.cpp #4216 (a new
    request "freezes" generating slots during prompt processing). A prompt of
    more than ``unchunked_min_prompt_tokens`` ignores the token budget and runs
    in a step of its own; running decodes skip that step.

    Trigger: a long prompt arriving while other requests stream.
    """

    name = UNCHUNKED_PREFILL
    models = "vLLM PR #10235 / #8121, llama.cpp #4216 (prefill freezes decodes)"
    trigger = "a prompt longer than the token budget arriving while other requests stream"
    effect = "inter-token latency spikes of the whole prefill time for every running stream"
    kind = "itl-stall"


class LogprobsBatchCost(_Pathology):
    """One request's n x logprobs sampling cost is charged to every sequence of the batch.

    Models vLLM issue 37343 (one request with n=8, logprobs=20 stalls every
    co-scheduled request 76-423x; fix PR #37594). While a request with n > 1 and
    logprobs is running, every step pays ``logprobs_batch_cost_s`` x batch
    sequences x n x logprobs, instead of the requester's own small cost.

    Trigger: a request with n > 1 and logprobs next to other requests.
    """

    name = LOGPROBS_BATCH_COST
    models = "vLLM #37343 (n=8, logprobs=20 stalls all requests, 76-423x TTFT)"
    trigger = "a request with n > 1 and logprobs running next to other requests"
    effect = "every request's TTFT and inter-token latency grow while it runs"
    kind = "ttft-outlier"


class StickyBatchFull(_Pathology):
    """A sticky "batch full" flag stops admission, although KV is free, until the batch shrinks.

    Models SGLang issue 22831 (fix PR #23152): when a step's token budget runs
    out with requests still waiting, the scheduler sets ``batch_is_full`` and
    stops admitting; the flag is cleared only when a running request finishes.
    Waiting requests sit in the queue with free KV and free budget meanwhile.

    Trigger: a prompt that fills a step's budget while others wait.
    """

    name = STICKY_BATCH_FULL
    models = "SGLang #22831 (sticky batch_is_full, up to 9.5x p99 TTFT)"
    trigger = "a prompt that fills a step's token budget while others wait, next to long-running decodes"
    effect = "waiting requests are admitted only after some running request finishes"
    kind = "ttft-outlier"


class PreemptionThrash(_Pathology):
    """Near KV exhaustion the newest request is preempted and re-admitted over and over.

    Models vLLM RFC #54644 and issue #25538 (generation "dramatically breaks"
    near 91% KV usage; recompute tax up to 79% of tokens). Admission keeps no
    headroom for the running decodes to grow, a preempted request loses its
    cached blocks and resumes as soon as a small chunk
    (``thrash_resume_chunk_tokens``) fits; being the newest running request it
    is the next victim when a decode needs a block, so it ping-pongs between
    waiting and running, recomputing from scratch each time, until some request
    finishes.

    Trigger: running prompts plus outputs that exceed the KV cache.
    """

    name = PREEMPTION_THRASH
    models = "vLLM RFC #54644, #25538 (recompute-preemption thrash near full KV)"
    trigger = "running requests whose prompts plus outputs exceed the KV cache (long outputs, many streams)"
    effect = "many preemptions; the victims' streams stall while they recompute"
    kind = "e2e-outlier"


class ColdStart(_Pathology):
    """The first steps after an idle period are slow (lazy initialization, JIT, clocks ramping up).

    Models vLLM #16858, #31602 and the vLLM 37308 reproduction (run 1 at
    489-1218 ms TTFT, runs 2-3 at 13-57 ms): a step that starts after the
    server was idle for ``cold_idle_s`` or more (or never ran) costs
    ``cold_start_s`` more, and the next ``cold_start_steps`` halve that extra.
    A real finding, but of kind cold-start, never head-of-line.

    Trigger: the first requests after 10 s idle (or after start-up).
    """

    name = COLD_START
    models = "vLLM #16858, #31602, 37308 run 1 (first request after idle is slow)"
    trigger = "the first requests after the server was idle for 10 s or more (or just started)"
    effect = "the first run after an idle period is slow; runs right after it are not"
    kind = "cold-start"


class SerialTokenizer(_Pathology):
    """Prompts are tokenized one at a time by a single slow worker before admission.

    Models vLLM issue 25301 (tokenization on a one-worker thread pool: TTFT grows
    with prompt length under concurrency). Each request waits for every prompt
    ahead of it in the tokenizer queue, at ``serial_tokenize_token_s`` per token.

    Trigger: long prompts queued in the tokenizer ahead of a short one.
    """

    name = SERIAL_TOKENIZER
    models = "vLLM #25301 (single-worker tokenizer queue)"
    trigger = "many long prompts arriving together; a short one behind them waits for all"
    effect = "TTFT grows with the prompt tokens queued ahead, even with the GPU idle"
    kind = "ttft-outlier"


class KvReserveAdmission(_Pathology):
    """Admission reserves KV for the prompt plus all of max_tokens, so long-output requests stall the queue.

    Models engines that hold a request's whole output reservation from admission on:
    kekzl/imp PR #1714 (admission on prompt + max_tokens, held until written: 8 requests
    of max_tokens 1024 answering ~300 tokens went from 517 to 228 tok/s on a 150-block
    pool), PocketLLM PR #135 (worst case charged until the request finishes), and the
    reason TGI caps the preallocated budget at 1024 tokens (``router/src/validation.rs``:
    a user asking for 120k tokens would otherwise take the slots).
    A request is admitted only when its prompt *and* every request's unused reservation
    fit the free blocks; the reservation is not allocated, so ``kv_cache_usage_perc``
    shows only the blocks really written and looks low while the queue waits. A few
    requests with a huge max_tokens (that stop early by EOS, or are still short) block
    everyone behind them until they finish. Ground truth names the waiting requests at
    each admission the reservations refused.

    Trigger: requests whose prompt + max_tokens together exceed the free KV, and a request behind them.
    """

    name = KV_RESERVE_ADMISSION
    models = "kekzl/imp PR #1714, PocketLLM PR #135 (prompt + max_tokens held from admission); TGI's 1024 cap"
    trigger = "a few requests whose prompts plus max_tokens exceed the KV cache, then more requests"
    effect = "queued requests wait for the long-output ones to finish while KV usage looks low"
    kind = "ttft-outlier"


class DisconnectLeak(_Pathology):
    """A client that disconnects mid-stream leaves its request running (KV, a seat, step time) to max_tokens.

    Models vLLM issues #10806 ("Failed to abort requests when killing client process")
    and #54947 ("vLLM did not stop generating tokens" after the client closed the
    connection mid-request), and proxies that drop the abort (maximhq/bifrost #3164:
    cancelled requests ran 2-4 minutes on vLLM). The engine never hears of the
    disconnect: the request decodes on into nothing, and the server does not return to
    idle after the client's last request ended. Ground truth names the leaked request itself
    and every request that shared a step with it or waited while it ran.

    Trigger: a stream cancelled after a few tokens of a large max_tokens.
    """

    name = DISCONNECT_LEAK
    models = "vLLM #10806, #54947; bifrost #3164 (abort on disconnect not propagated)"
    trigger = "a client that disconnects after a few tokens of a request with a large max_tokens"
    effect = "the server stays busy after every client is gone; later requests share a batch and KV with it"
    kind = "leak"


class EarlyAbortLeak(_Pathology):
    """A client that goes away before its request's first output token is never aborted.

    Models vLLM PR #29987 (requests cancelled in a window were not really aborted) and the
    abort leaks of vLLM #46283 / #50425 ("KV cache fills up until no new request can be
    admitted, while /metrics stays alive"): the frontend arms its abort only once the first
    output has arrived, so a client with a TTFT or queue timeout, or one that drops during a
    long prefill, leaves its request to be prefilled and decoded to its length with nobody
    reading. The same disconnect after the first token is aborted correctly. Ground truth
    names the leaked request and every request that shared a step with it or waited meanwhile.

    Trigger: a client that leaves a long prompt with a long output before its first token.
    """

    name = EARLY_ABORT_LEAK
    models = "vLLM PR #29987; vLLM #46283, #50425 (abort lost for a client gone before the first output)"
    trigger = "a client that times out before its first token on a request with a long output"
    effect = "the server stays busy after every client is gone; KV and seats are held from later requests"
    kind = "leak"


class ResidentPrefixRefusal(_Pathology):
    """Admission counts a prompt's prefix-cache hits on blocks running requests hold as new blocks.

    Models sglang #22831 (fixed by PR #23152: admission broke with NO_TOKEN although KV
    tokens were free) and the prefix-cache accounting of vLLM's ``can_allocate`` /
    ``allocate_slots``, in the shared-prefix class of vLLM #37308: the free-block check for a
    waiting request asks for every block of its cached prefix and first chunk, although the
    prefix blocks another running request holds are shared and take no free block. Under KV
    pressure the request is refused, and with FCFS's break everything behind it waits, until
    enough running requests finish; once admitted, it shares the prefix as it should. Ground
    truth names the waiting requests at each admission the naive count refused.

    Trigger: a request sharing a long prefix with a running one while free KV is short of its whole prompt.
    """

    name = RESIDENT_PREFIX_REFUSAL
    models = "sglang #22831 / PR #23152 (admission refused with KV free); vLLM #37308's shared-prefix class"
    trigger = "a request whose long prefix a running request holds, while free KV is short of its whole prompt"
    effect = "the request and those behind it wait for running requests to finish although their new blocks fit"
    kind = "ttft-outlier"


class LifoAdmission(_Pathology):
    """With two or more requests waiting, the newest is admitted first: the queue is served out of order.

    Models vLLM PR #33522 ("Fix FCFS queue ordering for skipped waiting requests"):
    requests the scheduler skipped were put back at the front of the waiting queue, so a
    later request jumped ahead of an earlier one, and under sustained pressure an early
    request "keeps getting pushed back". Here, whenever ``lifo_min_waiting`` or more
    requests that were never preempted wait, admission takes them newest first.

    Trigger: several prompts that wait together behind a step's budget.
    """

    name = LIFO_ADMISSION
    models = "vLLM PR #33522 (skipped waiting requests prepended ahead of earlier ones)"
    trigger = "several requests waiting together (prompts that fill the step budget, arriving within a step)"
    effect = "an earlier request gets its first token after later ones of the same size"
    kind = "ttft-outlier"


class DecodeStarvation(_Pathology):
    """Prefill-first scheduling: while any running request is still in chunked prefill, decodes are skipped.

    Models SGLang issue 32549 ("Decode starved to ~1 batch per 24s under sustained
    chunked-prefill load (strict prefill-first scheduling)": a stream's inter-token gap
    matched the whole duration of two long prefills) and tenstorrent/vllm-tt-plugin #109
    (prefill-first steps: "every running decode stalls for the entire duration of the
    multi-chunk prefill"). Unlike ``unchunked-prefill`` the prompt is chunked to the
    budget; the running streams simply get no token until every chunk is done.

    Trigger: a prompt of several token budgets arriving while others stream.
    """

    name = DECODE_STARVATION
    models = "SGLang #32549, tenstorrent/vllm-tt-plugin #109 (prefill-first steps starve decodes)"
    trigger = "a prompt of two or more token budgets (chunked) arriving while other requests stream"
    effect = "running streams get no token while the chunks prefill: inter-token gaps of the whole prefill"
    kind = "itl-stall"


class SeededSamplingPath(_Pathology):
    """One request's sampling seed puts every sequence of its steps on a slow per-row sampler.

    Models vllm-project/vllm-omni issues 6178 and 4970 (a default ``seed`` keeps every request
    on the per-row sampling path: a per-row ``torch.multinomial`` with its own generator cost
    ~40% throughput and ~2x time to first packet at concurrency >= 16). While a request with a
    ``seed`` and temperature > 0 is in a step, every sequence the step samples (decodes, and
    prompts whose prefill completes) pays ``seeded_row_sample_s`` instead of its share of one
    batched kernel. Without the pathology a seed costs nothing. Ground truth names the step's
    batch and the requests waiting for it.

    Trigger: a seeded request (temperature 1.0) decoding next to 16 short streams.
    """

    name = SEEDED_SAMPLING_PATH
    models = "vllm-omni #6178, #4970 (a seed forces per-row sampling: ~40% throughput, ~2x TTFP)"
    trigger = "one request with a seed and temperature > 0 decoding next to 16 or more other streams"
    effect = "every co-scheduled stream's inter-token latency and e2e roughly double while it runs"
    kind = "option-slowdown"


class QueuedAbortLate(_Pathology):
    """An abort for a request still queued takes effect only when it comes out of the model.

    Models the SGLang abort paths that left an aborted request in its queue: PR #6855 ("fix abort on
    waiting queue": aborting a waiting request must not make SGLang prefill it), PR #6931 (an aborted
    request of the grammar queue "will still run one prefill forward pass") and PR #28236 (aborted
    requests in the prefill waiting queue were never removed). The request stays queued, is admitted
    in its turn, and its whole prompt is computed; only when its first token is sampled is it
    dropped. Aborted long prompts thus take the token budget, KV and step time ahead of live
    requests, and the server returns to idle soon after (no leak). Ground truth names the aborted
    request and every request that shared a step with it or waited while it was computed.

    Trigger: several long prompts whose clients leave while they are queued, then a short request.
    """

    name = QUEUED_ABORT_LATE
    models = "sglang PR #6855, PR #6931, PR #28236 (an aborted request left in the queue is prefilled)"
    trigger = "clients that leave long prompts while they are queued, then a request behind them"
    effect = "the request behind waits for the abandoned prompts' prefill; the server is idle soon after"
    kind = "ttft-outlier"


class HeadReserveAdmission(_Pathology):
    """The head of the queue is admitted only when free KV holds its prompt and all of its max_tokens.

    Models SGLang PR #25126 ("Fix scheduler admission for near-full KV requests": prefill admission
    charged a request's input and max_new_tokens, and "with FCFS scheduling, such a request can block
    the queue") and the question of vllm #27017 (whether vLLM reserves prompt + max_tokens: it does
    not; it allocates a chunk at a time). Unlike ``kv-reserve-admission`` nothing is held after
    admission: only the head's own output, clamped to the cache, must fit the blocks free now. A
    request with a huge max_tokens (a chat request without one asks for the model's length) arriving
    while running requests fill the cache waits, and with FCFS every request behind it too, until
    they finish, although its prompt fits. Ground truth names the waiting requests at each
    admission the check refused.

    Trigger: requests that fill most of the KV cache and decode, then one with a max_tokens near the
    model's length, then short requests.
    """

    name = HEAD_RESERVE_ADMISSION
    models = "sglang PR #25126 (admission charged input + max_new_tokens); vllm #27017"
    trigger = "a request with a max_tokens near the model's length while running requests fill the KV cache"
    effect = "it and every request behind it wait for the running requests to finish although their prompts fit"
    kind = "ttft-outlier"


class LogprobsRedetokenize(_Pathology):
    """Streams with logprobs make the frontend re-detokenize each one's whole output at every step.

    Models SGLang PR #10805 ("all logprobs_val will be detokenized at the end of each decoding round. When
    the sequence length is long, it will cause excessive CPU load ... will block the processing of other
    parallel requests"), vLLM #1099 (incremental detokenization re-converting every earlier output token)
    and vLLM PR #24174 (CPU time between steps that grows with the output length). The single API-server
    process handles each step's outputs in turn before any reaches its client; per streaming request with
    logprobs it spends ``redetokenize_token_s`` x (logprobs + 1) x its output so far, per choice. Once that
    outgrows an engine step, delivery falls behind the engine for every stream, plain ones too, and the lag
    grows while those streams decode; the engine's own metrics look normal. Ground truth names every request
    whose tokens reached it later than the step that made them by more than ``REDETOKENIZE_MIN_LAG_S``.

    Trigger: a few streams with logprobs that run to hundreds of tokens, and other streams beside them.
    """

    name = LOGPROBS_REDETOKENIZE
    models = "sglang PR #10805; vllm #1099, PR #24174 (per-step logprobs detokenization of the whole output)"
    trigger = "streams asking for logprobs that run to hundreds of tokens, next to other streams"
    effect = "every stream's tokens arrive later and later behind the engine while those streams decode"
    kind = "ttft-outlier"


class LongestPrefixFirst(_Pathology):
    """The waiting queue is sorted by cached prefix, longest first, with no regard to arrival.

    Models SGLang #31954 and PRs #31723, #33210: its ``lpm`` policy sorts the waiting queue purely by
    matched-prefix length, "a cold request (zero prefix match) is re-displaced by every cache-hot arrival,
    and its wait is unbounded as long as hot traffic keeps arriving" (a 20-60 s TTFT tail of cache-miss
    requests); only a queue longer than 128 falls back to FCFS. On an engine that documents FCFS, as this
    one does, that order is a bug. Here, whenever two to 128 requests that were never preempted wait, they
    are taken by the prefix-cache blocks they would hit, most first (stable); the requests a later one
    overtakes are tagged when it is admitted.

    Trigger: a long shared prefix in the cache, then its members, with tails of their own that fill the
    step budget, arriving faster than a step admits them, and a cold prompt sent among the first of them.
    """

    name = LONGEST_PREFIX_FIRST
    models = "sglang #31954, PR #31723, PR #33210 (lpm sorts by matched prefix: cache-cold requests starve)"
    trigger = "cache-cold prompts waiting among later requests whose long prefix is cached"
    effect = "the cold prompts get their first tokens after every warm request sent after them"
    kind = "ttft-outlier"


class AbortedBlocksHeld(_Pathology):
    """A request aborted while its prompt is being computed keeps its KV blocks after it is gone.

    Models vllm-ascend #16662 (a request aborted during its KV load "permanently leaks that request's KV
    blocks ... the KV cache fills up until no new request can be admitted, while the process and /metrics
    endpoint stay alive"), vLLM #46283 (blocks of an aborted load never reclaimed) and vLLM #26400 / PR
    #29987 (requests cancelled during a forward pass keep their blocks pinned until a fall-back timeout).
    The request leaves the queues at once (nothing runs or waits), but its blocks stay referenced until the
    first step that starts ``abort_hold_s`` after the abort: an idle server reports KV in use with nothing
    running, and requests that need those blocks wait or are refused. Ground truth names the aborted
    request and every request whose admission the held blocks refused.

    Trigger: long prompts whose clients leave while they are being computed.
    """

    name = ABORTED_BLOCKS_HELD
    models = "vllm-ascend #16662; vllm #46283, #26400 / PR #29987 (KV blocks of an aborted request left held)"
    trigger = "clients that leave long prompts while they are being computed"
    effect = "the server reports KV in use with nothing running long after; requests needing those blocks wait"
    kind = "leak"


_REGISTRY: tuple[type[_Pathology], ...] = (
    HolPrefixBurst,
    UnchunkedPrefill,
    LogprobsBatchCost,
    StickyBatchFull,
    PreemptionThrash,
    ColdStart,
    SerialTokenizer,
    KvReserveAdmission,
    DisconnectLeak,
    LifoAdmission,
    DecodeStarvation,
    EarlyAbortLeak,
    ResidentPrefixRefusal,
    SeededSamplingPath,
    QueuedAbortLate,
    HeadReserveAdmission,
    LogprobsRedetokenize,
    LongestPrefixFirst,
    AbortedBlocksHeld,
)

#: Every pathology name, in the order ``--list`` shows them.
NAMES: tuple[str, ...] = tuple(p.name for p in _REGISTRY)


def describe() -> tuple[PathologyInfo, ...]:
    """What each pathology models, what triggers it and what a client sees."""
    return tuple(p.info() for p in _REGISTRY)


def parse(spec: str | None) -> tuple[str, ...]:
    """``"all"``, ``"none"`` (or empty) or comma-separated names -> names in registry order.

    Raises :class:`ConfigError` naming the valid choices for an unknown name.
    """
    return select(spec, NAMES, "pathology")


def validate(names: tuple[str, ...] | list[str] | str) -> tuple[str, ...]:
    """Normalize a pathology selection given in code (a tuple of names or a spec string)."""
    return select(names, NAMES, "pathology")
