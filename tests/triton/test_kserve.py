"""The gateway's KServe v2 endpoint through the real `tritonclient.grpc` (sync and asyncio) against a
`serve all` stack: every mode returns what the native `Generate` returns, and bad requests get the
same status codes."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.grpc.aio as triton_aio
from tritonclient.utils import InferenceServerException

from decoding.config import Mode
from gateway.kserve import parameter_names
from gateway.wire import overrides_to_wire
from protos.specdec.v1 import gateway_pb2
from tests.services.test_modes import MODES, TEXTS

MODEL = "specdec"
INVALID, RANGE = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE
# DecodingConfig field -> the request parameter named as its CLI flag (`num_beams` -> `beams`).
FLAG_NAME = {field: flag for flag, field in parameter_names().items() if flag != field} | {
    field: field for field in parameter_names().values()
}


def settings(mode: Mode) -> dict:
    """A mode's decoding settings, as DecodingConfig fields (the native request's overrides)."""
    return {"mode": mode.value, **MODES[mode], "max_new_tokens": 24, "seed": 5}


def parameters(overrides: dict) -> dict:
    """The same settings as KServe request parameters, named as the CLI flags."""
    return {FLAG_NAME[name]: value for name, value in overrides.items()}


def tensor(name: str, datatype: str, array: np.ndarray) -> triton_grpc.InferInput:
    t = triton_grpc.InferInput(name, list(array.shape), datatype)
    t.set_data_from_numpy(array)
    return t


def text_input(text: str | bytes, datatype: str = "BYTES") -> triton_grpc.InferInput:
    tensor = triton_grpc.InferInput("TEXT", [1], datatype)
    data = text.encode() if isinstance(text, str) else text
    tensor.set_data_from_numpy(np.array([data], dtype=np.object_))
    return tensor


def ids_input(ids: list[int], dtype=np.int64, datatype: str = "INT64") -> triton_grpc.InferInput:
    tensor = triton_grpc.InferInput("INPUT_IDS", [len(ids)], datatype)
    tensor.set_data_from_numpy(np.asarray(ids, dtype=dtype))
    return tensor


def native(gateway, overrides: dict, text: str = "", ids: list[int] | None = None) -> gateway_pb2.GenerateResponse:
    request = gateway_pb2.GenerateRequest(text=text, input_ids=ids or [], config=overrides_to_wire(overrides))
    return gateway.Generate(request, timeout=60)


@pytest.fixture(scope="module")
def client(gateway_address):
    with triton_grpc.InferenceServerClient(gateway_address) as c:
        yield c


def test_health_and_metadata(client):
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready(MODEL) and client.is_model_ready(MODEL, "1")
    assert not client.is_model_ready("nope")
    assert client.get_server_metadata().name == "specdec"
    meta = client.get_model_metadata(MODEL)
    assert [(t.name, t.datatype) for t in meta.inputs] == [("TEXT", "BYTES"), ("INPUT_IDS", "INT64")]
    assert [(t.name, t.datatype) for t in meta.outputs] == [
        ("TEXT", "BYTES"), ("OUTPUT_IDS", "INT64"), ("NBEST_TEXT", "BYTES"), ("NBEST_OUTPUT_IDS", "INT64"),
        ("NBEST_SCORES", "FP64"), ("TOKEN_LOGPROBS", "FP32"),
    ]
    assert client.get_model_config(MODEL).config.name == MODEL
    with pytest.raises(InferenceServerException) as info:
        client.get_model_metadata("nope")
    assert info.value.status() == str(grpc.StatusCode.NOT_FOUND)


@pytest.mark.parametrize("mode", list(MODES), ids=lambda m: m.value)
def test_every_mode_equals_generate(client, gateway, mode):
    for text in TEXTS:
        expected = native(gateway, settings(mode), text=text)
        result = client.infer(MODEL, [text_input(text)], parameters=parameters(settings(mode)), timeout=60)
        assert result.as_numpy("OUTPUT_IDS").tolist() == list(expected.output_ids)
        assert result.as_numpy("TEXT").tolist() == [expected.text.encode()]
        stats = result.get_response().parameters
        assert stats["mode"].string_param == mode.value
        assert stats["iterations"].int64_param == expected.stats.iterations
        assert stats["accepted_tokens"].int64_param == expected.stats.accepted_tokens
        assert stats["finish_reason"].string_param == expected.stats.finish_reason
        assert not stats["degraded"].bool_param
        # Named as gRPC's DecodingStats fields, every one of them (times in ms, the total included).
        assert set(stats) == set(gateway_pb2.DecodingStats.DESCRIPTOR.fields_by_name)
        assert stats["total_time_ms"].double_param > 0


def test_input_ids_and_string_values(client, gateway, bundle):
    ids = bundle.tokenizer.encode(TEXTS[0])
    overrides = settings(Mode.GAD_PLUS_PLUS)
    expected = native(gateway, overrides, ids=ids)
    # Values as a command line gives them (strings), and the field names beside the flag names.
    as_strings = {name: str(value) for name, value in parameters(overrides).items()}
    result = client.infer(MODEL, [ids_input(ids)], parameters=as_strings, timeout=60)
    assert result.as_numpy("OUTPUT_IDS").tolist() == list(expected.output_ids)
    only_ids = client.infer(
        MODEL, [ids_input(ids)], parameters=parameters(overrides),
        outputs=[triton_grpc.InferRequestedOutput("OUTPUT_IDS")], timeout=60,
    )
    assert only_ids.as_numpy("TEXT") is None
    assert only_ids.as_numpy("OUTPUT_IDS").tolist() == list(expected.output_ids)


def test_asyncio_client_equals_generate(gateway_address, gateway):
    async def run() -> list:
        async with triton_aio.InferenceServerClient(gateway_address) as c:
            assert await c.is_server_ready() and await c.is_model_ready(MODEL)
            calls = [
                c.infer(MODEL, [text_input(text)], parameters=parameters(settings(mode)), client_timeout=60)
                for mode in (Mode.AR, Mode.GAD, Mode.BEAM, Mode.SPECULATIVE) for text in TEXTS
            ]
            return await asyncio.gather(*calls)

    results = asyncio.run(run())
    expected = [
        native(gateway, settings(mode), text=text)
        for mode in (Mode.AR, Mode.GAD, Mode.BEAM, Mode.SPECULATIVE) for text in TEXTS
    ]
    for result, want in zip(results, expected, strict=True):
        assert result.as_numpy("OUTPUT_IDS").tolist() == list(want.output_ids)
        assert result.as_numpy("TEXT").tolist() == [want.text.encode()]


# name -> (the KServe inputs, the request parameters, the expected code).
CASES = {
    "unknown mode": (lambda: [text_input("a b")], {"mode": "nope"}, INVALID),
    "k = 0": (lambda: [text_input("a b")], {"k": 0}, INVALID),
    "beta = 0": (lambda: [text_input("a b")], {"mode": "gad++", "beta": 0}, INVALID),
    "tau < 0": (lambda: [text_input("a b")], {"mode": "gad++", "tau": -0.5}, INVALID),
    "threshold over 1": (lambda: [text_input("a b")], {"mode": "mjsd", "threshold": 1.5}, INVALID),
    "k over the limit": (lambda: [text_input("a b")], {"k": 10_000}, RANGE),
    "max_new_tokens over the limit": (lambda: [text_input("a b")], {"max_new_tokens": 100_000}, RANGE),
    "empty text": (lambda: [text_input("")], {}, INVALID),
    "ids outside the vocabulary": (lambda: [ids_input([5, 100_000])], {}, INVALID),
    "negative id": (lambda: [ids_input([-1, 5])], {}, INVALID),
    "text not utf-8": (lambda: [text_input(b"\xff\xfe")], {}, INVALID),
    "TEXT as INT64": (lambda: [tensor("TEXT", "INT64", np.asarray([5, 6], dtype=np.int64))], {}, INVALID),
    "INPUT_IDS as INT32": (lambda: [ids_input([5, 6], np.int32, "INT32")], {}, INVALID),
    "both inputs": (lambda: [text_input("a b"), ids_input([5, 6])], {}, INVALID),
    "unknown input": (lambda: [tensor("X", "INT64", np.asarray([5], dtype=np.int64))], {}, INVALID),
    "unknown parameter": (lambda: [text_input("a b")], {"nope": 1}, INVALID),
    "k as a float": (lambda: [text_input("a b")], {"k": 2.5}, INVALID),
    "k as text": (lambda: [text_input("a b")], {"k": "ten"}, INVALID),
    "k as a bool": (lambda: [text_input("a b")], {"k": True}, INVALID),
    "beta with mode gad": (lambda: [text_input("a b")], {"mode": "gad", "beta": 3}, INVALID),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_requests_get_generate_status_codes(client, case):
    make_inputs, params, code = CASES[case]
    with pytest.raises(InferenceServerException) as info:
        client.infer(MODEL, make_inputs(), parameters=params, timeout=30)
    assert info.value.status() == str(code), info.value.message()
    assert info.value.message()  # a reason, not a bare code


@pytest.mark.parametrize(
    ("overrides", "text", "ids"),
    [({"k": 0}, "a b", None), ({"max_new_tokens": 100_000}, "a b", None), ({}, "", None), ({}, "", [5, 100_000])],
)
def test_codes_match_native_generate(client, gateway, overrides, text, ids):
    """The same request on both protocols fails with the same code."""
    with pytest.raises(grpc.RpcError) as native_error:
        native(gateway, overrides, text=text, ids=ids)
    inputs = [ids_input(ids)] if ids else [text_input(text)]
    with pytest.raises(InferenceServerException) as kserve_error:
        client.infer(MODEL, inputs, parameters=parameters(overrides), timeout=30)
    assert kserve_error.value.status() == str(native_error.value.code())


def test_unknown_model_is_not_found(client):
    with pytest.raises(InferenceServerException) as info:
        client.infer("nope", [text_input("a b")], timeout=30)
    assert info.value.status() == str(grpc.StatusCode.NOT_FOUND)
    with pytest.raises(InferenceServerException) as info:
        client.infer(MODEL, [text_input("a b")], model_version="7", timeout=30)
    assert info.value.status() == str(grpc.StatusCode.NOT_FOUND)


def test_gateway_stays_ready_after_bad_requests(client, gateway):
    for make_inputs, params, _ in CASES.values():
        with pytest.raises(InferenceServerException):
            client.infer(MODEL, make_inputs(), parameters=params, timeout=30)
    assert client.is_server_ready()
    result = client.infer(MODEL, [text_input(TEXTS[0])], parameters=parameters(settings(Mode.GAD)), timeout=60)
    assert result.as_numpy("OUTPUT_IDS").tolist() == list(native(gateway, settings(Mode.GAD), text=TEXTS[0]).output_ids)
