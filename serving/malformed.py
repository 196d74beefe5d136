"""Malformed request bytes -> INVALID_ARGUMENT with a message and a log line, on every service.

grpc.aio parses a request with the handler's `request_deserializer` before (unary) or while
(streaming) the servicer runs; a `DecodeError` there ends the call as UNKNOWN with nothing in our
logs, and no servicer code can catch it. So this interceptor wraps each method handler: its
deserializer never raises but returns a `_Malformed` marker, and its behaviour aborts with
INVALID_ARGUMENT when it meets one (the request of a unary call, or the message of a stream where
it arrives, after the messages before it were served).
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import structlog

from serving.status import request_id_of


class _Malformed:
    """What the wrapped deserializer returns for bytes that do not parse."""

    def __init__(self, message: str) -> None:
        self.message = message


class MalformedRequests(grpc.aio.ServerInterceptor):
    def __init__(self, service: str) -> None:
        self.log = structlog.get_logger(service=service)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        method = handler_call_details.method
        parse = handler.request_deserializer

        def deserialize(data: bytes) -> Any:
            try:
                return parse(data)
            except Exception as exc:  # DecodeError, and whatever else a parser raises for bad bytes
                return _Malformed(_describe(exc))

        async def refuse(bad: _Malformed, context: grpc.aio.ServicerContext) -> None:
            self.log.warning("malformed_request", method=method, request_id=request_id_of(context), error=bad.message)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, bad.message)

        async def checked(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            async for request in requests:
                if isinstance(request, _Malformed):
                    await refuse(request, context)
                yield request

        if handler.unary_unary is not None:
            inner_uu = handler.unary_unary

            async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                if isinstance(request, _Malformed):
                    await refuse(request, context)
                return await inner_uu(request, context)

            return handler._replace(request_deserializer=deserialize, unary_unary=unary_unary)
        if handler.unary_stream is not None:
            inner_us = handler.unary_stream

            async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                if isinstance(request, _Malformed):
                    await refuse(request, context)
                async for response in inner_us(request, context):
                    yield response

            async def unary_stream_writing(request: Any, context: grpc.aio.ServicerContext) -> None:
                if isinstance(request, _Malformed):
                    await refuse(request, context)
                await inner_us(request, context)

            # A handler that writes its answers with `context.write` (the health service's Watch) is a
            # coroutine, not an async generator, and grpc refuses a mix of the two styles.
            wrapped = unary_stream if inspect.isasyncgenfunction(inner_us) else unary_stream_writing
            return handler._replace(request_deserializer=deserialize, unary_stream=wrapped)
        if handler.stream_unary is not None:
            inner_su = handler.stream_unary

            async def stream_unary(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
                return await inner_su(checked(requests, context), context)

            return handler._replace(request_deserializer=deserialize, stream_unary=stream_unary)
        inner_ss = handler.stream_stream

        async def stream_stream(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            async for response in inner_ss(checked(requests, context), context):
                yield response

        return handler._replace(request_deserializer=deserialize, stream_stream=stream_stream)


def _describe(exc: Exception) -> str:
    # protobuf's message already names the type: "Error parsing message with type 'specdec.v1.X': ..."
    text = str(exc) or type(exc).__name__
    prefix = "Error parsing message with type '"
    if text.startswith(prefix) and "': " in text:
        name, _, why = text[len(prefix) :].partition("': ")
        return f"malformed {name} message: {why}"
    return f"malformed request message: {text}"
