"""The gateway's KServe v2 / Open Inference Protocol endpoint (`inference.GRPCInferenceService`).

Served beside `specdec.v1.GatewayService` on the same port, so `tritonclient`, KServe clients and
Triton's tooling can call the stack. One model (default name `specdec`, `[gateway] kserve_model`):

- input `TEXT` (BYTES, one element) or `INPUT_IDS` (INT64, shape [N] or [1, N]);
- decoding settings as request parameters named as the CLI flags (`mode`: "gad", `k`: 10, `beta`,
  `tau`, `beams`, `max_new_tokens`, ...; dashes or underscores), valued as the flags are: numbers,
  or strings that parse as the flag's type;
- outputs `TEXT` (BYTES [1]) and `OUTPUT_IDS` (INT64 [N]); for beam search also its n-best list,
  `NBEST_TEXT` (BYTES [n]), `NBEST_OUTPUT_IDS` (INT64 [n, L], each hypothesis' ids padded with -1 to
  the longest) and `NBEST_SCORES` (FP64 [n]); with `output_logprobs`, `TOKEN_LOGPROBS` (FP32: each
  output token's log-prob, then the EOS's when one ended it); the decoding stats as response
  parameters. A request that names no outputs gets those its settings produce.

A request is translated into a `GenerateRequest` and run by the gateway's own request path
(`GatewayServer.answer`: admission, limits, deadline, cancellation, metrics), so it is validated and
answered with the same status codes as `Generate`. What only this protocol can get wrong (an unknown
model, a wrong datatype or shape, an unknown parameter) is INVALID_ARGUMENT, but an unknown model is
NOT_FOUND as Triton answers it.

The messages are tritonclient's compiled KServe stubs (`tritonclient.grpc.service_pb2`): the server
then speaks exactly the client's wire format, and a second copy of `grpc_service.proto` in our protos
would clash with tritonclient's in the one protobuf descriptor pool of any process that loads both.
tritonclient's grpc package needs only numpy, ml_dtypes, python-rapidjson and packaging (no torch).
"""

from __future__ import annotations

import struct
from collections.abc import AsyncIterator
from dataclasses import fields
from typing import Any, Protocol

import grpc
import numpy as np
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc

from core.errors import SpecdecError, invalid
from decoding.config import CHOICES, ID_LISTS, DecodingConfig, Mode, cli_flag, parse_choice, parse_ids, parse_mode
from decoding.policies.loop import DecodeResult
from gateway.context import Answer, GrpcContext, RequestContext
from gateway.metrics import GatewayMetrics
from gateway.wire import overrides_to_wire, stats_record
from protos.specdec.v1 import gateway_pb2
from seq2seq_models.tokenizer import Tokenizer
from serving.status import grpc_code

SERVICE_NAME = service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name
MODEL_VERSION = "1"
TEXT, INPUT_IDS, OUTPUT_IDS = "TEXT", "INPUT_IDS", "OUTPUT_IDS"
NBEST_TEXT, NBEST_OUTPUT_IDS, NBEST_SCORES = "NBEST_TEXT", "NBEST_OUTPUT_IDS", "NBEST_SCORES"
TOKEN_LOGPROBS = "TOKEN_LOGPROBS"
# Request parameters that are not decoding ones: a many-to-many model's target language code, and a
# target prefix as text or as ids (a string of integers, separated by spaces or commas).
TARGET_LANG, TARGET_PREFIX, TARGET_PREFIX_IDS = "target_lang", "target_prefix", "target_prefix_ids"
OUTPUTS = (TEXT, OUTPUT_IDS, NBEST_TEXT, NBEST_OUTPUT_IDS, NBEST_SCORES, TOKEN_LOGPROBS)
PLATFORM = "specdec"
# The model's tensors (name, datatype, shape), as its metadata and config describe them on both doors.
INPUT_TENSORS = ((TEXT, "BYTES", [1]), (INPUT_IDS, "INT64", [-1]))
OUTPUT_TENSORS = (
    (TEXT, "BYTES", [1]), (OUTPUT_IDS, "INT64", [-1]), (NBEST_TEXT, "BYTES", [-1]),
    (NBEST_OUTPUT_IDS, "INT64", [-1, -1]), (NBEST_SCORES, "FP64", [-1]), (TOKEN_LOGPROBS, "FP32", [-1]),
)
# A tensor datatype as the model config names it (model_config.proto's DataType), and the numeric
# ones' little-endian numpy types (raw contents).
CONFIG_TYPES = {"BYTES": "TYPE_STRING", "INT64": "TYPE_INT64", "FP64": "TYPE_FP64", "FP32": "TYPE_FP32"}
NUMPY_TYPES = {"INT64": "<i8", "FP64": "<f8", "FP32": "<f4"}
# Parameters a KServe/Triton client may send that are not decoding settings: accepted and ignored
# (the deadline travels as the gRPC deadline; the gateway has no priorities).
_IGNORED_PARAMETERS = {"priority", "timeout"}


def parameter_names() -> dict[str, str]:
    """Request parameter name -> DecodingConfig field: each flag without its dashes (`--beams` ->
    `beams`, `--max-new-tokens` -> `max_new_tokens`), and the field's own name."""
    names: dict[str, str] = {}
    for f in fields(DecodingConfig):
        names[cli_flag(f).lstrip("-").replace("-", "_")] = f.name
        names[f.name] = f.name
    return names


_PARAMETERS = parameter_names()
_TYPES = {f.name: f.type for f in fields(DecodingConfig)}


class RequestPath(Protocol):
    """What this endpoint needs of the gateway (`gateway.server.GatewayServer`)."""

    tokenizer: Tokenizer
    metrics: GatewayMetrics

    def ready(self) -> bool:
        """Whether the gateway takes requests (its verifier checked, not draining)."""
        ...

    async def answer(self, request: gateway_pb2.GenerateRequest, context: RequestContext) -> Answer:
        """Generate's request path (admission, limits, deadline, cancellation, metrics), answered whole."""
        ...

    def stream(self, request: gateway_pb2.GenerateRequest, context: RequestContext) -> AsyncIterator[Any]:
        """The same, streamed: committed blocks as they come, then the `Answer`."""
        ...


def add_kserve_servicer(gateway: RequestPath, model_name: str, server: grpc.aio.Server) -> None:
    """Register the KServe v2 servicer on the gateway's grpc server (same port, auth, limits)."""
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(KServeServicer(gateway, model_name), server)


class KServeServicer(service_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(self, gateway: RequestPath, model_name: str) -> None:
        self.gateway = gateway
        self.model_name = model_name

    # ---- health and metadata ---------------------------------------------------------------------

    async def ServerLive(self, request, context):
        return service_pb2.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return service_pb2.ServerReadyResponse(ready=self._ready())

    async def ServerMetadata(self, request, context):
        return service_pb2.ServerMetadataResponse(name="specdec", version="1", extensions=["parameters"])

    async def ModelReady(self, request, context):
        # As Triton: an unknown model is simply not ready (no error).
        return service_pb2.ModelReadyResponse(ready=self._known(request.name, request.version) and self._ready())

    async def ModelMetadata(self, request, context):
        await check_model(self.model_name, request.name, request.version, GrpcContext(context))
        tensor = service_pb2.ModelMetadataResponse.TensorMetadata
        return service_pb2.ModelMetadataResponse(
            name=self.model_name,
            versions=[MODEL_VERSION],
            platform=PLATFORM,
            inputs=[tensor(name=name, datatype=datatype, shape=shape) for name, datatype, shape in INPUT_TENSORS],
            outputs=[tensor(name=name, datatype=datatype, shape=shape) for name, datatype, shape in OUTPUT_TENSORS],
        )

    async def ModelConfig(self, request, context):
        await check_model(self.model_name, request.name, request.version, GrpcContext(context))
        mc = model_config_pb2
        config = mc.ModelConfig(
            name=self.model_name,
            platform=PLATFORM,
            max_batch_size=0,
            input=[mc.ModelInput(name=name, data_type=mc.DataType.Value(CONFIG_TYPES[datatype]), dims=shape,
                                 optional=True) for name, datatype, shape in INPUT_TENSORS],
            output=[mc.ModelOutput(name=name, data_type=mc.DataType.Value(CONFIG_TYPES[datatype]), dims=shape)
                    for name, datatype, shape in OUTPUT_TENSORS],
        )
        return service_pb2.ModelConfigResponse(config=config)

    # ---- inference -------------------------------------------------------------------------------

    async def ModelInfer(self, request: service_pb2.ModelInferRequest, context):
        return await infer(self.gateway, self.model_name, request, GrpcContext(context))

    # ---- helpers ---------------------------------------------------------------------------------

    def _ready(self) -> bool:
        return self.gateway.ready()

    def _known(self, name: str, version: str) -> bool:
        return known_model(self.model_name, name, version)


def known_model(model_name: str, name: str, version: str) -> bool:
    """Whether a request names this endpoint's model (any version, or ours)."""
    return name == model_name and version in ("", MODEL_VERSION)


async def check_model(model_name: str, name: str, version: str, context: RequestContext) -> None:
    """NOT_FOUND, naming the model this server has, when a request names another."""
    if not known_model(model_name, name, version):
        shown = f"{name!r}" + (f" version {version!r}" if version else "")
        await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown model {shown}; this server has {model_name!r}")


async def infer(
    gateway: RequestPath, model_name: str, request: service_pb2.ModelInferRequest, context: RequestContext
) -> service_pb2.ModelInferResponse:
    """ModelInfer on either door (gRPC here, REST in gateway.web.kserve_rest): the request checked and
    translated, run by the gateway's request path, its outputs (raw, as `raw_output_contents`) and
    stats (response parameters) in a ModelInferResponse."""
    await check_model(model_name, request.model_name, request.model_version, context)
    try:
        generate = generate_request(request)
        wanted = requested_outputs(request)
    except SpecdecError as exc:
        gateway.metrics.errors.inc(code=exc.code.value)
        await context.abort(grpc_code(exc.code), exc.message)
    answer = await gateway.answer(generate, context)
    response = service_pb2.ModelInferResponse(model_name=model_name, model_version=MODEL_VERSION, id=request.id)
    tensors = output_tensors(answer.result, gateway.tokenizer.decode)
    for name in wanted or default_outputs(answer.result):
        datatype, shape, raw = tensors[name]
        response.outputs.add(name=name, datatype=datatype, shape=shape)
        response.raw_output_contents.append(raw)
    _stats_parameters(response, answer.result.stats, answer.mode, answer.total_s)
    return response


def generate_request(request: service_pb2.ModelInferRequest) -> gateway_pb2.GenerateRequest:
    """The `GenerateRequest` a ModelInfer request stands for (INVALID_ARGUMENT when it has none)."""
    inputs = {t.name: i for i, t in enumerate(request.inputs)}
    unknown = set(inputs) - {TEXT, INPUT_IDS}
    if unknown or len(inputs) != len(request.inputs):
        raise invalid(f"inputs must be {TEXT} or {INPUT_IDS}, each once; got {[t.name for t in request.inputs]}")
    if len(inputs) != 1:
        raise invalid(f"set exactly one input, {TEXT} (BYTES) or {INPUT_IDS} (INT64)")
    (name, index), = inputs.items()
    tensor = request.inputs[index]
    raw = request.raw_input_contents[index] if request.raw_input_contents else None
    if request.raw_input_contents and len(request.raw_input_contents) != len(request.inputs):
        raise invalid("raw_input_contents must have one entry per input")
    config, target = settings(dict(request.parameters))
    if name == TEXT:
        return gateway_pb2.GenerateRequest(text=_text(tensor, raw), config=config, **target)
    return gateway_pb2.GenerateRequest(input_ids=_ids(tensor, raw), config=config, **target)


def settings(parameters: dict[str, service_pb2.InferParameter]) -> tuple[gateway_pb2.DecodingConfig, dict[str, Any]]:
    """Request parameters -> the request's decoding config (the settings named as the CLI flags) and
    its target fields as GenerateRequest's (`target_lang`, `target_prefix`, `target_prefix_ids`)."""
    parameters = dict(parameters)
    target: dict[str, Any] = {}
    for key in (TARGET_LANG, TARGET_PREFIX, TARGET_PREFIX_IDS):
        if key in parameters:
            target[key] = _target_string(key, parameters.pop(key))
    if TARGET_PREFIX_IDS in target:
        target[TARGET_PREFIX_IDS] = _id_list(target[TARGET_PREFIX_IDS])
    return overrides_to_wire(decoding_overrides(parameters)), target


def json_parameters(values: dict[str, Any]) -> dict[str, service_pb2.InferParameter]:
    """JSON values (the HTTP doors') as request parameters: a bool, an integer, a number or a string
    each (INVALID_ARGUMENT for anything else), converted by `settings` as the gRPC door's are."""
    out: dict[str, service_pb2.InferParameter] = {}
    for key, value in values.items():
        param = out[key] = service_pb2.InferParameter()
        if isinstance(value, bool):
            param.bool_param = value
        elif isinstance(value, int):
            if not -(2**63) <= value < 2**63:
                raise invalid(f"parameter {key!r}: {value} is outside the INT64 range")
            param.int64_param = value
        elif isinstance(value, float):
            param.double_param = value
        elif isinstance(value, str):
            param.string_param = value
        else:
            raise invalid(f"parameter {key!r} must be a string, a number or a bool, got {str(value)[:80]}")
    return out


def _target_string(key: str, param) -> str:
    """A target request parameter's string: a language code, a prefix, or a prefix's ids."""
    if param.WhichOneof("parameter_choice") != "string_param":
        what = {TARGET_LANG: "a language code such as fra_Latn", TARGET_PREFIX: "the output's first text",
                TARGET_PREFIX_IDS: "token ids separated by spaces or commas"}[key]
        raise invalid(f"parameter {key!r} must be a string ({what})")
    return param.string_param


def _id_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.replace(",", " ").split()]
    except ValueError:
        raise invalid(f"parameter {TARGET_PREFIX_IDS!r} must hold token ids separated by spaces or commas, "
                      f"got {text[:80]!r}") from None


def decoding_overrides(parameters) -> dict[str, Any]:
    """Request parameters -> DecodingConfig overrides, each converted to its field's type."""
    out: dict[str, Any] = {}
    for key, param in parameters.items():
        if key in _IGNORED_PARAMETERS:
            continue
        name = _PARAMETERS.get(key)
        if name is None:
            raise invalid(f"unknown decoding parameter {key!r}; known: {sorted(set(_PARAMETERS))}")
        out[name] = _convert(key, name, param)
    return out


def output_tensors(result: DecodeResult, decode_text: Any) -> dict[str, tuple[str, list[int], bytes]]:
    """Every output of `result`, as (datatype, shape, raw contents); the n-best ones are empty but for
    beam search."""
    ids = result.output_ids
    hypotheses = result.hypotheses
    longest = max((len(h.output_ids) for h in hypotheses), default=0)
    padded = np.full((len(hypotheses), longest), -1, "<i8")
    for row, h in zip(padded, hypotheses, strict=True):
        row[: len(h.output_ids)] = h.output_ids
    texts = b"".join(_bytes_tensor(decode_text(h.output_ids).encode()) for h in hypotheses)
    return {
        TEXT: ("BYTES", [1], _bytes_tensor(decode_text(ids).encode())),
        OUTPUT_IDS: ("INT64", [len(ids)], np.asarray(ids, "<i8").tobytes()),
        NBEST_TEXT: ("BYTES", [len(hypotheses)], texts),
        NBEST_OUTPUT_IDS: ("INT64", list(padded.shape), padded.tobytes()),
        NBEST_SCORES: ("FP64", [len(hypotheses)], np.asarray([h.score for h in hypotheses], "<f8").tobytes()),
        TOKEN_LOGPROBS: ("FP32", [len(result.token_logprobs)], np.asarray(result.token_logprobs, "<f4").tobytes()),
    }


def default_outputs(result: DecodeResult) -> list[str]:
    """The outputs of a request that names none: the output, a beam search's n-best list, and the
    log-probs when asked for."""
    names = [TEXT, OUTPUT_IDS]
    if result.hypotheses:
        names += [NBEST_TEXT, NBEST_OUTPUT_IDS, NBEST_SCORES]
    if result.token_logprobs:
        names.append(TOKEN_LOGPROBS)
    return names


def requested_outputs(request: service_pb2.ModelInferRequest) -> list[str]:
    """The outputs a request names (none: those its result has, `default_outputs`)."""
    names = [o.name for o in request.outputs]
    unknown = [n for n in names if n not in OUTPUTS]
    if unknown:
        raise invalid(f"unknown outputs {unknown}; this model has {list(OUTPUTS)}")
    return names


def _convert(key: str, name: str, param) -> Any:
    """A request parameter's value as DecodingConfig field `name` takes it."""
    kind = _TYPES[name]
    which = param.WhichOneof("parameter_choice")
    value = getattr(param, which) if which else None
    if value is None:
        raise invalid(f"parameter {key!r} has no value")
    if name in ID_LISTS:  # token ids as a string: "5 6 7", sequences "5 6; 7"
        if which != "string_param":
            raise invalid(f"parameter {key!r} must be a string of token ids (sequences separated by ;)")
        return parse_ids(name, value, ID_LISTS[name])
    if name in CHOICES:  # a string of its choices (early_stopping also as generate()'s booleans)
        if which not in ("string_param", "bool_param"):
            raise invalid(f"parameter {key!r} must be a string (one of {[m.value for m in CHOICES[name]]})")
        return parse_choice(name, CHOICES[name], value).value
    if kind == "bool":
        if which == "bool_param" or (which == "string_param" and value in ("true", "false")):
            return value is True or value == "true"
        raise invalid(f"parameter {key!r} must be a bool, got {value!r}")
    if which == "bool_param":  # never a number: True would silently be 1
        raise invalid(f"parameter {key!r} must be a {_kind_name(kind)}, not a bool")
    if "Mode" in kind:
        if which != "string_param":
            raise invalid(f"parameter {key!r} must be a string (one of {[m.value for m in Mode]})")
        return parse_mode(value).value
    try:
        if "int" in kind:
            if which == "double_param":
                raise ValueError
            return int(value)
        return float(value)
    except ValueError:
        raise invalid(f"parameter {key!r} must be a {_kind_name(kind)}, got {value!r}") from None


def _kind_name(kind: str) -> str:
    return "integer" if "int" in kind else "number"


def _text(tensor, raw: bytes | None) -> str:
    if tensor.datatype != "BYTES":
        raise invalid(f"input {TEXT} must be BYTES, got {tensor.datatype}")
    elements = split_bytes(raw) if raw is not None else list(tensor.contents.bytes_contents)
    _check_shape(tensor, len(elements))
    if len(elements) != 1:
        raise invalid(f"input {TEXT} must hold one element (one text per request), got {len(elements)}")
    try:
        return elements[0].decode("utf-8")
    except UnicodeDecodeError:
        raise invalid(f"input {TEXT} is not valid UTF-8") from None


def _ids(tensor, raw: bytes | None) -> list[int]:
    if tensor.datatype != "INT64":
        raise invalid(f"input {INPUT_IDS} must be INT64, got {tensor.datatype}")
    if raw is not None:
        if len(raw) % 8:
            raise invalid(f"input {INPUT_IDS}: {len(raw)} bytes is not a whole number of INT64 values")
        ids = np.frombuffer(raw, "<i8").tolist()
    else:
        ids = list(tensor.contents.int64_contents)
    _check_shape(tensor, len(ids))
    if len(tensor.shape) > 2 or (len(tensor.shape) == 2 and tensor.shape[0] != 1):
        raise invalid(f"input {INPUT_IDS} must have shape [N] or [1, N], got {list(tensor.shape)}")
    return ids


def _check_shape(tensor, count: int) -> None:
    size = int(np.prod(tensor.shape)) if len(tensor.shape) else 1
    if any(d < 0 for d in tensor.shape) or size != count:
        raise invalid(f"input {tensor.name}: shape {list(tensor.shape)} does not match its {count} elements")


def split_bytes(raw: bytes) -> list[bytes]:
    """Triton's raw BYTES layout: each element is a 4-byte little-endian length, then its bytes."""
    out: list[bytes] = []
    at = 0
    while at < len(raw):
        if at + 4 > len(raw):
            raise invalid(f"input {TEXT}: truncated BYTES element length")
        (n,) = struct.unpack_from("<I", raw, at)
        at += 4
        if at + n > len(raw):
            raise invalid(f"input {TEXT}: a BYTES element runs past the tensor's end")
        out.append(raw[at : at + n])
        at += n
    return out


def _bytes_tensor(value: bytes) -> bytes:
    return struct.pack("<I", len(value)) + value


def _stats_parameters(response: service_pb2.ModelInferResponse, stats, mode: Mode, total_s: float) -> None:
    """The DecodingStats of `Generate`, named as there, as response parameters (lists as comma-separated
    strings)."""
    p = response.parameters
    for name, value in stats_record(stats, mode, total_s).items():
        if isinstance(value, bool):
            p[name].bool_param = value
        elif isinstance(value, int):
            p[name].int64_param = value
        elif isinstance(value, float):
            p[name].double_param = value
        elif isinstance(value, list):
            p[name].string_param = ",".join(str(n) for n in value)
        else:
            p[name].string_param = value
