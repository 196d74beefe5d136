"""Status codes and request ids across the wire: `SpecdecError` <-> gRPC status, and the request
id every service's logs carry (ARCHITECTURE.md, "Observability")."""

from __future__ import annotations

import uuid

import grpc

from core.errors import SpecdecError, StatusCode

# gRPC metadata key carrying the request id across gateway, drafter and verifier.
REQUEST_ID_KEY = "x-request-id"


def grpc_code(code: StatusCode) -> grpc.StatusCode:
    return grpc.StatusCode[code.value]


def specdec_code(code: grpc.StatusCode) -> StatusCode | None:
    try:
        return StatusCode(code.name)
    except ValueError:
        return None


def request_id_of(context: grpc.aio.ServicerContext) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == REQUEST_ID_KEY:
            return str(value)
    return uuid.uuid4().hex


async def abort_with(context: grpc.aio.ServicerContext, exc: SpecdecError) -> None:
    await context.abort(grpc_code(exc.code), exc.message)
