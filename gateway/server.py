"""The GatewayService: prepares each request once (`decoding.request.prepare`) and runs `decode()`
through the gateway's peers.

`decode()` is synchronous; each request runs it on a worker thread over the sessions of the verifier
and drafter pools (`gateway.peers.pools`: replica sets, or a Triton-hosted verifier), so the event
loop only moves messages. Each session goes to the replica with the most free sessions, and a request
whose replica fails goes on at another one from the tokens already committed (`gateway.peers.failover`);
with no drafter replica left it goes on as plain AR through the verifier (`stats.degraded`). For the
lossless modes both give the same output.

The metrics live in `gateway.metrics`, admission control in `gateway.admission`, the KServe v2
endpoint in `gateway.kserve` and the HTTP endpoints in `gateway.web` (which call `answer` and
`stream`, over `run`).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import structlog

from core.errors import SpecdecError, StatusCode
from core.wire import source_len_from_wire, target_len_from_wire
from decoding.config import DecodingConfig
from decoding.policies.loop import Block, DecodeResult, OnTokens, drafted_count
from decoding.report import TextStream
from decoding.request import ModelLimits, Policy, Prepared, Request, check_input_size, prepare
from gateway import kserve
from gateway.admission import Admission, AdmissionQueue, Budget, sessions_needed
from gateway.arrivals import CallArrivals
from gateway.config import GatewayConfig
from gateway.context import Answer, GrpcContext, RequestContext
from gateway.metrics import GatewayMetrics
from gateway.peers.failover import Peers, decode_with_failover
from gateway.peers.pools import drafter_pool, verifier_pool
from gateway.peers.remote import (
    CallOptions,
    Cancellation,
    RemoteCallError,
    RequestCancelled,
    RequestDeadlineExceeded,
)
from gateway.peers.startup import StartupWait
from gateway.web.server import HttpServer
from gateway.wire import hypotheses_to_wire, overrides_from_wire, stats_to_wire
from protos.specdec.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from seq2seq_models.tokenizer import Tokenizer
from serving.auth import BearerTokenInterceptor, read_token
from serving.host import ServiceHost
from serving.metrics import Registry
from serving.status import grpc_code
from serving.tls import ServerTLS, peer_tls

# How close to its deadline a request must be for an unexplained end of its RPC to count as the deadline.
_DEADLINE_SLACK_S = 0.02
# Stopping after the drain grace: how long the UNAVAILABLE answers of cancelled requests may take to
# be sent, and how long cancelled workers may take to return (their peer calls are cancelled at once).
_STOP_FLUSH_S = 0.5
_WORKERS_STOP_S = 2.0
SERVICE_NAME = gateway_pb2.DESCRIPTOR.services_by_name["GatewayService"].full_name


async def start_gateway(config: GatewayConfig, tokenizer: Tokenizer) -> GatewayServer:
    """Check the peers (vocabulary, tokenizer fingerprint), start serving, report SERVING."""
    server = GatewayServer(config, tokenizer)
    try:
        await server.start_peers()
        await asyncio.get_running_loop().run_in_executor(None, server.check_peers)
        await server.host.start(config.address, config.metrics_address, ServerTLS.of(config))
        if server.http is not None and config.http_address:
            await server.http.start(config.http_address, ServerTLS.of(config))
    except BaseException:
        # Cancelled (SIGTERM while waiting for a peer) or failed: the waiting thread gives up at its
        # next poll, and nothing of a gateway that did not start stays open.
        server.abandon_start.set()
        await server.host.server.stop(0)
        if server.http is not None:
            await server.http.stop()
        await server.close_peers()
        raise
    await server.host.set_serving()
    return server


class GatewayServer(gateway_pb2_grpc.GatewayServiceServicer):
    def __init__(self, config: GatewayConfig, tokenizer: Tokenizer) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.log = structlog.get_logger(service="gateway")
        tls = peer_tls(config)
        self.registry = Registry()
        self.metrics = GatewayMetrics(self.registry)
        # The verifier pool: replicas, or the Triton-hosted verifier; the drafter pool, checked
        # against the verifier once it is known (gateway.peers.pools).
        self.verifiers = verifier_pool(config, tls, self._check_verifier, self.metrics)
        self.drafters = drafter_pool(config, tls, self.metrics, lambda: self.verifier_info)
        self.peers = Peers(config, self.metrics, self.verifiers, self.drafters)
        self.loop = asyncio.get_running_loop()
        self.verifier_info: common_pb2.ModelInfo | None = None
        # How this door prepares requests: a drafter mode without a drafter is the fallback's to
        # answer (gateway.peers.failover), so preparing never refuses it.
        self.policy = Policy(config.defaults, config.limits, config.max_text_chars,
                             fresh_seed=not config.seed_from_defaults, has_drafter=True)
        # Requests whose handler is running, by their cancel switch: what a drain waits for and,
        # once its grace is over, cancels.
        self._inflight: set[Cancellation] = set()
        self._stopping = False
        self.abandon_start = threading.Event()  # set: check_peers stops waiting for the peers
        self.pool = ThreadPoolExecutor(max_workers=config.workers, thread_name_prefix="gateway-decode")
        self.admission = Admission(
            AdmissionQueue(self._budget, config.max_queued, config.max_per_client),
            self.metrics.admission_changed,
            on_admitted=self.metrics.queue_wait.observe,
        )
        token = read_token(config.auth_token, config.auth_token_file)
        auth = [BearerTokenInterceptor(token)] if token else []
        # What the drain watches before it closes the listener (gateway.arrivals says why).
        self.arrivals = CallArrivals()
        self.host = ServiceHost(
            "gateway", [SERVICE_NAME, kserve.SERVICE_NAME], self.registry, interceptors=[self.arrivals, *auth],
            max_message_bytes=config.max_request_bytes,
        )
        gateway_pb2_grpc.add_GatewayServiceServicer_to_server(self, self.host.server)
        # KServe v2 / Open Inference Protocol on the same port, through the same request path (`run`).
        kserve.add_kserve_servicer(self, config.kserve_model, self.host.server)
        # The HTTP endpoints on their own address, through the same request path too (gateway.web).
        self.http = HttpServer(self, config, token, _STOP_FLUSH_S) if config.http_address else None

    def ready(self) -> bool:
        """Whether requests are taken: the verifier checked, not draining."""
        return self.verifier_info is not None and not self.host.draining

    # ---- start-up and peers ----------------------------------------------------------------------

    async def start_peers(self) -> None:
        """Start finding and watching the verifier's places (on the event loop)."""
        await self.verifiers.start()

    def check_peers(self) -> None:
        """Wait for the verifier (checked against the tokenizer); then start the drafter pool,
        checked against it (a worker thread: the waits block)."""
        wait = StartupWait(self.config.startup_timeout_s, self.log, self.abandon_start)
        self.verifier_info = self.verifiers.wait_ready(wait)
        if self.drafters is not None:
            asyncio.run_coroutine_threadsafe(self.drafters.start(), self.loop).result()
            self.drafters.wait_ready(wait)

    def _check_verifier(self, info: common_pb2.ModelInfo) -> str | None:
        """Why a verifier replica may not serve this gateway (None: it may)."""
        if info.tokenizer_fingerprint != self.tokenizer.fingerprint:
            return "the verifier's tokenizer fingerprint differs from the gateway's bundle tokenizer"
        return None

    async def stop(self, grace: float | None = None) -> None:
        """Drain: new requests get UNAVAILABLE from the handler, in-flight ones get `grace` seconds
        (default `drain_grace_s`), then what is left is cancelled through its `Cancellation` and
        answered UNAVAILABLE, so no worker thread outlives the server (it would keep the process up)."""
        grace = self.config.drain_grace_s if grace is None else grace
        if self.host.draining:
            return
        loop = asyncio.get_running_loop()
        started = loop.time()
        await self.host.begin_drain(grace)
        # The listener stays open, so a new call reaches its handler, which answers UNAVAILABLE with
        # a reason; it closes once the notice is over, nothing is in flight and no call has arrived
        # for `drain_quiet_s`, or when the grace is over. Closing it while calls still arrive would
        # have grpc core end the ones without a handler yet CANCELLED (gateway.arrivals).
        notice = min(self.config.drain_notice_s, grace)
        quiet = self.arrivals.watch()
        while loop.time() - started < grace and (
            loop.time() - started < notice or self._inflight or quiet.quiet_for() < self.config.drain_quiet_s
        ):
            await asyncio.sleep(0.02)
        left = list(self._inflight)
        if left:
            self.log.warning("drain_grace_expired", cancelled=len(left))
        self._stopping = True
        for cancellation in left:
            cancellation.cancel()
        # A short grace lets answers out: those of the handlers just cancelled (UNAVAILABLE), and the
        # last message of a stream whose decoding has ended but which is still being sent (with no
        # grace grpc would cancel it: "Cancelling all calls"). stop() returns as soon as none is left.
        await self.host.finish_drain(_STOP_FLUSH_S)
        if self.http is not None:
            await self.http.stop()
        self.pool.shutdown(wait=False, cancel_futures=True)
        # A cancelled worker returns at its next peer call or block; wait (bounded) for it to be gone.
        deadline = loop.time() + _WORKERS_STOP_S
        while self.metrics.active.value() > 0 and loop.time() < deadline:
            await asyncio.sleep(0.02)
        await self.close_peers()

    async def close_peers(self) -> None:
        """Close the pools' channels and the worker pool."""
        self.pool.shutdown(wait=False, cancel_futures=True)
        await self.verifiers.close()
        if self.drafters is not None:
            await self.drafters.close()

    # ---- RPCs ----------------------------------------------------------------------------------

    async def Generate(self, request, context):
        answer = await self.answer(request, GrpcContext(context))
        self.metrics.latency.observe(answer.total_s, mode=answer.mode.value, rpc="Generate")
        return gateway_pb2.GenerateResponse(
            text=self.tokenizer.decode(answer.result.output_ids),
            output_ids=answer.result.output_ids,
            stats=stats_to_wire(answer.result.stats, answer.mode, answer.total_s),
            final=True,
            hypotheses=hypotheses_to_wire(answer.result, self.tokenizer.decode),
            token_logprobs=answer.result.token_logprobs,
        )

    async def GenerateStream(self, request, context):
        started = time.perf_counter()
        first_token_s: float | None = None  # time to the first message that carries tokens
        text = TextStream(self.tokenizer.decode)
        async with contextlib.aclosing(self.stream(request, GrpcContext(context), started)) as events:
            async for event in events:
                if isinstance(event, Answer):
                    break
                if first_token_s is None and event:
                    first_token_s = time.perf_counter() - started
                yield gateway_pb2.GenerateResponse(text=text.add(event), output_ids=list(event))
        tail, rest = text.finish(event.result.output_ids)
        if first_token_s is None and rest:
            first_token_s = time.perf_counter() - started
        # Both for streams that completed, when the mode is known (a stream cut short has no final stats).
        self.metrics.latency.observe(event.total_s, mode=event.mode.value, rpc="GenerateStream")
        if first_token_s is not None:
            self.metrics.ttft.observe(first_token_s, mode=event.mode.value)
        yield gateway_pb2.GenerateResponse(
            text=tail, output_ids=rest, stats=stats_to_wire(event.result.stats, event.mode, event.total_s), final=True,
            hypotheses=hypotheses_to_wire(event.result, self.tokenizer.decode),
            token_logprobs=event.result.token_logprobs,
        )

    async def answer(self, request: gateway_pb2.GenerateRequest, context: RequestContext) -> Answer:
        """One request answered whole (Generate, KServe's ModelInfer, the HTTP doors)."""
        cancellation = Cancellation()

        def on_tokens(block: list[int]) -> None:
            cancellation.check()

        return await self.run(request, context, on_tokens, cancellation)

    async def stream(
        self, request: gateway_pb2.GenerateRequest, context: RequestContext, started: float | None = None
    ) -> AsyncIterator[Any]:
        """One request's committed blocks as they come (each a `decoding.policies.loop.Block` or a
        plain list: `drafted_count` says which of its tokens were drafted), then its `Answer`. The
        streaming doors (GenerateStream, the HTTP event streams) run it; closing it early (the client
        is gone) cancels the decode."""
        loop = asyncio.get_running_loop()
        chunks: asyncio.Queue[list[int]] = asyncio.Queue()
        cancellation = Cancellation()

        def on_tokens(block: list[int]) -> None:
            cancellation.check()
            copy = Block(block, drafted_count(block))  # the worker's list is not shared with the loop
            loop.call_soon_threadsafe(chunks.put_nowait, copy)

        task = asyncio.ensure_future(
            self.run(request, context, on_tokens, cancellation, streaming=True, started=started)
        )
        getter: asyncio.Future | None = None
        try:
            while True:
                getter = asyncio.ensure_future(chunks.get())
                await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():
                    getter.cancel()
                    if chunks.empty():
                        break
                    block = chunks.get_nowait()
                else:
                    block = getter.result()
                yield block
            yield task.result()
        finally:
            # Client gone or done: stop the worker now (its peer calls are cancelled too). When the
            # generator is left without being closed (a cancel that lands while grpc sends a message),
            # the call's done callback in `run` does the same.
            cancellation.cancel()
            if not task.done():
                task.cancel()
            # A stream cut short leaves its wait for the next block pending: ended here, it does not
            # outlive the call (a pending task that is garbage-collected is logged as destroyed).
            if getter is not None and not getter.done():
                getter.cancel()
            # Nobody awaits the task after this: take its outcome so none is left unretrieved.
            task.add_done_callback(_consume)

    # ---- one request -----------------------------------------------------------------------------

    async def run(
        self, request: gateway_pb2.GenerateRequest, context: RequestContext, on_tokens: OnTokens,
        cancellation: Cancellation, streaming: bool = False, started: float | None = None,
    ) -> Answer:
        """The request path of every door: prepare, admit, decode on a worker (failing over between
        places), with the deadline, cancellation (the call's end cancels the decode), metrics and logs;
        a failure ends the call through `context.abort` with its status."""
        request_id = context.request_id()
        structlog.contextvars.bind_contextvars(request_id=request_id)
        log = self.log.bind(request_id=request_id)
        # The request's clock: from when its door got it (`started`, so that a stream's time to first
        # token and its whole time share one origin), else from here.
        started = time.perf_counter() if started is None else started
        # However the RPC ends (cancel, deadline, a dead client, or done), the worker stops with it.
        context.add_done_callback(cancellation.cancel)
        self._inflight.add(cancellation)
        try:
            if self.host.draining:
                raise SpecdecError(StatusCode.UNAVAILABLE, "the gateway is draining")
            prepared = await self._prepare(request)
            source, config, first = prepared.source, prepared.config, prepared.first
            remaining = context.time_remaining()
            deadline = time.monotonic() + (remaining if remaining is not None else self.config.request_timeout_s)
            options = CallOptions(
                deadline=deadline, request_id=request_id, cancellation=cancellation, streaming=streaming
            )
            need = sessions_needed(config, self.drafters is not None)
            async with self.admission.slot(context.client(), need, deadline - time.monotonic()):
                result = await self._submit(source, config, options, on_tokens, log, first)
        except asyncio.CancelledError:
            # grpc cancels the handler when the client cancels or its deadline passes.
            cancellation.cancel()
            self._count_gone(context, log)
            raise
        except RequestCancelled:
            if self._stopping and not context.done():
                # Cancelled by the drain, not by its client: tell the client why.
                self.metrics.errors.inc(code=StatusCode.UNAVAILABLE.value)
                log.info("request_cancelled_by_shutdown")
                await context.abort(grpc.StatusCode.UNAVAILABLE, "the gateway shut down before the request finished")
            # The RPC already ended (the done callback or the stream's end cancelled the work).
            self._count_gone(context, log)
            raise asyncio.CancelledError() from None
        except RequestDeadlineExceeded as exc:
            self.metrics.deadline.inc()
            log.info("request_deadline_exceeded", message=exc.message)
            await _abort(context, grpc.StatusCode.DEADLINE_EXCEEDED, exc.message)
        except SpecdecError as exc:
            self.metrics.errors.inc(code=exc.code.value)
            log.info("request_refused", code=exc.code.value, message=exc.message)
            await _abort(context, grpc_code(exc.code), exc.message)
        except RemoteCallError as exc:
            self.metrics.errors.inc(code=exc.code.name)
            log.error("peer_failed", peer=exc.peer, code=exc.code.name, details=exc.details)
            await _abort(context, exc.code, str(exc))
        finally:
            self._inflight.discard(cancellation)
            structlog.contextvars.unbind_contextvars("request_id")
        total_s = time.perf_counter() - started
        self.metrics.record(result, config.mode, total_s)
        log.info(
            "request_done",
            mode=config.mode.value,
            input_tokens=len(source),
            output_tokens=len(result.output_ids),
            iterations=result.stats.iterations,
            degraded=result.stats.degraded,
            ms=round(total_s * 1e3, 2),
        )
        return Answer(result, config.mode, total_s, len(source))

    async def _submit(
        self,
        source: list[int],
        config: DecodingConfig,
        options: CallOptions,
        on_tokens: OnTokens,
        log,
        first: list[int],
    ) -> DecodeResult:
        """Decode on a worker thread. `gateway_active_requests` counts the request until its worker
        has really stopped (or never started), not just until the RPC ended."""
        self.metrics.active.inc()

        def work() -> DecodeResult:
            assert options.cancellation is not None
            options.cancellation.check()  # cancelled while queued: open no session at all
            return self._decode(source, config, options, on_tokens, log, first)

        try:
            future = self.pool.submit(work)
        except RuntimeError:  # the pool is shut down: the gateway is stopping
            self.metrics.active.inc(-1)
            raise SpecdecError(StatusCode.UNAVAILABLE, "the gateway is stopping") from None
        # Once whether it ran, failed or was dropped from the queue (a cancelled wait cancels it there).
        future.add_done_callback(lambda _: self.metrics.active.inc(-1))
        return await asyncio.wrap_future(future)

    def _count_gone(self, context: RequestContext, log) -> None:
        """A request whose RPC ended without an answer: its deadline passed, or the client cancelled."""
        remaining = context.time_remaining()
        # grpc reports neither cause to the handler; a cancel that comes within a few ms of the
        # deadline is the deadline (the server's timer and the clock read here differ by that much).
        if remaining is not None and remaining <= _DEADLINE_SLACK_S:
            self.metrics.deadline.inc()
            log.info("request_deadline_exceeded")
        else:
            self.metrics.cancelled.inc()
            log.info("request_cancelled")

    async def _prepare(self, request: gateway_pb2.GenerateRequest) -> Prepared:
        """`decoding.request.prepare`; a text is tokenised off the event loop, once its size passed."""
        assert self.verifier_info is not None
        info = self.verifier_info
        model = ModelLimits(info.vocab_size, source_len_from_wire(info.max_source_len),
                            target_len_from_wire(info.max_target_len))
        wanted = Request(text=request.text, input_ids=request.input_ids, overrides=overrides_from_wire(request.config),
                         target_lang=request.target_lang, target_prefix=request.target_prefix,
                         target_prefix_ids=request.target_prefix_ids)
        if not wanted.text:
            return prepare(wanted, model, self.policy, self.tokenizer)
        check_input_size(wanted, model, self.policy)  # a text over the limit is never tokenised
        return await asyncio.get_running_loop().run_in_executor(
            self.pool, prepare, wanted, model, self.policy, self.tokenizer
        )

    def _decode(
        self, source, config: DecodingConfig, options: CallOptions, on_tokens: OnTokens, log, first: list[int]
    ) -> DecodeResult:
        """Worker thread: decode through the pools, failing over between places (gateway.peers.failover)."""
        return decode_with_failover(self.peers, source, config, options, on_tokens, log, first)

    def _budget(self) -> Budget:
        """What admission may hand out: the workers, and the sessions of the usable places (0: unknown)."""
        drafter_sessions = 0 if self.drafters is None else self.drafters.session_budget()
        return Budget(self.config.workers, self.verifiers.session_budget(), drafter_sessions)


def _consume(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()


async def _abort(context: RequestContext, code: grpc.StatusCode, details: str) -> None:
    """Abort the RPC with a status; when it has already ended (cancelled, deadline) there is no one
    to tell, and aborting a finished RPC would only raise, so end the handler quietly."""
    if context.done():
        raise asyncio.CancelledError()
    await context.abort(code, details)
