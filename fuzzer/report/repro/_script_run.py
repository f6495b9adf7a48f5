"""Part 2 of the generated repro.py: one execution of the trace (threads + http.client, SSE by hand).

Everything below the ``repro.py begins`` line is copied into the script.
"""

import http.client
import json
import socket
import statistics
import threading
import time

from fuzzer.report.repro._script_net import (
    MIN_OTHERS,
    POLL_S,
    QUIET_S,
    SPIN_S,
    START_DELAY_S,
    TOTAL_TIMEOUT_S,
    build_prompts,
)

# --- repro.py begins ---

def request_body(r, text, model, features):
    body = {"max_tokens": r["max_tokens"], "temperature": r.get("temperature", 0.0), "stream": r.get("stream", True)}
    if model:
        body["model"] = model
    if r.get("api", "completions") == "chat":
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": text}]
        if r.get("logprobs") is not None:
            body["logprobs"] = True
            body["top_logprobs"] = r["logprobs"]
    else:
        path = "/v1/completions"
        body["prompt"] = text
        if r.get("logprobs") is not None:
            body["logprobs"] = r["logprobs"]
    if r.get("n", 1) != 1:
        body["n"] = r["n"]
    if r.get("seed") is not None:
        body["seed"] = r["seed"]
    if r.get("ignore_eos", True) and features.get("ignore_eos", True):
        body["ignore_eos"] = True
    if body["stream"] and features.get("stream_options", True):
        body["stream_options"] = {"include_usage": True}
    return path, json.dumps(body).encode()


def has_text(choice):
    if isinstance(choice.get("text"), str) and choice["text"]:
        return True
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return any(isinstance(delta.get(k), str) and delta[k] for k in ("content", "reasoning_content", "reasoning"))
    return False


class Stream:
    """An SSE stream read line by line: first token, every token of choice 0, the longest silence of any other
    choice (n > 1), usage, [DONE], faults."""

    def __init__(self):
        self.data = []
        self.ttft = None
        self.token_times = []
        self.choice_gap = None
        self.choice_last = {}
        self.usage = None
        self.done = False
        self.fault = None

    def line(self, raw, now):
        """Feed one line (without its newline); returns False once nothing more matters."""
        if raw == b"":
            return self._dispatch(now)
        if raw.startswith(b":"):
            return True
        name, _, value = raw.partition(b":")
        if name == b"data":
            self.data.append(value[1:] if value.startswith(b" ") else value)
        elif name not in (b"event", b"id", b"retry"):
            self.fault = ("malformed", "not an SSE line: %r" % raw[:80])
            return False
        return True

    def _dispatch(self, now):
        if not self.data:
            return True
        payload, self.data = b"\n".join(self.data), []
        if payload.strip() == b"[DONE]":
            self.done = True
            return False
        try:
            event = json.loads(payload)
        except ValueError:
            self.fault = ("malformed", "event is not JSON: %r" % payload[:80])
            return False
        if not isinstance(event, dict):
            self.fault = ("malformed", "event is not a JSON object")
            return False
        if "error" in event or event.get("object") == "error":
            self.fault = ("http-error", "error event in stream: %s" % str(event.get("error", event))[:160])
            return False
        if isinstance(event.get("usage"), dict):
            self.usage = event["usage"]
        for choice in event.get("choices") or []:
            if isinstance(choice, dict) and has_text(choice):
                if self.ttft is None:
                    self.ttft = now
                index = choice.get("index", 0)
                if index == 0:
                    self.token_times.append(now)
                else:
                    gap = now - self.choice_last.get(index, self.ttft)
                    self.choice_gap = gap if self.choice_gap is None else max(self.choice_gap, gap)
                    self.choice_last[index] = now
        return True


def send(server, conn, r, path, body, xid, timeout_s):
    """Send one request on an open connection and read the answer; every failure is an outcome."""
    result = {"id": r["id"], "x_request_id": xid, "outcome": "ok", "status": None, "detail": "",
              "ttft_s": None, "token_times_s": [], "choice_gap_s": None, "e2e_s": None, "usage": None}
    headers = dict(server.headers)
    headers["X-Request-Id"] = xid
    sent = time.perf_counter()
    result["sent_pc"] = sent
    leave, dropped = None, threading.Event()
    if r.get("disconnect_after_ms") is not None:
        # The trace's client goes away after a time, whatever it has received: drop the socket.
        leave = threading.Timer(r["disconnect_after_ms"] / 1000.0, drop, args=(conn, dropped))
        leave.start()
    try:
        conn.request("POST", server.root + path, body=body, headers=headers)
        resp = conn.getresponse()
        result["status"] = resp.status
        if resp.status >= 400:
            raw = resp.read()
            result["outcome"] = "http-error" if resp.status >= 500 else "rejected"
            result["detail"] = raw[:200].decode("utf-8", "replace")
        elif r.get("stream", True):
            read_stream(resp, conn, r, result, sent)
        else:
            raw = resp.read()
            try:
                answer = json.loads(raw)
                result["usage"] = answer.get("usage") if isinstance(answer, dict) else None
            except ValueError:
                result["outcome"], result["detail"] = "malformed", "body is not JSON"
        result["e2e_s"] = time.perf_counter() - sent
    except socket.timeout:  # noqa: UP041 - an alias of TimeoutError only from Python 3.10; the script runs on 3.9
        result["outcome"], result["detail"] = "timeout", "no answer within %g s" % timeout_s
    except (OSError, http.client.HTTPException, ValueError, AttributeError) as e:
        if not dropped.is_set() and isinstance(e, (ValueError, AttributeError)):
            raise  # only http.client reading a socket the disconnect timer closed raises these here
        result["outcome"], result["detail"] = "connection-error", "%s: %s" % (e.__class__.__name__, e)
        result["e2e_s"] = time.perf_counter() - sent
    finally:
        if leave is not None:
            leave.cancel()
        conn.close()
    if dropped.is_set() and result["outcome"] not in ("http-error", "rejected"):
        result["outcome"], result["detail"] = "cancelled", ""  # what was read until then stays
    return result


def drop(conn, dropped):
    """Close a request's socket from another thread: the server sees its client go away."""
    dropped.set()
    sock = conn.sock
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def read_stream(resp, conn, r, result, sent):
    stream = Stream()
    cancel = r.get("cancel_after_tokens")
    while True:
        raw = resp.readline()
        now = time.perf_counter()
        if not raw:
            if not stream.done:
                result["outcome"], result["detail"] = "missing-done", "stream ended without data: [DONE]"
            break
        if not stream.line(raw.rstrip(b"\r\n"), now):
            break
        if cancel is not None and len(stream.token_times) >= cancel:
            result["outcome"] = "cancelled"
            break
        if now - sent > TOTAL_TIMEOUT_S:
            result["outcome"], result["detail"] = "timeout", "still streaming after %g s" % TOTAL_TIMEOUT_S
            break
    if stream.fault is not None:
        result["outcome"], result["detail"] = stream.fault
    result["ttft_s"] = None if stream.ttft is None else stream.ttft - sent
    result["token_times_s"] = [t - sent for t in stream.token_times]
    result["choice_gap_s"] = stream.choice_gap
    result["usage"] = stream.usage


def wait_until(due):
    while True:
        remaining = due - time.perf_counter()
        if remaining <= 0:
            return
        time.sleep(remaining - SPIN_S if remaining > SPIN_S else 0)


def run_once(server, trace, words, model, counter, rng, features, tag, timeout_s):
    """Execute the trace once; a result dict per request, in trace order."""
    prompts = build_prompts(trace, counter, rng, words)
    salt = "%08x" % rng.getrandbits(32)
    plans = []
    for r in trace["requests"]:
        path, body = request_body(r, prompts[r["id"]][0], model, features)
        conn = server.connection(timeout_s)
        try:
            conn.connect()  # TCP setup before t0: it is not server latency
        except OSError:
            pass  # send() reports the failure as the request's outcome
        plans.append((r, path, body, "%s-%s%s" % (r["id"], tag, salt), conn))
    results = [None] * len(plans)
    t0 = time.perf_counter() + START_DELAY_S

    def worker(i, r, path, body, xid, conn):
        wait_until(t0 + r["at_ms"] / 1000.0)
        res = send(server, conn, r, path, body, xid, timeout_s)
        res["ignore_eos_sent"] = b'"ignore_eos"' in body
        res["prompt_tokens_built"] = prompts[r["id"]][1]
        results[i] = res

    threads = [threading.Thread(target=worker, args=(i,) + plan, daemon=True) for i, plan in enumerate(plans)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TOTAL_TIMEOUT_S + timeout_s)
    out = []
    for plan, res in zip(plans, results):
        if res is None:
            res = {"id": plan[0]["id"], "outcome": "timeout", "detail": "the client thread did not finish",
                   "ttft_s": None, "token_times_s": [], "e2e_s": None, "usage": None, "sent_pc": t0, "status": None}
        res["sent_s"] = res.pop("sent_pc") - t0
        done = (res["usage"] or {}).get("completion_tokens")
        want = plan[0]["max_tokens"] * plan[0].get("n", 1)
        # With n > 1 some servers count one choice's tokens (llama-server): either total is whole.
        if (res["outcome"] == "ok" and res.get("ignore_eos_sent") and isinstance(done, int)
                and done not in (want, plan[0]["max_tokens"])):
            res["outcome"] = "token-mismatch"
            res["detail"] = "%d completion tokens with ignore_eos, expected %d" % (done, want)
        out.append(res)
    return out


def idle_barrier(server, idle_s, timeout_s):
    """Wait until the server is idle (running + waiting = 0), then leave it idle for idle_s more.

    Returns running + waiting when the barrier gave up after timeout_s, else None.
    """
    deadline = time.monotonic() + timeout_s
    busy = server.busy()
    if busy is None:
        time.sleep(QUIET_S)  # no metrics: a quiet period instead
    while busy is not None and busy > 0 and time.monotonic() < deadline:
        time.sleep(POLL_S)
        busy = server.busy()
    if idle_s > 0:
        time.sleep(idle_s)
    return busy if busy else None


def without_option(trace, option):
    """The trace with ``option`` removed from every request: an option-slowdown's baseline run."""
    out = dict(trace)
    out["requests"] = [{k: v for k, v in r.items() if k != option} for r in trace["requests"]]
    return out


def carriers(trace, option):
    """Ids of the requests of the trace that set ``option``."""
    return [r["id"] for r in trace["requests"] if r.get(option) is not None]


def others_e2e(trace, results, option):
    """Median E2E of the requests of the (original) trace without ``option`` that completed;
    None with fewer than MIN_OTHERS of them."""
    mine = set(carriers(trace, option))
    values = [res["e2e_s"] for res in results
              if res["id"] not in mine and res["outcome"] == "ok" and res["e2e_s"] is not None]
    return statistics.median(values) if len(values) >= MIN_OTHERS else None


def others_itl(trace, results, option):
    """Median, over the streamed requests of the (original) trace without ``option`` (max_tokens 2 or
    more), of their mean token gap (first token to last); None with fewer than MIN_OTHERS of them."""
    mine = set(carriers(trace, option))
    gapped = {r["id"] for r in trace["requests"]
              if r["id"] not in mine and r.get("stream", True) and r["max_tokens"] >= 2}
    values = [(res["token_times_s"][-1] - res["token_times_s"][0]) / (len(res["token_times_s"]) - 1)
              for res in results if res["id"] in gapped and res["outcome"] in ("ok", "cancelled")
              and len(res["token_times_s"]) >= 2]
    return statistics.median(values) if len(values) >= MIN_OTHERS else None


def others_value(crit, trace, results):
    """The others' statistic the finding compared: their ITL (crit metric "itl") or e2e."""
    measure = others_itl if crit.get("metric") == "itl" else others_e2e
    return measure(trace, results, crit["ablate"])


# --- the criterion --------------------------------------------------------------------------------


