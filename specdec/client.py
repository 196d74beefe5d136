"""`specdec generate`: one call to a running gateway; `--json` prints `specdec decode`'s record."""

from __future__ import annotations

import json
import uuid
from typing import Any

import grpc

from core.errors import SpecdecError, StatusCode
from serving.auth import bearer_metadata
from serving.channels import channel_options
from serving.status import REQUEST_ID_KEY, specdec_code
from serving.tls import ClientTLS, open_channel


class CallError(RuntimeError):
    """A gRPC status outside specdec's own codes (UNAUTHENTICATED, UNIMPLEMENTED, ...): `code` is its name."""

    def __init__(self, code: str, details: str) -> None:
        super().__init__(f"{code}: {details}")
        self.code = code
        self.details = details


def generate(
    address: str,
    text: str,
    overrides: dict[str, Any],
    timeout: float | None = None,
    input_ids: list[int] | None = None,
    request_id: str | None = None,
    tls: ClientTLS | None = None,
    token: str | None = None,
    target_lang: str = "",
) -> dict[str, Any]:
    """Generate once; returns {"output_ids", "text", "stats"} as `specdec decode` prints it.
    `tls`: connect over TLS (None: plaintext); `token`: the gateway's bearer token; `target_lang`:
    a many-to-many model's target language code (empty: the model's default)."""
    from gateway.wire import overrides_to_wire, stats_dict
    from protos.specdec.v1 import gateway_pb2, gateway_pb2_grpc

    request = gateway_pb2.GenerateRequest(
        text=text, input_ids=input_ids or [], config=overrides_to_wire(overrides), target_lang=target_lang
    )
    metadata = [(REQUEST_ID_KEY, request_id or uuid.uuid4().hex)]
    if token:
        metadata.append(bearer_metadata(token))
    with open_channel(address, tls, channel_options()) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        try:
            response = stub.Generate(request, timeout=timeout, metadata=metadata)
        except grpc.RpcError as exc:
            details = exc.details() or ""
            if exc.code() == grpc.StatusCode.UNAVAILABLE and _NOT_REACHED in details:
                raise SpecdecError(
                    StatusCode.UNAVAILABLE,
                    f"the gateway at {address} is not reachable ({details}); is it running? Start one with "
                    "`specdec serve all`, or point --addr / $SPECDEC_ADDR at it",
                ) from None
            code = specdec_code(exc.code())
            if code is None:
                raise CallError(exc.code().name, details) from None
            raise SpecdecError(code, details) from None
    return {"output_ids": list(response.output_ids), "text": response.text, "stats": stats_dict(response.stats)}


def format_record(record: dict[str, Any], as_json: bool) -> str:
    return json.dumps(record, ensure_ascii=False) if as_json else record["text"]


def degraded_note(record: dict[str, Any]) -> str | None:
    """The line plain output adds (on stderr, apart from the text) when the gateway fell back to AR."""
    if not record["stats"].get("degraded"):
        return None
    return "degraded: the drafter was unavailable, so the gateway decoded as plain AR through the verifier"


# How grpc words a call that never reached a server (connection refused, no such host, ...).
_NOT_REACHED = "failed to connect to all addresses"
