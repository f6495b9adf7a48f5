"""Detection from recorded engine answers, server metadata, adapters, the capability probe."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from loopback import serving
from misbehaving_server import running

from fuzzer.errors import ConfigError, TargetError
from fuzzer.execute import adapters, detection
from fuzzer.execute.detection import Fingerprint
from fuzzer.oracle.calibrate import scheduler_assumption

DATA = Path(__file__).parent / "data" / "servers"
_FILES = {
    "/metrics": "metrics.txt",
    "/v1/models": "v1_models.json",
    "/version": "version.json",
    "/info": "info.json",
    "/props": "props.json",
    "/get_server_info": "get_server_info.json",
}


def recorded(kind: str, *, without: tuple[str, ...] = ()) -> Fingerprint:
    answers = {}
    for path, name in _FILES.items():
        f = DATA / kind / name
        if f.exists() and path not in without:
            answers[path] = (200, f.read_text())
        else:
            answers[path] = (404, '{"detail":"Not Found"}')
    return Fingerprint(answers)


@pytest.mark.parametrize("kind", adapters.KINDS)
def test_each_engine_is_detected_from_its_recorded_answers(kind):
    assert detection.detect(recorded(kind)) == kind


@pytest.mark.parametrize("kind", ["vllm", "sglang", "tgi", "llamacpp"])
def test_detection_without_metrics_falls_back_on_the_engine_endpoints(kind):
    # Metrics are opt-in on SGLang and llama.cpp: detection must not need them.
    assert detection.detect(recorded(kind, without=("/metrics",))) == kind


def test_nothing_recognisable_is_the_generic_openai_adapter():
    assert detection.detect(Fingerprint({"/v1/models": (200, "not json")})) == "openai"
    assert detection.detect(Fingerprint({})) == "openai"


def test_describe_reads_version_model_and_context_length():
    assert detection.describe(recorded("vllm"), "vllm") == ("0.11.0", "Qwen/Qwen2.5-0.5B-Instruct", 32768)
    assert detection.describe(recorded("tgi"), "tgi") == ("3.3.6", "Qwen/Qwen2.5-0.5B-Instruct", 4096)
    assert detection.describe(recorded("llamacpp"), "llamacpp") == ("b6500-1a2b3c4", "qwen2.5-0.5b-instruct-q8_0.gguf", 8192)
    assert detection.describe(recorded("sglang"), "sglang") == ("0.5.4", "Qwen/Qwen3-0.6B", 40960)
    assert detection.describe(recorded("openai"), "openai") == (None, "gpt-4o-mini", None)


def test_unknown_kind_is_a_config_error():
    with pytest.raises(ConfigError, match="unknown server kind 'trt'"):
        adapters.adapter("trt")


def test_every_adapter_maps_only_common_names_and_states_its_assumptions():
    from fuzzer.execute.metrics import COMMON_NAMES

    for kind in adapters.KINDS:
        a = adapters.adapter(kind)
        assert set(a.metrics) <= set(COMMON_NAMES), kind
    assert adapters.adapter("vllm").scheduler_defaults["max_num_batched_tokens"] == (2048, 8192)
    assert adapters.adapter("vllm").scheduler_defaults["block_size"] == 16
    assert not adapters.adapter("openai").has_metrics


def _recorded_app(kind: str) -> web.Application:
    app = web.Application()
    for path, name in _FILES.items():
        f = DATA / kind / name
        if f.exists():
            text = f.read_text()

            async def handler(request, text=text):
                return web.Response(text=text)

            app.router.add_get(path, handler)
    return app


@pytest.mark.parametrize("kind", adapters.KINDS)
async def test_fingerprint_over_http_detects_each_engine(kind):
    async with serving(_recorded_app(kind)) as url, aiohttp.ClientSession() as session:
        fp = await detection.fingerprint(session, url, headers={})
    assert detection.detect(fp) == kind


async def test_fingerprint_of_an_unreachable_server_is_a_target_error(unused_tcp_port):
    async with aiohttp.ClientSession() as session:
        with pytest.raises(TargetError, match="cannot reach"):
            await detection.fingerprint(session, f"http://127.0.0.1:{unused_tcp_port}", headers={})


async def test_probe_finds_every_feature_of_a_full_server():
    async with running() as (url, _state), aiohttp.ClientSession() as session:
        caps = await adapters.probe_capabilities(session, url, adapters.adapter("vllm"), "test-model", headers={})
    assert caps == {f: True for f in adapters.FEATURES}


async def test_probe_records_a_4xx_as_an_unsupported_feature():
    async def completions(request):
        body = await request.json()
        if body.get("n", 1) > 1 or "logprobs" in body:
            return web.json_response({"error": "n and logprobs are not supported"}, status=400)
        return web.json_response({"choices": [{"text": "x"}], "usage": {"prompt_tokens": 2, "completion_tokens": 1}})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    async with serving(app) as url, aiohttp.ClientSession() as session:
        caps = await adapters.probe_capabilities(session, url, adapters.adapter("openai"), None, headers={})
    assert caps["completions"] and caps["ignore_eos"]
    assert not caps["n"] and not caps["logprobs"]
    assert not caps["chat"]  # no such route: 404
    assert not caps["tokenize"]
    assert not caps["stream_options"]  # the answer is not a stream with usage


async def test_probe_reports_a_refused_api_key():
    async def refuse(request):
        return web.json_response({"error": "invalid api key"}, status=401)

    app = web.Application()
    app.router.add_post("/v1/completions", refuse)
    async with serving(app) as url, aiohttp.ClientSession() as session:
        with pytest.raises(TargetError, match="refused the API key"):
            await adapters.probe_capabilities(session, url, adapters.adapter("openai"), None, headers={})


async def test_probe_names_a_server_that_never_answers(monkeypatch):
    # heldout7 started with --long-prefill-token-threshold 0 accepts connections and never answers: the probe said
    # "HTTP 0: TimeoutError: " (an empty exception text) where it can say what happened.
    monkeypatch.setattr(adapters, "PROBE_TIMEOUT_S", 0.3)

    async def never(request):
        await asyncio.sleep(1.5)
        return web.json_response({})

    app = web.Application()
    app.router.add_post("/v1/completions", never)
    async with serving(app) as url, aiohttp.ClientSession() as session:
        with pytest.raises(TargetError, match=r"did not answer a plain completion: no answer within 0.3 s"):
            await adapters.probe_capabilities(session, url, adapters.adapter("openai"), None, headers={})


# --- llama.cpp, from a real llama-server's recorded answers (data/servers/llamacpp/live) ---

LIVE = DATA / "llamacpp" / "live"
_LIVE_FILES = {"/metrics": "metrics_idle.txt", "/v1/models": "v1_models.json", "/props": "props.json"}


def live_llamacpp(*, without: tuple[str, ...] = ()) -> Fingerprint:
    answers = {}
    for path in detection.FINGERPRINT_PATHS:
        name = _LIVE_FILES.get(path)
        if name and path not in without:
            answers[path] = (200, (LIVE / name).read_text())
        elif path == "/metrics":
            # llama-server without --metrics: 501 with an error object.
            answers[path] = (501, '{"error":{"code":501,"message":"This server does not support metrics endpoint."}}')
        else:
            answers[path] = (404, '{"error":{"code":404,"message":"File Not Found","type":"not_found_error"}}')
    return Fingerprint(answers)


@pytest.mark.parametrize(
    "without", [(), ("/metrics",), ("/metrics", "/props"), ("/props", "/v1/models")], ids=str
)
def test_a_real_llama_server_is_detected_from_any_of_its_answers(without):
    assert detection.detect(live_llamacpp(without=without)) == "llamacpp"


def test_describe_a_real_llama_server():
    version, model, max_len = detection.describe(live_llamacpp(), "llamacpp")
    assert version == "b0-unknown"  # build_info of a build from the sdist (no git metadata)
    assert model is not None and model.endswith("random-llama.gguf")
    assert max_len == 4096  # the per-slot context (-c 16384 over -np 4), not the model's n_ctx_train


def test_a_real_llama_server_reports_its_slots_as_max_num_seqs():
    assert detection.reported_scheduler(live_llamacpp(), "llamacpp") == {"max_num_seqs": 4}
    assert detection.reported_scheduler(live_llamacpp(without=("/props",)), "llamacpp") == {}
    assert detection.reported_scheduler(recorded("vllm"), "vllm") == {}


def test_llamacpp_assumption_is_a_2048_token_step_and_its_slots():
    from fuzzer.oracle.model import assumption_for

    a = adapters.adapter("llamacpp")
    assumption = assumption_for("llamacpp", {**a.scheduler_defaults, "max_num_seqs": 2})
    assert (assumption.token_budget, assumption.max_num_seqs, assumption.block_size) == (2048, 2, 1)
    assert assumption_for("llamacpp", a.scheduler_defaults).max_num_seqs == 4


def test_every_command_calibrates_under_the_servers_own_assumption():
    """Before, `fuzz campaign`, `replay` and `minimize` calibrated a llama-server under vLLM's defaults."""
    from fuzzer.oracle.model import SchedulerAssumption

    info = adapters.ServerInfo(kind="llamacpp", version=None, model="m", max_model_len=4096,
                              scheduler={"max_num_seqs": 2})
    a = scheduler_assumption(info)
    assert (a.token_budget, a.max_num_seqs, a.block_size) == (2048, 2, 1)
    assert scheduler_assumption(info, token_budget=512).token_budget == 512
    assert scheduler_assumption(None) == SchedulerAssumption()  # the in-process simulator: vLLM's


def _json(name: str):
    import json

    return json.loads((LIVE / name).read_text())


def test_kv_usage_from_real_slots_counts_busy_slots_only():
    read = adapters.adapter("llamacpp").slots_metrics
    assert read is not None
    # Four busy slots holding 8, 8, 9+1, 9+1 tokens of 4 x 4096.
    assert read(_json("slots_busy.json")) == {"kv_usage": pytest.approx(36 / 16384)}
    assert read(_json("slots_idle.json")) == {"kv_usage": 0.0}


def test_kv_usage_reads_decoded_tokens_and_rejects_what_is_not_slots():
    read = adapters.adapter("llamacpp").slots_metrics
    slots = [
        {"n_ctx": 100, "is_processing": True, "n_prompt_tokens": 30, "next_token": [{"n_decoded": 20}]},
        {"n_ctx": 100, "is_processing": False, "n_prompt_tokens": 99, "next_token": [{"n_decoded": 99}]},
        {"n_ctx": 100, "is_processing": True, "n_prompt_tokens": 10, "next_token": {"n_decoded": 5}},
    ]
    assert read(slots) == {"kv_usage": pytest.approx(65 / 300)}
    for bad in ({"slots": []}, [], [{"id": 0}]):
        with pytest.raises(TargetError):
            read(bad)


def test_llamacpp_tokenize_counts_as_completions_do_and_leaves_chat_to_the_template():
    a = adapters.adapter("llamacpp")
    assert a.tokenize_body("hi", None, False) == {"content": "hi", "add_special": True, "parse_special": True}
    assert a.tokenize_body("hi", None, True) is None
    assert a.template_path == "/apply-template"
    assert a.tokenize_count(_json("tokenize.json")) == 6
