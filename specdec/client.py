"""`specdec generate`: one call to a running gateway; `--json` prints `specdec decode`'s record."""

from __future__ import annotations

import json
import uuid
from typing import Any

import grpc

from core.errors import SpecdecError
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
) -> dict[str, Any]:
    """Generate once; returns {"output_ids", "text", "stats"} as `specdec decode` prints it.
    `tls`: connect over TLS (None: plaintext); `token`: the gateway's bearer token."""
    from gateway.wire import overrides_to_wire, stats_from_wire
    from protos.specdec.v1 import gateway_pb2, gateway_pb2_grpc

    request = gateway_pb2.GenerateRequest(text=text, input_ids=input_ids or [], config=overrides_to_wire(overrides))
    metadata = [(REQUEST_ID_KEY, request_id or uuid.uuid4().hex)]
    if token:
        metadata.append(bearer_metadata(token))
    with open_channel(address, tls, channel_options()) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        try:
            response = stub.Generate(request, timeout=timeout, metadata=metadata)
        except grpc.RpcError as exc:
            code = specdec_code(exc.code())
            if code is None:
                raise CallError(exc.code().name, exc.details() or "") from None
            raise SpecdecError(code, exc.details() or "") from None
    output_ids = list(response.output_ids)
    stats = stats_from_wire(response.stats, len(output_ids))
    return {"output_ids": output_ids, "text": response.text, "stats": stats.to_dict()}


def format_record(record: dict[str, Any], as_json: bool) -> str:
    return json.dumps(record, ensure_ascii=False) if as_json else record["text"]
