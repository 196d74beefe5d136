"""The gateway's optional bearer-token check: a grpc.aio server interceptor, so it runs before any
handler does work and the servicer does not change (docs/deploy.md, "Security")."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc

AUTHORIZATION_KEY = "authorization"
BEARER = "Bearer "
# Health stays open: load balancers and orchestrators probe it without credentials.
HEALTH_PREFIX = "/grpc.health.v1.Health/"

MISSING_TOKEN = "missing bearer token: send 'authorization: Bearer <token>' metadata"
WRONG_TOKEN = "invalid bearer token"


def bearer_metadata(token: str) -> tuple[str, str]:
    """The metadata pair a client sends."""
    return (AUTHORIZATION_KEY, BEARER + token)


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED, with a message, for every RPC but health without `authorization: Bearer <token>`."""

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("the bearer token must not be empty")
        self._token = token

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if details.method.startswith(HEALTH_PREFIX):
            return handler
        refusal = self._refusal(details.invocation_metadata or ())
        return handler if refusal is None else _refusing(handler, refusal)

    def _refusal(self, metadata) -> str | None:
        values = [value for key, value in metadata if key == AUTHORIZATION_KEY]
        if not values:
            return MISSING_TOKEN
        value = values[0] if isinstance(values[0], str) else values[0].decode(errors="replace")
        if not value.startswith(BEARER):
            return MISSING_TOKEN
        return None if token_matches(value[len(BEARER) :], self._token) else WRONG_TOKEN


def token_matches(given: str, token: str) -> bool:
    """Whether a client's token (after `Bearer `) is the configured one: compared in constant time,
    so the answer's timing does not reveal how much of a guess was right (gRPC and HTTP alike)."""
    return hmac.compare_digest(given.strip().encode(), token.encode())


def _refusing(handler: grpc.RpcMethodHandler | None, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that only aborts: the request is not decoded further
    than gRPC must and the servicer never runs."""

    async def refuse(_request, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    if handler is None:  # an unknown method: say nothing about which exist to an unauthenticated caller
        return grpc.unary_unary_rpc_method_handler(refuse)
    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    make = kinds[(handler.request_streaming, handler.response_streaming)]
    return make(
        refuse, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
    )


def read_token(token: str | None, token_file: str | None) -> str | None:
    """The configured token: `token` itself, or the first line of `token_file` (a file keeps it out of
    the process list and the environment); None: no check."""
    if token_file:
        token = Path(token_file).read_text().strip()
        if not token:
            raise ValueError(f"{token_file}: the token file is empty")
    return token or None
