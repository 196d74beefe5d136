"""gRPC implementations of the `Verifier` / `Drafter` interfaces (`core.interfaces`).

Each session is one synchronous bidi stream driven step by step: a request queue feeds the
stream and every step waits for exactly one response. So the unchanged, synchronous `decode()`
runs over the network from a worker thread. Opening a session only sends the `open` message;
its answer is read at the first step, so the verifier's and the drafter's encoders run
concurrently (ARCHITECTURE.md section 8).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc

from core.errors import SpecdecError, StatusCode
from core.interfaces import BeamRow, Draft, VerifyResult
from core.sampling import SamplingParams
from core.wire import source_len_from_wire, target_len_from_wire
from protos.specdec.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from serving.status import REQUEST_ID_KEY, specdec_code


class RemoteCallError(Exception):
    """A peer failed with a status that is not the client's fault (INTERNAL, UNKNOWN, ...)."""

    def __init__(self, peer: str, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{peer}: {code.name}: {details}")
        self.peer = peer
        self.code = code
        self.details = details


class DrafterFailure(Exception):
    """The drafter is unreachable, failed or timed out; the gateway may fall back to AR."""

    def __init__(self, cause: Exception) -> None:
        super().__init__(f"drafter failed: {cause}")
        self.cause = cause


class RequestCancelled(Exception):
    """The request was cancelled (the client went away): stop; no peer is at fault."""


class RequestDeadlineExceeded(SpecdecError):
    """The request's own deadline passed during a peer call: the client's budget, not a peer failure.

    A drafter call that times out on the drafter's own, shorter cap is a `DrafterFailure` instead;
    only the request's deadline is reported as this, so one client's short deadlines cannot open
    the drafter retry window for everybody."""

    def __init__(self, peer: str, details: str) -> None:
        super().__init__(StatusCode.DEADLINE_EXCEEDED, f"deadline exceeded while waiting for the {peer}: {details}")


class Cancellation:
    """One request's cancel switch, shared by the event loop and the worker thread decoding it.

    `cancel()` sets the flag and cancels every peer call in flight, so a worker blocked in a verifier
    or drafter step returns at once (with `RequestCancelled`) instead of when the step ends."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._event = threading.Event()
        self._calls: set = set()

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()

    def cancel(self) -> None:
        with self._lock:
            self._event.set()
            calls, self._calls = list(self._calls), set()
        for call in calls:
            call.cancel()

    def check(self) -> None:
        if self._event.is_set():
            raise RequestCancelled()

    def track(self, call) -> None:
        with self._lock:
            if not self._event.is_set():
                self._calls.add(call)
                return
        call.cancel()
        raise RequestCancelled()

    def untrack(self, call) -> None:
        with self._lock:
            self._calls.discard(call)


@dataclass(frozen=True)
class CallOptions:
    """Per-request call settings: an absolute deadline (time.monotonic), the request id, and the
    request's cancel switch (None: calls are not cancellable from outside)."""

    deadline: float | None = None
    request_id: str = ""
    cancellation: Cancellation | None = field(default=None, compare=False)

    def timeout(self, cap: float | None = None) -> float | None:
        left = None if self.deadline is None else max(self.deadline - time.monotonic(), 0.001)
        if cap is None:
            return left
        return cap if left is None else min(left, cap)

    def capped(self, cap: float | None) -> bool:
        """Whether `timeout(cap)` is the cap rather than the request's own deadline."""
        if cap is None:
            return False
        return self.deadline is None or cap < self.deadline - time.monotonic()

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return ((REQUEST_ID_KEY, self.request_id),) if self.request_id else ()


def fetch_verifier_info(channel: grpc.Channel, timeout: float = 5.0) -> common_pb2.ModelInfo:
    stub = verifier_pb2_grpc.VerifierServiceStub(channel)
    return stub.GetModelInfo(verifier_pb2.VerifierServiceGetModelInfoRequest(), timeout=timeout).model_info


def fetch_drafter_info(channel: grpc.Channel, timeout: float = 5.0) -> common_pb2.ModelInfo:
    stub = drafter_pb2_grpc.DrafterServiceStub(channel)
    return stub.GetModelInfo(drafter_pb2.DrafterServiceGetModelInfoRequest(), timeout=timeout).model_info


class RemoteVerifier:
    """`core.interfaces.Verifier` over a VerifierService; one instance per request (options)."""

    def __init__(self, channel: grpc.Channel, info: common_pb2.ModelInfo, options: CallOptions | None = None) -> None:
        self._stub = verifier_pb2_grpc.VerifierServiceStub(channel)
        self.info = info
        self.options = options or CallOptions()
        self.vocab_size = info.vocab_size
        self.bos_id = info.bos_id
        self.eos_id = info.eos_id
        self.max_source_len = source_len_from_wire(info.max_source_len)
        self.max_target_len = target_len_from_wire(info.max_target_len)

    def open(self, source_ids: list[int]) -> RemoteVerifierSession:
        stream = _Stream("verifier", self._stub.Verify, self.options)
        stream.send(verifier_pb2.VerifyRequest(open=verifier_pb2.VerifyOpen(source_ids=source_ids)))
        return RemoteVerifierSession(stream)


class RemoteVerifierSession:
    """One Verify stream: single-row steps (`step`) and multi-row beam steps (`step_rows`,
    `core.interfaces.MultiRowSession`). Every result carries the forward's load figures
    (`batch_rows`, `batch_tokens`, `forward_s`) as the verifier reports them (0: not reported,
    an older verifier)."""

    def __init__(self, stream: _Stream) -> None:
        self._stream = stream
        self._opened = False

    def step(self, committed_len: int, append_ids: list[int], draft_ids: list[int], top_k: int) -> VerifyResult:
        step = verifier_pb2.VerifyStep(
            committed_len=committed_len, append_ids=append_ids, draft_ids=draft_ids, top_k=top_k
        )
        res = self._exchange(step)
        positions = res.positions
        return VerifyResult(
            top1=[p.top1 for p in positions],
            topk_ids=[list(p.topk_ids) for p in positions],
            topk_logprobs=[list(p.topk_logprobs) for p in positions],
            draft_logprobs=[p.draft_logprob for p in positions[: len(draft_ids)]],
            **_load(res),
        )

    def step_rows(self, rows: list[BeamRow], top_k: int) -> list[VerifyResult]:
        wire_rows = [
            verifier_pb2.BeamRow(parent=r.parent, committed_len=r.committed_len, append_ids=r.append_ids) for r in rows
        ]
        res = self._exchange(verifier_pb2.VerifyStep(rows=wire_rows, top_k=top_k))
        if len(res.positions) != len(rows):
            # A peer's fault, not the request's: e.g. a verifier that does not know `rows` and
            # answered an empty single-row step with one position.
            raise RemoteCallError(
                "verifier", grpc.StatusCode.INTERNAL,
                f"answered {len(res.positions)} positions to a {len(rows)}-row step (no multi-row support?)",
            )
        load = _load(res)
        return [
            VerifyResult(top1=[p.top1], topk_ids=[list(p.topk_ids)], topk_logprobs=[list(p.topk_logprobs)],
                         draft_logprobs=[], **load)
            for p in res.positions
        ]

    def close(self) -> None:
        self._stream.close()

    def _exchange(self, step: verifier_pb2.VerifyStep) -> verifier_pb2.VerifyStepResult:
        if not self._opened:
            self._stream.receive()  # `opened`
            self._opened = True
        return self._stream.exchange(verifier_pb2.VerifyRequest(step=step)).step


def _load(res: verifier_pb2.VerifyStepResult) -> dict:
    """The forward a step ran in, as `VerifyResult` fields."""
    return {"batch_rows": res.batch_rows, "batch_tokens": res.batch_tokens, "forward_s": res.forward_ms / 1000.0}


class RemoteDrafter:
    """`core.interfaces.Drafter` over a DrafterService; errors surface as `DrafterFailure`."""

    def __init__(
        self,
        channel: grpc.Channel,
        info: common_pb2.ModelInfo,
        options: CallOptions | None = None,
        timeout_cap: float | None = None,
    ) -> None:
        self._stub = drafter_pb2_grpc.DrafterServiceStub(channel)
        self.info = info
        self.options = options or CallOptions()
        self.timeout_cap = timeout_cap
        self.vocab_size = info.vocab_size

    def open(self, source_ids: list[int], seed: int = 0) -> RemoteDrafterSession:
        try:
            stream = _Stream("drafter", self._stub.Draft, self.options, self.timeout_cap)
        except RequestCancelled:
            raise
        except Exception as exc:  # a broken channel must not fail the request: the gateway falls back
            raise DrafterFailure(exc) from exc
        stream.send(drafter_pb2.DraftRequest(open=drafter_pb2.DraftOpen(source_ids=source_ids, seed=seed)))
        return RemoteDrafterSession(stream)


class RemoteDrafterSession:
    def __init__(self, stream: _Stream) -> None:
        self._stream = stream
        self._opened = False

    def draft_block(self, committed_len: int, append_ids: list[int], k: int) -> Draft:
        return self._draft(drafter_pb2.DraftStep(committed_len=committed_len, append_ids=append_ids, block={"k": k}))

    def draft_beam(self, committed_len: int, append_ids: list[int], gamma: int, num_beams: int) -> Draft:
        beam = drafter_pb2.BeamDraft(gamma=gamma, num_beams=num_beams)
        return self._draft(drafter_pb2.DraftStep(committed_len=committed_len, append_ids=append_ids, beam=beam))

    def draft_sample(self, committed_len: int, append_ids: list[int], gamma: int, params: SamplingParams) -> Draft:
        sample = drafter_pb2.SampleDraft(
            gamma=gamma, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p
        )
        return self._draft(drafter_pb2.DraftStep(committed_len=committed_len, append_ids=append_ids, sample=sample))

    def close(self) -> None:
        self._stream.close()

    def _draft(self, step: drafter_pb2.DraftStep) -> Draft:
        try:
            if not self._opened:
                self._stream.receive()
                self._opened = True
            res = self._stream.exchange(drafter_pb2.DraftRequest(step=step)).result
        except RequestDeadlineExceeded:
            raise  # the request's deadline, not the drafter's fault (no fallback, no retry window)
        except (SpecdecError, RemoteCallError) as exc:
            raise DrafterFailure(exc) from exc
        return Draft(
            ids=list(res.ids),
            cum_logq=list(res.cum_logq),
            q_rows=[(list(row.ids), list(row.probs)) for row in res.q_rows],
        )


class _Stream:
    """One synchronous bidi call driven message by message, under the request's deadline (or the
    peer's `cap`, when that is shorter) and cancel switch."""

    def __init__(self, peer: str, method, options: CallOptions, cap: float | None = None) -> None:
        self.peer = peer
        self._cancellation = options.cancellation
        if self._cancellation is not None:
            self._cancellation.check()  # cancelled before this session was opened: open nothing
        # A DEADLINE_EXCEEDED on a stream that runs to the request's deadline is the request's own.
        self._own_deadline = not options.capped(cap)
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._call = method(_drain(self._requests), timeout=options.timeout(cap), metadata=options.metadata())
        self._closed = False
        if self._cancellation is not None:
            try:
                self._cancellation.track(self._call)
            except RequestCancelled:
                self._requests.put(None)
                raise

    def send(self, request) -> None:
        self._requests.put(request)

    def receive(self):
        try:
            return next(self._call)
        except StopIteration:
            raise SpecdecError(StatusCode.UNAVAILABLE, f"the {self.peer} ended the stream early") from None
        except grpc.RpcError as exc:
            if self._cancellation is not None and self._cancellation.cancelled:
                raise RequestCancelled() from None
            if self._own_deadline and exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise RequestDeadlineExceeded(self.peer, exc.details() or "") from None
            raise _error(self.peer, exc) from None

    def exchange(self, request):
        self.send(request)
        return self.receive()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._requests.put(None)  # half-close
            self._call.cancel()
            if self._cancellation is not None:
                self._cancellation.untrack(self._call)


def _drain(requests: queue.SimpleQueue) -> Iterator:
    while (item := requests.get()) is not None:
        yield item


def _error(peer: str, exc: grpc.RpcError) -> Exception:
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = (exc.details() if hasattr(exc, "details") else "") or str(exc)
    mapped = specdec_code(code)
    if mapped is not None:
        prefix = f"{peer} unavailable: " if mapped == StatusCode.UNAVAILABLE else ""
        return SpecdecError(mapped, prefix + details)
    return RemoteCallError(peer, code, details)
