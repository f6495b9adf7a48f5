"""Every parameter of the simulated server in one frozen value (ARCHITECTURE.md, "Simulator").

The defaults describe Qwen2.5-0.5B served by vLLM v1 on one datacenter GPU
(ARCHITECTURE.md, "Engines"): a decode step of ~3.5-5 ms, ~30 µs per prefill token,
so a 2048-token prompt prefills in ~65 ms. The KV cache is deliberately small
(2560 blocks of 16 tokens = 40960 tokens): a burst of ~20 prompts of 2048 tokens
fills it, so the fuzzer can reach KV pressure and preemption with short traces.

All times are simulated seconds *before* ``speed`` is applied: the engine divides
every duration by ``speed`` (``--speed 10`` runs ten times faster than real).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from fuzzer.errors import ConfigError


@dataclass(frozen=True)
class SimConfig:
    """Engine, step-time and pathology parameters of the simulator."""

    # --- identity ---------------------------------------------------------------------
    model_name: str = "sim-qwen2.5-0.5b"
    #: Longest prompt + completion a request may ask for (vLLM's --max-model-len).
    max_model_len: int = 32768

    # --- scheduler (vLLM v1 defaults of the API server on a <70 GiB GPU) --------------
    #: Tokens one engine step may process (vLLM --max-num-batched-tokens).
    max_num_batched_tokens: int = 2048
    #: Running requests at most (vLLM --max-num-seqs).
    max_num_seqs: int = 256
    block_size: int = 16
    #: KV cache capacity in blocks: 2560 x 16 = 40960 tokens, ~20 prompts of 2048 tokens.
    num_kv_blocks: int = 2560
    #: Blocks kept free when admitting a request, per running request: each running
    #: decode may need one new block per step, so admission leaves that headroom and a
    #: preempted request is not re-admitted only to be preempted again (vLLM's watermark).
    admission_headroom_blocks_per_seq: int = 1
    #: A request computes at most this many prompt tokens in a step while other requests are
    #: running or waiting (vLLM v1's --long-prefill-token-threshold; 0: no cap, vLLM's default).
    long_prefill_token_threshold: int = 0
    #: With the cap: at most this many prompts longer than it in partial prefill at a time, a
    #: waiting one beyond that passed over by shorter ones (vLLM v0's --max-long-partial-prefills;
    #: 0: no limit). Both are legitimate policies, not pathologies: nothing is tagged.
    max_long_partial_prefills: int = 0

    # --- step time: overhead + prefill tokens + decode sequences + context tokens -------
    #: Fixed cost of one step (scheduling, launch, sampling): the decode floor.
    step_overhead_s: float = 0.0035
    #: Per prompt token computed in the step (~30 µs: 2048 tokens in ~61 ms).
    prefill_token_s: float = 30e-6
    #: Per decoding sequence in the step (a batch of 64 adds ~1.3 ms).
    decode_seq_s: float = 20e-6
    #: Per KV token read by the step's decodes (attention; 10 µs per 1k tokens).
    context_token_s: float = 10e-9
    #: Per (sequence x requested logprob) of the step: top-k logprob extraction.
    logprob_s: float = 2e-6
    #: Sigma of the multiplicative lognormal noise of each step (3%: typical GPU jitter).
    noise_sigma: float = 0.03
    #: Client-visible frontend cost of tokenization per prompt token (parallel, fast tokenizer).
    tokenize_token_s: float = 1e-6

    #: Divide every simulated duration by this (``fuzz sim --speed``).
    speed: float = 1.0

    # --- pathology knobs (used only when the pathology is enabled) ---------------------
    #: hol-prefix-burst: requests of one prefix group arriving within this window form a burst.
    hol_burst_window_s: float = 0.25
    #: unchunked-prefill: prompts longer than this are prefilled whole, in a step without decodes.
    unchunked_min_prompt_tokens: int = 1024
    #: logprobs-batch-cost: cost per (batch sequence x n x logprobs) charged to every step.
    logprobs_batch_cost_s: float = 60e-6
    #: preemption-thrash: a preempted request resumes as soon as a chunk this small fits.
    thrash_resume_chunk_tokens: int = 256
    #: cold-start: an idle period at least this long makes the server cold again (vllm#31602: 10 s).
    cold_idle_s: float = 10.0
    #: cold-start: extra time of the first step after an idle period (vllm 37308 run 1: ~0.5 s).
    cold_start_s: float = 0.45
    #: cold-start: the extra time halves on each of this many following steps.
    cold_start_steps: int = 4
    #: serial-tokenizer: per prompt token on the single tokenizer worker (slow path: templates).
    serial_tokenize_token_s: float = 40e-6
    #: lifo-admission: this many waiting requests (never preempted) make admission newest-first.
    lifo_min_waiting: int = 2
    #: longest-prefix-first: above this many waiting requests the queue is served FCFS (SGLang's lpm: 128).
    lpm_max_waiting: int = 128
    #: aborted-blocks-held: the blocks of a request aborted mid-prefill are swept by the first step this long after.
    abort_hold_s: float = 30.0
    #: seeded-sampling-path: per sampled sequence of a step that has a seeded request (temperature > 0)
    #: in it: every row is sampled on its own (a per-row torch.multinomial with its own generator: a
    #: launch and a host sync per row) instead of one batched kernel. 200 µs is ten times
    #: ``decode_seq_s``: 17 short streams' ~3.9 ms decode step becomes ~7.3 ms (~1.9x), near
    #: vllm-omni #6178's ~40% throughput loss and ~2x time to first packet at concurrency >= 16.
    seeded_row_sample_s: float = 200e-6
    #: logprobs-redetokenize: frontend time per (logprob + 1) x output token so far x choice, per streaming
    #: request with logprobs and step: about a microsecond to turn one token id into its string again. One
    #: stream with 20 logprobs outgrows the ~3.5 ms decode step after ~150 tokens, four after ~40.
    redetokenize_token_s: float = 1.1e-6

    def __post_init__(self) -> None:
        positive_ints = (
            "max_model_len", "max_num_batched_tokens", "max_num_seqs", "block_size", "num_kv_blocks",
            "thrash_resume_chunk_tokens", "unchunked_min_prompt_tokens", "lifo_min_waiting",
            "lpm_max_waiting",
        )
        off_at_zero = ("long_prefill_token_threshold", "max_long_partial_prefills")
        for name, least in [*((n, 1) for n in positive_ints), *((n, 0) for n in off_at_zero)]:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ConfigError(f"SimConfig.{name} must be an integer >= {least}, got {value!r}")
        if self.speed <= 0:
            raise ConfigError(f"SimConfig.speed must be > 0 (2 runs twice as fast), got {self.speed!r}")
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name.endswith("_s") and (not isinstance(value, (int, float)) or value < 0):
                raise ConfigError(f"SimConfig.{f.name} must be a number >= 0 (seconds), got {value!r}")
        if self.noise_sigma < 0:
            raise ConfigError(f"SimConfig.noise_sigma must be >= 0, got {self.noise_sigma!r}")
        if self.max_model_len > self.kv_capacity_tokens:
            raise ConfigError(
                f"SimConfig.max_model_len ({self.max_model_len}) must fit the KV cache "
                f"({self.num_kv_blocks} blocks x {self.block_size} = {self.kv_capacity_tokens} tokens)"
            )

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size

    def with_overrides(self, **changes: Any) -> "SimConfig":
        return replace(self, **changes)


def select(spec: str | tuple[str, ...] | list[str] | None, names: tuple[str, ...], noun: str) -> tuple[str, ...]:
    """A selection of ``names`` (a registry's, in its order): ``"all"``, ``"none"`` (or empty), comma-separated
    names, or a tuple or list of names given in code. An unknown name raises :class:`ConfigError` naming
    the valid choices (``noun``: what the names are, "pathology" or "fault")."""
    text = (spec if isinstance(spec, str) else ",".join(spec or ())).strip().lower()
    if text in ("", "none"):
        return ()
    if text == "all":
        return names
    wanted = {part.strip() for part in text.split(",") if part.strip()}
    unknown = sorted(wanted - set(names))
    if unknown:
        raise ConfigError(
            f"unknown {noun} {', '.join(repr(u) for u in unknown)}: choose from {', '.join(names)}, or 'all' or 'none'"
        )
    return tuple(n for n in names if n in wanted)
