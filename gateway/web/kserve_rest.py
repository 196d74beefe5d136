"""KServe v2 / Open Inference Protocol over HTTP/REST: the model of the gRPC endpoint (gateway.kserve),
with JSON tensors and Triton's binary-data extension, so `tritonclient.http` works as against Triton.

A request is translated into the gRPC door's `ModelInferRequest` and run by the same `infer()`, and
its `ModelInferResponse` is written back as JSON: both doors check inputs and parameters with one
piece of code and answer with the same outputs and stats (response parameters, named as there).

Binary data: a body whose `Inference-Header-Content-Length` header gives the JSON part's length
carries the inputs' raw bytes after it (each input's `binary_data_size` parameter, in input order),
as `raw_input_contents`; outputs asked for with `binary_data` (or the request parameter
`binary_data_output`, which tritonclient sends when it names no outputs) come back the same way.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
from aiohttp import web
from tritonclient.grpc import service_pb2

from core.errors import SpecdecError
from gateway.kserve import (
    CONFIG_TYPES,
    INPUT_TENSORS,
    MODEL_VERSION,
    NUMPY_TYPES,
    OUTPUT_TENSORS,
    PLATFORM,
    RequestPath,
    check_model,
    infer,
    json_parameters,
    known_model,
    split_bytes,
)
from gateway.web.app import HttpContext, HttpError, handler, json_object, json_response, read_body

HEADER_LENGTH = "Inference-Header-Content-Length"
BINARY_OUTPUT = "binary_data_output"  # request parameter: every output as binary data
BINARY_SIZE = "binary_data_size"  # an input's or output's bytes after the JSON part
EXTENSIONS = ["parameters", "binary_tensor_data"]


def routes(gateway: RequestPath, model_name: str) -> list[web.RouteDef]:
    endpoint = KServeRest(gateway, model_name)
    model = "/v2/models/{model}"
    versioned = "/v2/models/{model}/versions/{version}"
    out = [
        web.get("/v2", endpoint.server_metadata),
        web.get("/v2/health/live", endpoint.live),
        web.get("/v2/health/ready", endpoint.ready),
    ]
    for base in (model, versioned):
        out += [
            web.get(base, handler(endpoint.model_metadata)),
            web.get(base + "/ready", endpoint.model_ready),
            web.get(base + "/config", handler(endpoint.model_config)),
            web.post(base + "/infer", handler(endpoint.infer)),
        ]
    return out


class KServeRest:
    def __init__(self, gateway: RequestPath, model_name: str) -> None:
        self.gateway = gateway
        self.model_name = model_name

    async def server_metadata(self, request: web.Request) -> web.Response:
        return json_response({"name": PLATFORM, "version": MODEL_VERSION, "extensions": EXTENSIONS})

    async def live(self, request: web.Request) -> web.Response:
        return json_response({"live": True})

    async def ready(self, request: web.Request) -> web.Response:
        ready = self.gateway.ready()
        return json_response({"ready": ready}, 200 if ready else 503)

    async def model_ready(self, request: web.Request) -> web.Response:
        name, version = _model_of(request)
        if not known_model(self.model_name, name, version):
            raise HttpError(404, f"unknown model {name!r}; this server has {self.model_name!r}")
        ready = self.gateway.ready()
        return json_response({"name": name, "ready": ready}, 200 if ready else 503)

    async def model_metadata(self, request: web.Request, context: HttpContext) -> web.Response:
        await check_model(self.model_name, *_model_of(request), context)
        return json_response({
            "name": self.model_name,
            "versions": [MODEL_VERSION],
            "platform": PLATFORM,
            "inputs": [{"name": n, "datatype": d, "shape": s} for n, d, s in INPUT_TENSORS],
            "outputs": [{"name": n, "datatype": d, "shape": s} for n, d, s in OUTPUT_TENSORS],
        })

    async def model_config(self, request: web.Request, context: HttpContext) -> web.Response:
        """The model config as Triton's HTTP endpoint gives it (its JSON form of model_config.proto)."""
        await check_model(self.model_name, *_model_of(request), context)
        return json_response({
            "name": self.model_name,
            "platform": PLATFORM,
            "max_batch_size": 0,
            "input": [{"name": n, "data_type": CONFIG_TYPES[d], "dims": s, "optional": True}
                      for n, d, s in INPUT_TENSORS],
            "output": [{"name": n, "data_type": CONFIG_TYPES[d], "dims": s} for n, d, s in OUTPUT_TENSORS],
        })

    async def infer(self, request: web.Request, context: HttpContext) -> web.Response:
        name, version = _model_of(request)
        await check_model(self.model_name, name, version, context)
        body = await read_body(request)
        message, binary = infer_request(body, request.headers.get(HEADER_LENGTH), name, version)
        response = await infer(self.gateway, self.model_name, message, context)
        header, raw = response_json(response, binary)
        if not raw:
            return json_response(header)
        encoded = json.dumps(header, ensure_ascii=False).encode()
        out = web.Response(body=encoded + raw, content_type="application/octet-stream")
        out.headers[HEADER_LENGTH] = str(len(encoded))
        return out


def _model_of(request: web.Request) -> tuple[str, str]:
    return request.match_info["model"], request.match_info.get("version", "")


# ---- JSON <-> the gRPC door's messages -------------------------------------------------------------


def infer_request(
    body: bytes, header_length: str | None, model: str, version: str
) -> tuple[service_pb2.ModelInferRequest, set[str] | bool]:
    """The ModelInferRequest a REST body stands for, and which outputs to send as binary data (a set
    of names, or True for all)."""
    json_part, raw = _split_body(body, header_length)
    doc = json_object(json_part)
    unknown = set(doc) - {"id", "parameters", "inputs", "outputs"}
    if unknown:
        raise HttpError(400, f"unknown fields {sorted(unknown)} in the inference request")
    message = service_pb2.ModelInferRequest(model_name=model, model_version=version)
    if "id" in doc:
        message.id = _typed(doc["id"], str, "id", "a string")
    parameters = dict(_typed(doc.get("parameters", {}), dict, "parameters", "an object"))
    binary: set[str] | bool = bool(_typed(parameters.pop(BINARY_OUTPUT, False), bool, BINARY_OUTPUT, "a bool"))
    for key, param in _parameters(parameters).items():
        message.parameters[key].CopyFrom(param)
    inputs = _typed(doc.get("inputs"), list, "inputs", "a list of tensors")
    _add_inputs(message, inputs, raw)
    for spec in _typed(doc.get("outputs", []), list, "outputs", "a list"):
        spec = _typed(spec, dict, "outputs", "a list of objects")
        out_name = _typed(spec.get("name"), str, "an output's name", "a string")
        message.outputs.add(name=out_name)
        params = _typed(spec.get("parameters", {}), dict, f"output {out_name}'s parameters", "an object")
        if params.get("binary_data") is True and binary is not True:
            binary = {*(binary or ()), out_name}
    return message, binary


def _split_body(body: bytes, header_length: str | None) -> tuple[bytes, bytes]:
    if header_length is None:
        return body, b""
    if not header_length.isdigit() or int(header_length) > len(body):
        raise HttpError(400, f"{HEADER_LENGTH} {header_length!r} is not a length within the body's "
                             f"{len(body)} bytes")
    return body[: int(header_length)], body[int(header_length) :]


def _add_inputs(message: service_pb2.ModelInferRequest, inputs: list, raw: bytes) -> None:
    at = 0
    for spec in inputs:
        spec = _typed(spec, dict, "inputs", "a list of objects")
        name = _typed(spec.get("name"), str, "an input's name", "a string")
        tensor = message.inputs.add(name=name, datatype=_typed(spec.get("datatype"), str, f"input {name}'s datatype",
                                                               "a string"))
        shape = _typed(spec.get("shape"), list, f"input {name}'s shape", "a list of integers")
        if not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
            raise HttpError(400, f"input {name}'s shape must be a list of integers, got {shape}")
        tensor.shape.extend(shape)
        params = _typed(spec.get("parameters", {}), dict, f"input {name}'s parameters", "an object")
        size = params.get(BINARY_SIZE)
        if size is not None:
            size = _typed(size, int, f"input {name}'s {BINARY_SIZE}", "an integer")
            if size < 0 or at + size > len(raw):
                raise HttpError(400, f"input {name}'s {BINARY_SIZE} {size} runs past the body's binary data")
            message.raw_input_contents.append(raw[at : at + size])
            at += size
        elif "data" in spec:
            _set_contents(tensor, spec["data"])
        else:
            raise HttpError(400, f"input {name} has neither data nor a {BINARY_SIZE} parameter")
    if message.raw_input_contents and len(message.raw_input_contents) != len(message.inputs):
        raise HttpError(400, "send every input as binary data or every input as JSON data, not a mix")
    if at != len(raw):
        raise HttpError(400, f"the body has {len(raw) - at} bytes of binary data no input claims")


def _set_contents(tensor, data: Any) -> None:
    """JSON tensor data (flat, or nested row-major) into the message's typed contents: BYTES as
    strings, INT64 as integers. Other datatypes are kept empty: the model refuses them by datatype."""
    values = _flatten(data)
    if tensor.datatype == "BYTES":
        if not all(isinstance(v, str) for v in values):
            raise HttpError(400, f"input {tensor.name}: BYTES data must be strings")
        tensor.contents.bytes_contents.extend(v.encode() for v in values)
    elif tensor.datatype == "INT64":
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            raise HttpError(400, f"input {tensor.name}: INT64 data must be integers")
        try:
            tensor.contents.int64_contents.extend(values)
        except ValueError:
            raise HttpError(400, f"input {tensor.name}: a value is out of the INT64 range") from None


def _flatten(data: Any) -> list[Any]:
    if not isinstance(data, list):
        return [data]
    out: list[Any] = []
    for item in data:
        out.extend(_flatten(item))  # depth is bounded by read_json's MAX_JSON_DEPTH
    return out


def _parameters(values: dict[str, Any]) -> dict[str, service_pb2.InferParameter]:
    try:
        return json_parameters(values)
    except SpecdecError as exc:
        raise HttpError(400, exc.message) from None


def _typed(value: Any, kind: type, what: str, wanted: str) -> Any:
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise HttpError(400, f"{what} must be {wanted}, got {json.dumps(value)[:80]}")
    return value


def response_json(response: service_pb2.ModelInferResponse, binary: set[str] | bool) -> tuple[dict, bytes]:
    """The gRPC door's response as the REST body's JSON part, and the binary data that follows it."""
    header: dict[str, Any] = {"model_name": response.model_name, "model_version": response.model_version}
    if response.id:
        header["id"] = response.id
    header["parameters"] = {key: getattr(p, p.WhichOneof("parameter_choice")) for key, p in response.parameters.items()}
    outputs, tail = [], b""
    for tensor, raw in zip(response.outputs, response.raw_output_contents, strict=True):
        out: dict[str, Any] = {"name": tensor.name, "datatype": tensor.datatype, "shape": list(tensor.shape)}
        if binary is True or (binary and tensor.name in binary):
            out["parameters"] = {BINARY_SIZE: len(raw)}
            tail += raw
        elif tensor.datatype == "BYTES":
            out["data"] = [value.decode("utf-8", errors="replace") for value in split_bytes(raw)]
        else:
            out["data"] = np.frombuffer(raw, NUMPY_TYPES[tensor.datatype]).tolist()
        outputs.append(out)
    header["outputs"] = outputs
    return header, tail
