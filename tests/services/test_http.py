"""The gateway's HTTP endpoints against real `serve all` stacks on loopback: KServe v2 REST through the
real `tritonclient.http`, OpenAI-style completions through the real `openai` client, LibreTranslate's
/translate, bad requests of every kind, the bearer token, per-client limits, and a client that
disconnects mid-stream. Every output is compared with the gRPC `Generate` of the same request."""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from typing import Any

import grpc
import numpy as np
import openai
import pytest
import tritonclient.http as triton_http
from tritonclient.utils import InferenceServerException

from decoding.config import Mode
from gateway.kserve import parameter_names
from gateway.web.languages import Languages
from gateway.wire import overrides_to_wire
from protos.specdec.v1 import gateway_pb2, gateway_pb2_grpc
from specdec.serve import ServiceStack
from tests.services.conftest import wait_until
from tests.services.test_modes import MODES, TEXTS

MODEL = "specdec"
TOKEN = "http-s3cret"
# DecodingConfig field -> its request parameter name (the CLI flag's: `num_beams` -> `beams`).
FLAG_NAME = {field: flag for flag, field in parameter_names().items() if flag != field} | {
    field: field for field in parameter_names().values()
}


def settings(mode: Mode) -> dict[str, Any]:
    """A mode's decoding settings as DecodingConfig fields (the gRPC request's overrides)."""
    return {"mode": mode.value, **MODES[mode], "max_new_tokens": 24, "seed": 5}


def parameters(overrides: dict[str, Any]) -> dict[str, Any]:
    return {FLAG_NAME[name]: value for name, value in overrides.items()}


def native(gateway, overrides: dict, text: str = "", ids: list[int] | None = None) -> gateway_pb2.GenerateResponse:
    request = gateway_pb2.GenerateRequest(text=text, input_ids=ids or [], config=overrides_to_wire(overrides))
    return gateway.Generate(request, timeout=60)


def call(address: str, method: str, path: str, body: Any = None, headers: dict | None = None,
         raw: bytes | None = None) -> tuple[int, Any, dict]:
    """One HTTP request: (status, the body parsed as JSON where it is JSON, the headers)."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    request = urllib.request.Request(f"http://{address}{path}", data=data, method=method,
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            status, content, got = response.status, response.read(), dict(response.headers)
    except urllib.error.HTTPError as exc:
        status, content, got = exc.code, exc.read(), dict(exc.headers)
    try:
        return status, json.loads(content), got
    except ValueError:
        return status, content.decode(), got


@pytest.fixture(scope="module")
def http_address(stack) -> str:
    return stack.running.http_address


@pytest.fixture(scope="module")
def kserve(http_address):
    client = triton_http.InferenceServerClient(http_address, network_timeout=60)
    yield client
    client.close()


@pytest.fixture(scope="module")
def completions(http_address):
    with openai.OpenAI(base_url=f"http://{http_address}/v1", api_key="unused", max_retries=0, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def guarded(bundle_dir):
    """A stack with a bearer token, a declared language pair, at most two requests per client, and
    slow steps (each verifier step waits for company, each streamed greedy run is one step), so a
    long request is still decoding when its client leaves."""
    sections = {
        "verifier": {"address": "127.0.0.1:0", "metrics_address": "127.0.0.1:0", "batch_wait_ms": 20.0},
        "drafter": {"address": "127.0.0.1:0"},
        "gateway": {"address": "127.0.0.1:0", "auth_token": TOKEN, "language_pair": "uk:uk", "max_per_client": 2,
                    "stream_greedy_chunk": 1},
        "defaults": {"mode": "gad", "k": 4, "max_new_tokens": 8},
    }
    with ServiceStack("all", bundle_dir, sections) as running:
        yield running


# ---- KServe v2 REST --------------------------------------------------------------------------------


def _text_input(text: str, binary: bool) -> triton_http.InferInput:
    tensor = triton_http.InferInput("TEXT", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([text.encode()], dtype=np.object_), binary_data=binary)
    return tensor


def test_kserve_health_and_metadata(kserve):
    assert kserve.is_server_live() and kserve.is_server_ready()
    assert kserve.is_model_ready(MODEL) and not kserve.is_model_ready("nope")
    assert kserve.get_server_metadata()["name"] == "specdec"
    meta = kserve.get_model_metadata(MODEL)
    assert [(t["name"], t["datatype"], t["shape"]) for t in meta["inputs"]] == [("TEXT", "BYTES", [1]),
                                                                               ("INPUT_IDS", "INT64", [-1])]
    assert kserve.get_model_config(MODEL)["output"][1] == {"name": "OUTPUT_IDS", "data_type": "TYPE_INT64",
                                                          "dims": [-1]}
    with pytest.raises(InferenceServerException) as info:
        kserve.get_model_metadata("nope")
    assert info.value.status() == "404" and "unknown model 'nope'" in info.value.message()


@pytest.mark.parametrize("mode", list(MODES), ids=lambda m: m.value)
def test_kserve_rest_equals_generate_in_every_mode(kserve, gateway, mode):
    """JSON tensors and the binary-data extension alike; the stats as gRPC's KServe parameters."""
    for text in TEXTS:
        expected = native(gateway, settings(mode), text=text)
        for binary in (False, True):
            outputs = [triton_http.InferRequestedOutput(name, binary_data=binary) for name in ("TEXT", "OUTPUT_IDS")]
            result = kserve.infer(MODEL, [_text_input(text, binary)], outputs=outputs,
                                  parameters=parameters(settings(mode)))
            assert result.as_numpy("OUTPUT_IDS").tolist() == list(expected.output_ids)
            got = result.as_numpy("TEXT").tolist()[0]
            assert (got.decode() if binary else got) == expected.text
            stats = result.get_response()["parameters"]
            assert stats["mode"] == mode.value and stats["iterations"] == expected.stats.iterations
            assert stats["accepted_tokens"] == expected.stats.accepted_tokens
            assert set(stats) == set(gateway_pb2.DecodingStats.DESCRIPTOR.fields_by_name)


def test_kserve_rest_input_ids_and_default_binary_outputs(kserve, gateway, bundle):
    ids = bundle.tokenizer.encode(TEXTS[1])
    expected = native(gateway, settings(Mode.IAD), ids=ids)
    tensor = triton_http.InferInput("INPUT_IDS", [1, len(ids)], "INT64")
    tensor.set_data_from_numpy(np.asarray([ids], dtype=np.int64))
    # No outputs named: tritonclient asks for every output as binary data.
    result = kserve.infer(MODEL, [tensor], parameters={k: str(v) for k, v in parameters(settings(Mode.IAD)).items()})
    assert result.as_numpy("OUTPUT_IDS").tolist() == list(expected.output_ids)
    assert result.as_numpy("TEXT").tolist() == [expected.text.encode()]


# name -> (the inference request's JSON, the status, a part of the message)
KSERVE_BAD = {
    "no inputs": ({"inputs": []}, 400, "set exactly one input"),
    "unknown parameter": ({"inputs": [{"name": "TEXT", "shape": [1], "datatype": "BYTES", "data": ["a b"]}],
                           "parameters": {"nope": 1}}, 400, "unknown decoding parameter 'nope'"),
    "k as text": ({"inputs": [{"name": "TEXT", "shape": [1], "datatype": "BYTES", "data": ["a b"]}],
                   "parameters": {"k": "ten"}}, 400, "must be a integer"),
    "k over the limit": ({"inputs": [{"name": "TEXT", "shape": [1], "datatype": "BYTES", "data": ["a b"]}],
                          "parameters": {"k": 10_000}}, 400, "k"),
    "BYTES data not strings": ({"inputs": [{"name": "TEXT", "shape": [1], "datatype": "BYTES", "data": [5]}]},
                               400, "BYTES data must be strings"),
    "shape and data differ": ({"inputs": [{"name": "TEXT", "shape": [2], "datatype": "BYTES", "data": ["a"]}]},
                              400, "does not match"),
    "ids outside the vocabulary": ({"inputs": [{"name": "INPUT_IDS", "shape": [2], "datatype": "INT64",
                                                "data": [5, 100000]}]}, 400, "vocabulary"),
    "inputs not a list": ({"inputs": {"name": "TEXT"}}, 400, "inputs must be a list"),
    "unknown field": ({"inputs": [], "priority": 1}, 400, "unknown fields"),
}


@pytest.mark.parametrize("case", list(KSERVE_BAD))
def test_kserve_rest_bad_requests_get_json_errors(http_address, case):
    body, status, part = KSERVE_BAD[case]
    got, answer, _ = call(http_address, "POST", "/v2/models/specdec/infer", body)
    assert got == status and isinstance(answer["error"], str) and part in answer["error"], answer


def test_kserve_rest_codes_match_grpc(http_address, gateway):
    """A request gRPC refuses with OUT_OF_RANGE or INVALID_ARGUMENT is a 400 here with the same message."""
    overrides = {"max_new_tokens": 100_000}
    with pytest.raises(Exception) as native_error:
        native(gateway, overrides, text="a b")
    body = {"inputs": [{"name": "TEXT", "shape": [1], "datatype": "BYTES", "data": ["a b"]}],
            "parameters": parameters(overrides)}
    status, answer, _ = call(http_address, "POST", "/v2/models/specdec/infer", body)
    assert status == 400 and answer["error"] == native_error.value.details()


# ---- OpenAI-style completions ------------------------------------------------------------------------


def _specdec(mode: Mode) -> dict[str, Any]:
    """A mode's settings as the `specdec` extra field (max_new_tokens and seed go in OpenAI's own fields)."""
    return parameters({k: v for k, v in settings(mode).items() if k not in ("max_new_tokens", "seed")})


@pytest.mark.parametrize("mode", list(MODES), ids=lambda m: m.value)
def test_openai_client_equals_generate_whole_and_streamed(completions, gateway, mode):
    for text in TEXTS:
        expected = native(gateway, settings(mode), text=text)
        whole = completions.completions.create(model=MODEL, prompt=text, max_tokens=24, seed=5,
                                               extra_body={"specdec": _specdec(mode)})
        choice = whole.choices[0]
        assert choice.text == expected.text
        assert choice.model_extra["specdec"]["output_ids"] == list(expected.output_ids)
        assert choice.finish_reason == {"eos": "stop", "length": "length"}[expected.stats.finish_reason]
        assert whole.usage.completion_tokens == len(expected.output_ids)

        chunks = list(completions.completions.create(model=MODEL, prompt=text, max_tokens=24, seed=5, stream=True,
                                                     stream_options={"include_usage": True},
                                                     extra_body={"specdec": _specdec(mode)}))
        pieces = [c.choices[0] for c in chunks if c.choices]
        assert "".join(p.text for p in pieces) == expected.text
        ids = [i for p in pieces if "source" in p.model_extra["specdec"] for i in p.model_extra["specdec"]["token_ids"]]
        assert ids == list(expected.output_ids)
        drafted = sum(len(p.model_extra["specdec"]["token_ids"]) for p in pieces
                      if p.model_extra["specdec"].get("source") == "draft")
        assert drafted <= expected.stats.accepted_tokens
        assert pieces[-1].model_extra["specdec"]["stats"]["iterations"] == expected.stats.iterations
        assert chunks[-1].usage.completion_tokens == len(expected.output_ids)


@pytest.mark.parametrize("mode", [Mode.AR, Mode.GAD], ids=lambda m: m.value)
def test_openai_logprobs_are_the_tokens_log_probabilities_generate_reports(completions, gateway, mode):
    for text in TEXTS:
        expected = native(gateway, {**settings(mode), "output_logprobs": True}, text=text)
        whole = completions.completions.create(model=MODEL, prompt=text, max_tokens=24, seed=5, logprobs=0,
                                               extra_body={"specdec": _specdec(mode)})
        logprobs = whole.choices[0].logprobs
        ids = list(expected.output_ids)
        assert logprobs.token_logprobs == pytest.approx(list(expected.token_logprobs)[: len(ids)], abs=1e-6)
        assert "".join(logprobs.tokens) == whole.choices[0].text == expected.text
        assert logprobs.text_offset == [len("".join(logprobs.tokens[:i])) for i in range(len(ids))]
        assert logprobs.top_logprobs is None


def test_openai_sampling_fields_map_to_speculative_sampling(completions, gateway):
    """temperature / top_p / seed are speculative sampling's; n choices take seeds seed, seed + 1, ..."""
    base = {"mode": "spec", "gamma": 3, "temperature": 0.9, "top_p": 0.95, "max_new_tokens": 24}
    whole = completions.completions.create(model=MODEL, prompt=TEXTS[0], max_tokens=24, temperature=0.9, top_p=0.95,
                                           seed=5, n=2, extra_body={"specdec": {"gamma": 3}})
    for i, choice in enumerate(whole.choices):
        assert choice.index == i
        assert choice.model_extra["specdec"]["output_ids"] == list(
            native(gateway, {**base, "seed": 5 + i}, text=TEXTS[0]).output_ids)
        assert choice.model_extra["specdec"]["stats"]["mode"] == "spec"
    greedy = completions.completions.create(model=MODEL, prompt=TEXTS[0], max_tokens=24, temperature=0,
                                            extra_body={"specdec": {"mode": "ar"}})
    assert greedy.choices[0].text == native(gateway, {"mode": "ar", "max_new_tokens": 24}, text=TEXTS[0]).text


def test_openai_prompt_lists_and_token_ids(completions, gateway, bundle):
    overrides = {"mode": "gad", "k": 4, "max_new_tokens": 16}
    expected = [native(gateway, overrides, text=t) for t in TEXTS]
    many = completions.completions.create(model=MODEL, prompt=TEXTS, max_tokens=16,
                                          extra_body={"specdec": {"mode": "gad", "k": 4}})
    assert [c.text for c in many.choices] == [e.text for e in expected]
    ids = [bundle.tokenizer.encode(t) for t in TEXTS]
    by_ids = completions.completions.create(model=MODEL, prompt=ids, max_tokens=16,
                                            extra_body={"specdec": {"mode": "gad", "k": 4}})
    assert [c.text for c in by_ids.choices] == [e.text for e in expected]
    assert by_ids.usage.prompt_tokens == sum(map(len, ids))
    # What asks for nothing, as SDKs and frameworks send it, is accepted (penalties as floats, best_of = n).
    plain = completions.completions.create(model=MODEL, prompt=TEXTS[0], max_tokens=16, presence_penalty=0.0,
                                           frequency_penalty=0, best_of=1, echo=False, logprobs=None, stop=None,
                                           user="someone", extra_body={"specdec": {"mode": "gad", "k": 4}})
    assert plain.choices[0].text == expected[0].text
    assert [m.id for m in completions.models.list().data] == [MODEL]


# name -> (the body's fields, the status, the `param` OpenAI's error names: None for what the gateway's
# request path refuses, whose message names the setting)
OPENAI_BAD = {
    "unknown parameter": ({"bogus": 1}, 400, "bogus"),
    "unknown model": ({"model": "gpt-nope"}, 404, "model"),
    "max_tokens as text": ({"max_tokens": "ten"}, 400, "max_tokens"),
    "prompt not text": ({"prompt": {"a": 1}}, 400, "prompt"),
    "temperature with mode gad": ({"temperature": 0.7, "specdec": {"mode": "gad"}}, 400, None),
    "logprobs alternatives": ({"logprobs": 2}, 400, "logprobs"),
    "logprobs streamed": ({"logprobs": 0, "stream": True}, 400, "logprobs"),
    "stop sequences": ({"stop": ["."]}, 400, "stop"),
    "too many choices": ({"n": 1000}, 400, "n"),
    "max_tokens over the limit": ({"max_tokens": 100_000}, 400, None),
    "mode unknown": ({"specdec": {"mode": "fast"}}, 400, "specdec"),
}


@pytest.mark.parametrize("case", list(OPENAI_BAD))
def test_openai_bad_requests_get_openai_errors(http_address, case):
    fields, status, param = OPENAI_BAD[case]
    got, answer, _ = call(http_address, "POST", "/v1/completions", {"model": MODEL, "prompt": "a b", **fields})
    assert got == status, answer
    error = answer["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"] and error["param"] == param


def test_the_openai_client_raises_the_error_it_was_sent(completions):
    with pytest.raises(openai.NotFoundError) as info:
        completions.completions.create(model="gpt-nope", prompt="a b")
    assert info.value.body["code"] == "model_not_found" and "specdec" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError, match="beta does not apply to mode gad"):
        completions.completions.create(model=MODEL, prompt="a b", extra_body={"specdec": {"mode": "gad", "beta": 3}})


def test_a_stream_refused_before_any_output_gets_a_status(http_address):
    status, answer, _ = call(http_address, "POST", "/v1/completions",
                             {"model": MODEL, "prompt": "a b", "stream": True, "specdec": {"k": 0}})
    assert status == 400 and "k" in answer["error"]["message"]


# ---- any protocol ----------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v2/models/specdec/infer", "/v1/completions", "/translate"])
def test_malformed_oversize_and_deep_bodies_are_refused_in_the_protocols_shape(http_address, path):
    shape = (lambda e: isinstance(e["error"]["message"], str)) if path.startswith("/v1") else (
        lambda e: isinstance(e["error"], str))
    for raw, status in ((b'{"inputs": [', 400), (b"\xff\xfe", 400), (b"[" * 100 + b"]" * 100, 400),
                        (b"[" * 100_000, 400), (b"x" * (1024 * 1024 + 10), 413), (b"[1, 2]", 400)):
        got, answer, _ = call(http_address, "POST", path, raw=raw)
        assert got == status and shape(answer), (raw[:20], answer)
    got, answer, headers = call(http_address, "GET", path)
    assert got == 405 and shape(answer) and "POST" in headers["Allow"]
    got, answer, _ = call(http_address, "GET", "/nowhere")
    assert got == 404 and answer == {"error": "Not Found"}


def test_the_gateway_stays_ready_after_bad_requests(kserve, gateway, http_address):
    for body, _, _ in KSERVE_BAD.values():
        call(http_address, "POST", "/v2/models/specdec/infer", body)
    assert kserve.is_server_ready()
    result = kserve.infer(MODEL, [_text_input(TEXTS[0], True)], parameters=parameters(settings(Mode.GAD)))
    assert result.as_numpy("OUTPUT_IDS").tolist() == list(native(gateway, settings(Mode.GAD), text=TEXTS[0]).output_ids)


def test_the_request_id_is_echoed(http_address):
    _, _, headers = call(http_address, "POST", "/v1/completions", {"model": MODEL, "prompt": "a b", "max_tokens": 2},
                         headers={"x-request-id": "req-42"})
    assert headers["x-request-id"] == "req-42"


# ---- the bearer token, LibreTranslate, per-client limits, disconnects ----------------------------------


def test_the_bearer_token_guards_every_endpoint_but_health_and_the_page(guarded):
    address = guarded.running.http_address
    assert call(address, "GET", "/v2/health/ready")[0] == 200
    assert call(address, "GET", "/")[0] == 200
    status, answer, _ = call(address, "GET", "/v1/models")
    assert status == 401 and answer["error"]["type"] == "authentication_error"
    status, answer, _ = call(address, "GET", "/v2/models/specdec", headers={"Authorization": "Bearer wrong"})
    assert (status, answer) == (401, {"error": "invalid bearer token"})
    assert call(address, "GET", "/v2/models/specdec", headers={"Authorization": f"Bearer {TOKEN}"})[0] == 200
    with openai.OpenAI(base_url=f"http://{address}/v1", api_key=TOKEN, max_retries=0, timeout=60) as client:
        assert client.completions.create(model=MODEL, prompt=TEXTS[0], max_tokens=4).choices[0].text is not None


def test_libretranslate_translate_and_languages(guarded, bundle):
    address = guarded.running.http_address
    assert call(address, "GET", "/languages", headers={"Authorization": f"Bearer {TOKEN}"})[1] == [
        {"code": "uk", "name": "Ukrainian", "targets": ["uk"]}]
    with grpc.insecure_channel(guarded.running.addresses["gateway"]) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        expected = [stub.Generate(gateway_pb2.GenerateRequest(text=t), timeout=60,
                                  metadata=(("authorization", f"Bearer {TOKEN}"),)).text for t in TEXTS]
    status, answer, _ = call(address, "POST", "/translate", {"q": TEXTS[0], "source": "uk", "target": "uk",
                                                              "api_key": TOKEN})
    assert (status, answer) == (200, {"translatedText": expected[0]})
    status, answer, _ = call(address, "POST", "/translate", {"q": [TEXTS[1], ""], "source": "auto", "target": "uk"},
                             headers={"Authorization": f"Bearer {TOKEN}"})
    assert (status, answer) == (200, {"translatedText": [expected[1], ""]})
    form = f"q={urllib.request.quote(TEXTS[1])}&source=uk&target=uk&api_key={TOKEN}".encode()
    status, answer, _ = call(address, "POST", "/translate", raw=form,
                             headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert (status, answer) == (200, {"translatedText": expected[1]})
    # alternatives: beam search's other hypotheses, as gRPC's n-best list gives them.
    beam = gateway_pb2.DecodingConfig(mode=gateway_pb2.MODE_AR_BEAM, num_beams=3, num_return_sequences=3)
    with grpc.insecure_channel(guarded.running.addresses["gateway"]) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        nbest = [[h.text for h in stub.Generate(gateway_pb2.GenerateRequest(text=t, config=beam), timeout=60,
                                                metadata=(("authorization", f"Bearer {TOKEN}"),)).hypotheses]
                 for t in TEXTS[:2]]
    assert all(len(n) == 3 for n in nbest)
    status, answer, _ = call(address, "POST", "/translate", {"q": TEXTS[0], "source": "uk", "target": "uk",
                                                              "alternatives": 2, "api_key": TOKEN})
    assert (status, answer) == (200, {"translatedText": nbest[0][0], "alternatives": nbest[0][1:]})
    status, answer, _ = call(address, "POST", "/translate", {"q": TEXTS[:2], "source": "uk", "target": "uk",
                                                              "alternatives": "2", "api_key": TOKEN})
    assert (status, answer) == (200, {"translatedText": [n[0] for n in nbest], "alternatives": [n[1:] for n in nbest]})
    for fields, status, part in (
        ({"q": "a", "source": "uk", "target": "uk", "alternatives": -1, "api_key": TOKEN}, 400, "alternatives"),
        ({"q": "a", "source": "uk", "target": "uk", "alternatives": "two", "api_key": TOKEN}, 400, "alternatives"),
        ({"q": "a", "source": "uk", "target": "uk", "alternatives": 100000, "api_key": TOKEN}, 400, "num_beams"),
        ({"q": "a", "source": "uk", "target": "fr", "api_key": TOKEN}, 400, "target 'fr' is not supported"),
        ({"q": "a", "source": "en", "target": "uk", "api_key": TOKEN}, 400, "source 'en' is not supported"),
        ({"q": "a", "source": "uk", "target": "uk", "format": "html", "api_key": TOKEN}, 400, "format"),
        ({"source": "uk", "target": "uk", "api_key": TOKEN}, 400, "missing q"),
        ({"q": "a", "source": "uk", "target": "uk", "api_key": "wrong"}, 403, "Invalid API key"),
        ({"q": "a", "source": "uk", "target": "uk"}, 403, "API key"),
        ({"q": ["a", "b", "c"], "source": "uk", "target": "uk", "api_key": TOKEN}, 400, "max_per_client"),
    ):
        got, answer, _ = call(address, "POST", "/translate", fields)
        assert got == status and part in answer["error"], answer


def _open_stream(address: str, client: str, max_tokens: int = 200) -> tuple[http.client.HTTPConnection, Any]:
    """A streaming completion left open after its first event (its decode goes on)."""
    connection = http.client.HTTPConnection(address, timeout=60)
    body = {"model": MODEL, "prompt": TEXTS[0], "max_tokens": max_tokens, "stream": True, "specdec": {"mode": "ar"}}
    connection.request("POST", "/v1/completions", json.dumps(body),
                       {"Authorization": f"Bearer {TOKEN}", "x-client-id": client, "Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200
    assert response.readline().startswith(b"data: ")
    return connection, response


def test_per_client_limit_and_disconnects_free_the_sessions(guarded):
    """A client with two streams open gets 429 for a third; closing both cancels their decodes:
    the gateway's active requests and the verifier's sessions go back to zero."""
    address = guarded.running.http_address
    gateway = guarded.running.gateway
    cancelled_before = gateway.metrics.cancelled.value()
    streams = [_open_stream(address, "client-a") for _ in range(2)]
    assert gateway.metrics.active.value() == 2
    status, answer, _ = call(address, "POST", "/v1/completions", {"model": MODEL, "prompt": "a b", "max_tokens": 2},
                             headers={"Authorization": f"Bearer {TOKEN}", "x-client-id": "client-a"})
    assert status == 429 and "client-a already has 2 requests" in answer["error"]["message"]
    assert answer["error"]["type"] == "rate_limit_error"
    assert guarded.running.verifier.active_sessions == 2
    started = time.monotonic()
    for connection, _ in streams:
        connection.sock.close()  # the client goes away mid-stream
        connection.close()
    assert wait_until(lambda: gateway.metrics.active.value() == 0, 10.0)
    assert wait_until(lambda: guarded.running.verifier.active_sessions == 0, 10.0)
    # Well before the 200 tokens a stream asked for (about 20 ms a step here) would have been decoded.
    assert time.monotonic() - started < 3.0
    assert gateway.metrics.cancelled.value() == cancelled_before + 2
    # The client's share is free again.
    status, _, _ = call(address, "POST", "/v1/completions", {"model": MODEL, "prompt": "a b", "max_tokens": 2},
                        headers={"Authorization": f"Bearer {TOKEN}", "x-client-id": "client-a"})
    assert status == 200


def test_many_to_many_codes_map_to_libretranslate_codes():
    """NLLB's, mBART-50's and M2M100's codes as LibreTranslate's; the framed source language is fixed."""
    nllb = Languages.of({"eng_Latn": 10, "fra_Latn": 11, "ukr_Cyrl": 12, "xyz_Latn": 13}, [10], "")
    assert nllb.listing() == [{"code": "en", "name": "English", "targets": ["en", "fr", "uk", "xyz_Latn"]}]
    assert nllb.target("fr") == "fra_Latn" and nllb.target("ukr_Cyrl") == "ukr_Cyrl"
    nllb.check_source("en")
    nllb.check_source("eng_Latn")
    for refused in ("auto", "fr"):
        with pytest.raises(ValueError, match="translates from en"):
            nllb.check_source(refused)
    mbart = Languages.of({"en_XX": 3, "fr_XX": 4}, [], "")
    assert mbart.target("fr") == "fr_XX" and mbart.source is None
    mbart.check_source("auto")
    with pytest.raises(ValueError, match="not declared"):
        Languages.of({}, [], "").target("de")
