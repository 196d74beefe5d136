"""The gateway's HTTP application: one aiohttp application on the gateway's own event loop.

It serves KServe v2 REST (`gateway.web.kserve_rest`), OpenAI-style completions (`gateway.web.openai`),
LibreTranslate's /translate (`gateway.web.translate`) and the playground page (`gateway.web.playground`).
Every endpoint runs the gateway's request path (`GatewayServer.run` / `stream`) with an `HttpContext`,
so admission, limits, deadlines, cancellation and metrics are gRPC's; the listener shares the
gateway's TLS settings and bearer token, and closes with its drain.

aiohttp, because its server runs on an asyncio loop it is given: the gateway's grpc.aio server and
this listener share one loop and one request path, with no second server thread or event loop.
A client that disconnects cancels its handler (`handler_cancellation`), which cancels the decode.

Errors: a request that fails ends with `HttpError` (an HTTP status and a message); each protocol's
body is chosen by path (OpenAI's `{"error": {"message", "type", "param", "code"}}` under /v1, else
KServe's and LibreTranslate's `{"error": "..."}`). A bug is a 500 with a one-line message, logged
with its traceback, never sent.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, NoReturn

import grpc
import structlog
from aiohttp import web

from gateway.admission import CLIENT_ID_KEY
from serving.auth import BEARER, MISSING_TOKEN, WRONG_TOKEN, token_matches
from serving.status import REQUEST_ID_KEY
from serving.tls import ServerTLS, is_loopback

# A JSON body nested deeper than this is refused before any field is read: no endpoint's request is
# more than a few levels deep.
MAX_JSON_DEPTH = 16
# gRPC status -> HTTP status, for the errors the request path ends a call with.
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
# Paths anyone may read without the bearer token: health (probes carry no credentials) and the
# playground page itself (it holds no data; the requests it sends need the token).
OPEN_PATHS = ("/v2/health/", "/favicon.ico")
OPEN_EXACT = ("/",)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
log = structlog.get_logger(service="gateway")


class HttpError(Exception):
    """End an HTTP request with `status` and `message`; `param` names the request field at fault and
    `code` is a short machine-readable reason (both in OpenAI's error body)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    @classmethod
    def of(cls, code: grpc.StatusCode, message: str) -> HttpError:
        return cls(HTTP_STATUS.get(code, 500), message, code=code.name.lower())


class HttpContext:
    """An HTTP request as a `gateway.context.RequestContext`: the request id and client key from its
    headers (`x-request-id`, `x-client-id`) else a fresh id and the peer's address; no deadline of
    its own (the gateway's request_timeout_s); ended when the handler returns or the client is gone."""

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self._request_id = request.headers.get(REQUEST_ID_KEY) or uuid.uuid4().hex
        self._ended = False
        self._callbacks: list[Callable[[], None]] = []

    def request_id(self) -> str:
        return self._request_id

    def client(self) -> str:
        given = self.request.headers.get(CLIENT_ID_KEY)
        return given[:128] if given else (self.request.remote or "unknown")

    def time_remaining(self) -> float | None:
        return None

    def add_done_callback(self, callback: Callable[[], None]) -> None:
        self._callbacks.append(callback)

    def done(self) -> bool:
        transport = self.request.transport
        return self._ended or transport is None or transport.is_closing()

    async def abort(self, code: grpc.StatusCode, message: str) -> NoReturn:
        raise HttpError.of(code, message)

    def end(self) -> None:
        """The handler is done (or cancelled): run the done callbacks once."""
        if not self._ended:
            self._ended = True
            for callback in self._callbacks:
                callback()


def handler(run: Callable[[web.Request, HttpContext], Awaitable[web.StreamResponse]]) -> Handler:
    """An aiohttp handler that gives `run` an `HttpContext`, ended however the handler ends."""

    async def handle(request: web.Request) -> web.StreamResponse:
        context = HttpContext(request)
        try:
            response = await run(request, context)
        finally:
            context.end()
        response.headers.setdefault(REQUEST_ID_KEY, context.request_id())
        return response

    return handle


async def read_json(request: web.Request) -> dict[str, Any]:
    """The request's body as a JSON object: 413 past the size limit, 400 when it is not JSON, is
    nested too deeply, or is not an object."""
    return json_object(await read_body(request))


async def read_body(request: web.Request) -> bytes:
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge as exc:
        raise HttpError(413, f"the request body is over the limit of {request.client_max_size} bytes "
                             "([gateway] max_request_bytes)") from exc


def json_object(body: bytes) -> dict[str, Any]:
    try:
        value = json.loads(body)
    except RecursionError:
        raise HttpError(400, f"malformed JSON: nested deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as exc:  # JSONDecodeError, and UnicodeDecodeError for bytes that are not UTF-8
        raise HttpError(400, f"malformed JSON: {exc}") from None
    check_depth(value)
    if not isinstance(value, dict):
        raise HttpError(400, f"the body must be a JSON object, got {type(value).__name__}")
    return value


def check_depth(value: Any) -> None:
    """400 when a parsed JSON value nests deeper than MAX_JSON_DEPTH (walked without recursion)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children: Iterable[Any] = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        for child in children:
            if isinstance(child, dict | list):
                if depth + 1 > MAX_JSON_DEPTH:
                    raise HttpError(400, f"malformed JSON: nested deeper than {MAX_JSON_DEPTH} levels")
                stack.append((child, depth + 1))


async def run_all(calls: list[Awaitable[Any]]) -> list[Any]:
    """Every call's result, in order; the first failure is raised once the others are cancelled (a
    request's choices or texts are answered together or not at all)."""
    tasks = [asyncio.ensure_future(call) for call in calls]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def json_response(body: Any, status: int = 200) -> web.Response:
    return web.json_response(body, status=status, dumps=_dumps)


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


# ---- the application -----------------------------------------------------------------------------


def error_body(path: str, error: HttpError) -> dict[str, Any]:
    """The protocol's error body for a request to `path`."""
    if path.startswith("/v1/"):
        return {"error": {"message": error.message, "type": _openai_type(error.status), "param": error.param,
                          "code": error.code}}
    return {"error": error.message}


def _openai_type(status: int) -> str:
    kinds = {401: "authentication_error", 403: "permission_error", 404: "not_found_error", 429: "rate_limit_error"}
    if status >= 500:
        return "server_error"
    return kinds.get(status, "invalid_request_error")


# A protocol's other way of sending the token (LibreTranslate's `api_key`): its paths and a reader.
KeyReader = Callable[[web.Request], Awaitable[str | None]]


def make_app(max_body_bytes: int, token: str | None, routes: Iterable[web.RouteDef],
             api_keys: tuple[tuple[str, ...], KeyReader] | None = None) -> web.Application:
    """The application: errors rendered per protocol, the bearer token checked (or, on `api_keys`'
    paths, the key their reader finds), `routes` served."""
    app = web.Application(client_max_size=max_body_bytes, middlewares=[_errors, _bearer(token, api_keys)])
    app.add_routes(list(routes))
    return app


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except HttpError as exc:
        return json_response(error_body(request.path, exc), exc.status)
    except web.HTTPException as exc:  # aiohttp's own: no route (404), wrong method (405), too large (413)
        if exc.status < 400:
            raise
        message = exc.text if exc.text and exc.text != f"{exc.status}: {exc.reason}" else exc.reason
        response = json_response(error_body(request.path, HttpError(exc.status, message)), exc.status)
        if "Allow" in exc.headers:
            response.headers["Allow"] = exc.headers["Allow"]
        return response
    except ConnectionError:
        raise  # the client is gone: nobody to answer
    except Exception:
        log.exception("http_handler_failed", path=request.path)
        return json_response(error_body(request.path, HttpError(500, "internal error (logged by the gateway)")), 500)


def _bearer(token: str | None, api_keys: tuple[tuple[str, ...], KeyReader] | None):
    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if token is None or request.path.startswith(OPEN_PATHS) or request.path in OPEN_EXACT:
            return await handler(request)
        value = request.headers.get("Authorization", "")
        if not value and api_keys is not None and request.path in api_keys[0]:
            key = await api_keys[1](request)
            if key is None:
                raise HttpError(403, "Please contact the server operator to get an API key")
            if not token_matches(key, token):
                raise HttpError(403, "Invalid API key")
            return await handler(request)
        if not value.startswith(BEARER):
            raise HttpError(401, MISSING_TOKEN.replace("metadata", "header"), code="invalid_api_key")
        if not token_matches(value[len(BEARER):], token):
            raise HttpError(401, WRONG_TOKEN, code="invalid_api_key")
        return await handler(request)

    return check


class HttpListener:
    """The application on one address (HTTPS with the gateway's certificate when it has one)."""

    def __init__(self, app: web.Application, shutdown_s: float) -> None:
        self.runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=shutdown_s)
        self.port = 0

    async def start(self, address: str, tls: ServerTLS | None) -> int:
        host, _, port = address.rpartition(":")
        host = host.strip("[]") or "127.0.0.1"
        await self.runner.setup()
        site = web.TCPSite(self.runner, host, int(port), ssl_context=None if tls is None else tls.ssl_context())
        await site.start()
        self.port = self.runner.addresses[0][1]
        if tls is None and not is_loopback(host):
            log.warning("http_plaintext_beyond_loopback", address=address, hint="set tls_cert and tls_key")
        log.info("http_listening", address=address, port=self.port, tls=tls is not None)
        return self.port

    async def stop(self) -> None:
        """Close the listener and the connections; handlers still running after the shutdown time are cancelled."""
        await self.runner.cleanup()

