"""Part 1 of the generated repro.py: tunables, HTTP helpers, exact-length prompts.

Not imported by the fuzzer at run time: :mod:`fuzzer.report.repro` copies everything below
the ``repro.py begins`` line into the one-file script (standard library only, 3.9+).
"""

import http.client
import json
import sys
from urllib.parse import urlsplit

# --- repro.py begins ---

# --- tunables ----------------------------------------------------------------------------------

EXIT_NOT_REPRODUCED = 0
EXIT_REPRODUCED = 1
#: git bisect run: "the source code at the current commit cannot be tested".
EXIT_CANNOT_TEST = 125
#: Runs when --runs is not given: a majority of 5 tolerates two noisy runs.
DEFAULT_RUNS = 5
#: No byte from the server for this long is a hang.
DEFAULT_TIMEOUT_S = 60.0
#: Setup calls (models, tokenize, health) answer in milliseconds on a healthy server.
SETUP_TIMEOUT_S = 10.0
#: The first request is due this long after the connections are open and the threads wait.
START_DELAY_S = 0.05
#: Sleep until this close to a send time, then spin: time.sleep overshoots by ~0.1-1 ms.
SPIN_S = 0.002
#: How long the idle barrier waits for running + waiting = 0 before going ahead.
IDLE_BARRIER_S = 30.0
#: Without metrics, pause this long between runs so the previous run's work has drained.
QUIET_S = 0.5
#: How often the idle barrier and the leak check read /metrics.
POLL_S = 0.05
#: The fit asks /tokenize at most this many times per prompt.
MAX_FIT_ROUNDS = 6
#: Extra words drawn beyond the target, for words that tokenize shorter than one token.
SPARE_WORDS = 32
#: Sizes (in words) of the two texts that estimate tokens per word.
PROBE_WORDS = (16, 64)
#: A request still streaming after this long is cut off as a timeout.
TOTAL_TIMEOUT_S = 600.0

# Running/waiting gauges by engine (vLLM, SGLang, llama.cpp, TGI).
RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs", "llamacpp:requests_processing",
           "tgi_batch_current_size")
WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs", "llamacpp:requests_deferred", "tgi_queue_size")
# vLLM's KV cache usage (0-1), brought up to date once its last request is freed (a leak check reads it).
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
LATENCY_KINDS = ("ttft-outlier", "itl-stall", "e2e-outlier", "cold-start")
FAILURE_OUTCOMES = {
    "error": ("http-error", "connection-error"),
    "hang": ("timeout",),
    "protocol": ("malformed", "missing-done", "token-mismatch"),
}
METRIC_NAMES = {"ttft": "TTFT", "max_itl": "max ITL", "e2e": "E2E"}
#: One request's sampling option slows the others: judged against the trace without it.
OPTION_KIND = "option-slowdown"
#: An option-slowdown needs this many completed requests without the option in a run.
MIN_OTHERS = 3


class CannotTest(Exception):
    """The server cannot be used to test this commit (exit 125)."""


def say(line=""):
    """The script's output: one line on stdout, flushed so a bisect log shows progress."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


# --- HTTP -----------------------------------------------------------------------------------------


class Server:
    """A base URL and its headers; small JSON calls for setup and checks."""

    def __init__(self, base_url, api_key, timeout_s):
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise CannotTest("--base-url must look like http://HOST:PORT, got %r" % base_url)
        self.base_url = base_url.rstrip("/")
        self.https = parts.scheme == "https"
        self.host = parts.hostname
        self.port = parts.port or (443 if self.https else 80)
        self.root = parts.path.rstrip("/")
        self.timeout_s = timeout_s
        #: The KV cache usage before the run a leak check judges (set after the idle barrier).
        self.kv_before = None
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = "Bearer " + api_key

    def connection(self, timeout_s=None):
        cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
        return cls(self.host, self.port, timeout=timeout_s or self.timeout_s)

    def call(self, method, path, body=None, timeout_s=SETUP_TIMEOUT_S):
        """(status, body bytes); raises OSError / http.client.HTTPException when there is no answer."""
        conn = self.connection(timeout_s)
        try:
            data = None if body is None else json.dumps(body).encode()
            conn.request(method, self.root + path, body=data, headers=self.headers)
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def json(self, method, path, body=None, timeout_s=SETUP_TIMEOUT_S):
        """The decoded JSON answer of a 2xx call, else None."""
        try:
            status, raw = self.call(method, path, body, timeout_s)
        except (OSError, http.client.HTTPException):
            return None
        if not 200 <= status < 300:
            return None
        try:
            return json.loads(raw)
        except ValueError:
            return None

    def busy(self):
        """running + waiting from /metrics, or None when the server does not export them."""
        return self.load()[0]

    def load(self):
        """(running + waiting, the KV cache usage 0-1 as the mean over engines) from one /metrics page; each None
        when the server does not export it."""
        values = self.gauges(RUNNING + WAITING + KV_USAGE)
        queued = [v for name, v in values if name not in KV_USAGE]
        kv = [v for name, v in values if name in KV_USAGE]
        return (sum(queued) if queued else None), (sum(kv) / len(kv) if kv else None)

    def gauges(self, names):
        """(name, value) of the /metrics lines named one of ``names`` (none when /metrics does not answer)."""
        try:
            status, raw = self.call("GET", "/metrics")
        except (OSError, http.client.HTTPException):
            return []
        if status != 200:
            return []
        values = []
        for line in raw.decode("utf-8", "replace").splitlines():
            if not line or line.startswith("#"):
                continue
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in names:
                try:
                    values.append((name, float(line.rsplit(" ", 1)[1])))
                except (IndexError, ValueError):
                    continue
        return values


def check_server(server, model):
    """The model to request. Raises CannotTest when the server or the model is not there."""
    try:
        status, raw = server.call("GET", "/v1/models")
    except (OSError, http.client.HTTPException) as e:
        raise CannotTest("server unreachable at %s (%s)" % (server.base_url, e.__class__.__name__))
    if status in (401, 403):
        raise CannotTest("the server refused the API key (HTTP %d); pass --api-key or set OPENAI_API_KEY" % status)
    served = []
    if status == 200:
        try:
            served = [m.get("id") for m in json.loads(raw).get("data", []) if isinstance(m, dict)]
        except (ValueError, AttributeError):
            served = []
    if model:
        if served and model not in served:
            raise CannotTest("model %r is not served here (served: %s)" % (model, ", ".join(map(str, served))))
        return model
    if not served:
        raise CannotTest("GET /v1/models lists no model (HTTP %d); pass --model" % status)
    return served[0]


# --- prompts (the fuzzer's construction: common words, fitted with the server's tokenizer) ------


class Counter:
    """Counts prompt tokens with the server's /tokenize, or one token per word when there is none."""

    def __init__(self, server, model, preferred, words):
        self.server = server
        self.model = model
        self.dialect = None
        order = ["openai", "llamacpp", "tgi"]
        if preferred in order:
            order.remove(preferred)
            order.insert(0, preferred)
        probe = " ".join(words[:8])
        for dialect in order:
            n = self._ask(dialect, probe, False)
            if n is not None and n > 0:
                self.dialect = dialect
                break

    @property
    def exact(self):
        return self.dialect is not None

    def _ask(self, dialect, text, chat):
        if dialect == "openai":
            body = {"messages": [{"role": "user", "content": text}], "add_generation_prompt": True} if chat \
                else {"prompt": text}
            if self.model:
                body["model"] = self.model
        elif dialect == "llamacpp":
            body = {"content": text, "add_special": True}
        else:
            body = {"inputs": text}
        answer = self.server.json("POST", "/tokenize", body)
        if isinstance(answer, dict) and isinstance(answer.get("count"), int):
            return answer["count"]
        if isinstance(answer, dict) and isinstance(answer.get("tokens"), list):
            return len(answer["tokens"])
        if isinstance(answer, list):
            return len(answer)
        return None

    def count(self, text, chat=False):
        if self.dialect is None:
            return len(text.split())
        n = self._ask(self.dialect, text, chat and self.dialect == "openai")
        if n is None:
            raise CannotTest("POST /tokenize stopped answering")
        return n


def draw_words(rng, n, words):
    return [words[rng.randrange(len(words))] for _ in range(max(0, n))]


class Fitter:
    """How many words of a list make a text of exactly the target token count."""

    def __init__(self, counter, rng, words):
        self.counter = counter
        self.per_word, self.overhead = 1.0, 0.0
        small, large = draw_words(rng, PROBE_WORDS[0], words), draw_words(rng, PROBE_WORDS[1], words)
        if counter.exact:
            c_small = counter.count(" ".join(small))
            c_large = counter.count(" ".join(large))
            if c_large > c_small:
                self.per_word = (c_large - c_small) / float(len(large) - len(small))
                self.overhead = c_small - self.per_word * len(small)

    def fit(self, head, head_tokens, words, target, chat):
        def text(k):
            tail = " ".join(words[:k])
            return head + " " + tail if head and tail else head or tail

        base = head_tokens if head else self.overhead
        k = round((target - base) / self.per_word)
        best, tried = None, {}
        for _ in range(MAX_FIT_ROUNDS):
            k = min(max(k, 0), len(words))
            if k in tried:
                break
            candidate = text(k)
            c = self.counter.count(candidate, chat)
            tried[k] = c
            if best is None or abs(c - target) < abs(best[1] - target):
                best = (candidate, c)
            if c == target:
                break
            step = (target - c) / self.per_word
            k += int(step) if abs(step) >= 1 else (1 if step > 0 else -1)
        return best


def build_prompts(trace, counter, rng, words):
    """{request id: (text, counted tokens)}; one shared text per prefix group, fresh words every run."""
    prefixes = trace.get("prefixes") or {}
    group_words = {g: draw_words(rng, n + SPARE_WORDS, words) for g, n in sorted(prefixes.items())}
    private = {}
    for r in trace["requests"]:
        own = r["prompt_tokens"] - (prefixes[r["prefix"]] if r.get("prefix") else 0)
        private[r["id"]] = draw_words(rng, own + SPARE_WORDS, words)
    fitter = Fitter(counter, rng, words)
    heads = {}
    for g in sorted({r["prefix"] for r in trace["requests"] if r.get("prefix")}):
        heads[g] = fitter.fit("", 0, group_words[g], prefixes[g], False)
    out = {}
    for r in trace["requests"]:
        chat = r.get("api", "completions") == "chat"
        head, head_tokens = heads[r["prefix"]] if r.get("prefix") else ("", 0)
        if r.get("prefix") and r["prompt_tokens"] == head_tokens and not chat:
            out[r["id"]] = (head, head_tokens)
        else:
            out[r["id"]] = fitter.fit(head, head_tokens, private[r["id"]], r["prompt_tokens"], chat)
    return out


# --- one run -----------------------------------------------------------------------------------------


