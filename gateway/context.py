"""The seam between the gateway's request path (`GatewayServer.run`) and its doors: what it needs of
the call it answers, whatever the protocol (`RequestContext`), and what it returns (`Answer`).

The context says who asks (the request id its logs carry, the client admission counts it against),
how long it may take, when the call ends (the decode is cancelled with it), and how to end it with a
status.

gRPC calls give it through `GrpcContext` (a grpc.aio ServicerContext); the HTTP listener has its own
(`gateway.web.app.HttpContext`). Statuses are gRPC's codes on every protocol: each door maps them
to its own (HTTP statuses, gateway.web.app).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn, Protocol

import grpc

from decoding.config import Mode
from decoding.policies.loop import DecodeResult
from gateway.admission import client_of
from serving.status import request_id_of


@dataclass(frozen=True)
class Answer:
    """A request's outcome: its decode result and mode, its time in the gateway (admission wait
    included) and its source's length in tokens."""

    result: DecodeResult
    mode: Mode
    total_s: float
    input_tokens: int


class RequestContext(Protocol):
    def request_id(self) -> str:
        """The id this request's log lines (and its peer calls) carry."""
        ...

    def client(self) -> str:
        """The key admission counts the request against (gateway.admission, "Fairness")."""
        ...

    def time_remaining(self) -> float | None:
        """Seconds left before the caller's deadline; None when it set none."""
        ...

    def add_done_callback(self, callback: Callable[[], None]) -> None:
        """Call `callback` once the call has ended, however it ended (answered, cancelled, the client gone)."""
        ...

    def done(self) -> bool:
        """Whether the call has ended (then nobody is left to answer)."""
        ...

    async def abort(self, code: grpc.StatusCode, message: str) -> NoReturn:
        """End the call with a status and a message (raises)."""
        ...


class GrpcContext:
    """A grpc.aio ServicerContext as a `RequestContext`."""

    def __init__(self, context: grpc.aio.ServicerContext) -> None:
        self.context = context

    def request_id(self) -> str:
        return request_id_of(self.context)

    def client(self) -> str:
        return client_of(self.context)

    def time_remaining(self) -> float | None:
        return self.context.time_remaining()

    def add_done_callback(self, callback: Callable[[], None]) -> None:
        self.context.add_done_callback(lambda _: callback())

    def done(self) -> bool:
        return self.context.done()

    async def abort(self, code: grpc.StatusCode, message: str) -> NoReturn:
        await self.context.abort(code, message)
        raise AssertionError("grpc's abort returned")  # it raises; this tells type checkers so
