"""Hypothesis strategies that produce valid traces.

They serve the tests (round-trips, invariants), and the generator and mutators
draw from the same shapes. Every trace they build passes :func:`fuzzer.trace.validate`.
"""

from __future__ import annotations

from hypothesis import strategies as st

from fuzzer.trace import APIS, MAX_LOGPROBS, Request, Trace

# Small by default: a fuzzing trace of more than a few dozen requests is a load test,
# and shrinking is faster from small examples.
DEFAULT_MAX_REQUESTS = 12
DEFAULT_MAX_PROMPT = 8192
DEFAULT_MAX_OUTPUT = 1024
DEFAULT_MAX_SPAN_MS = 2000.0


@st.composite
def traces(
    draw,
    *,
    min_requests: int = 1,
    max_requests: int = DEFAULT_MAX_REQUESTS,
    max_prompt_tokens: int = DEFAULT_MAX_PROMPT,
    max_output_tokens: int = DEFAULT_MAX_OUTPUT,
    max_span_ms: float = DEFAULT_MAX_SPAN_MS,
    leaving: bool = False,
) -> Trace:
    """A valid trace: prefixes shorter than the prompts that use them, cancels below max_tokens."""
    prefix_names = draw(st.lists(st.sampled_from(["p0", "p1", "p2", "sys"]), max_size=3, unique=True))
    prefixes = {
        name: draw(st.integers(1, max(1, max_prompt_tokens // 2))) for name in prefix_names
    }
    count = draw(st.integers(min_requests, max_requests))
    requests = []
    for i in range(count):
        prefix = draw(st.sampled_from([None, *prefix_names]))
        low = prefixes[prefix] if prefix else 1
        prompt = draw(st.integers(low, max(low, max_prompt_tokens)))
        max_tokens = draw(st.integers(1, max_output_tokens))
        stream = draw(st.booleans())
        cancel = None
        if stream and max_tokens > 1 and draw(st.booleans()):
            cancel = draw(st.integers(1, max_tokens - 1))
        requests.append(
            Request(
                id=f"r{i:02d}",
                at_ms=draw(st.integers(0, int(max_span_ms))) / 1.0,
                prompt_tokens=prompt,
                max_tokens=max_tokens,
                prefix=prefix,
                stream=stream,
                api=draw(st.sampled_from(APIS)),
                ignore_eos=draw(st.booleans()),
                cancel_after_tokens=cancel,
                n=draw(st.sampled_from([1, 1, 1, 2, 4, 8])),
                logprobs=draw(st.sampled_from([None, None, 0, 1, 5, MAX_LOGPROBS])),
                temperature=draw(st.sampled_from([0.0, 0.7, 1.0])),
                # leaving: clients with a timeout and sampling seeds (fields added after format 1).
                disconnect_after_ms=draw(st.sampled_from([None, None, 5.0, 37.5, 500.0])) if leaving else None,
                seed=draw(st.sampled_from([None, None, 0, 42, (1 << 63) - 1])) if leaving else None,
            )
        )
    used = {r.prefix for r in requests if r.prefix}
    return Trace(
        requests=tuple(requests),
        prefixes={k: v for k, v in prefixes.items() if k in used},
        name=draw(st.sampled_from(["", "generated"])),
    )
