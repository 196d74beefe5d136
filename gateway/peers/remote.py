"""gRPC implementations of the `Verifier` / `Drafter` interfaces (`core.interfaces`).

Each session is one bidi stream driven step by step from the worker thread that runs the
synchronous `decode()`: every step sends one message and waits for exactly one answer. Opening a
session only sends the `open` message; its answer is read at the first step, so the verifier's
and the drafter's encoders run concurrently (ARCHITECTURE.md, "Performance design").

Two stream paths, chosen by the channel a `RemoteVerifier` / `RemoteDrafter` is given:

- a `gateway.peers.streams.PeerChannel` (the gateway's): the stream is a grpc.aio call on the
  gateway's event loop (no thread per stream);
- a synchronous `grpc.Channel` (callers without an event loop: tests, benchmarks, tools): a
  synchronous bidi call fed by a request queue (`_Stream`).
"""

from __future__ import annotations

import queue
from collections.abc import Iterator

import grpc

from core.errors import SpecdecError, StatusCode
from core.interfaces import BeamRow, Draft, VerifyResult
from core.logits_processors import Processors
from core.sampling import SamplingParams
from core.wire import source_len_from_wire, source_vocab_from_wire, target_len_from_wire
from gateway.peers.calls import (
    CallOptions,
    Cancellation,
    DrafterFailure,
    RemoteCallError,
    RequestCancelled,
    RequestDeadlineExceeded,
    peer_error,
)
from gateway.peers.streams import AioStream, PeerChannel
from protos.specdec.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from serving.processors_wire import processors_to_wire

__all__ = [
    "CallOptions",
    "Cancellation",
    "DrafterFailure",
    "PeerChannel",
    "RemoteCallError",
    "RemoteDrafter",
    "RemoteVerifier",
    "RequestCancelled",
    "RequestDeadlineExceeded",
    "fetch_drafter_info",
    "fetch_verifier_info",
]

# Steps in a streaming request's first greedy runs (VerifyStep.greedy_steps), before full runs.
STREAM_FIRST_RUNS = (1, 4)

# A channel to a peer: synchronous (one `_Stream` per session) or on the gateway's loop (`AioStream`).
Channel = grpc.Channel | PeerChannel


def fetch_verifier_info(channel: grpc.Channel, timeout: float = 5.0) -> common_pb2.ModelInfo:
    stub = verifier_pb2_grpc.VerifierServiceStub(channel)
    return stub.GetModelInfo(verifier_pb2.VerifierServiceGetModelInfoRequest(), timeout=timeout).model_info


def fetch_drafter_info(channel: grpc.Channel, timeout: float = 5.0) -> common_pb2.ModelInfo:
    stub = drafter_pb2_grpc.DrafterServiceStub(channel)
    return stub.GetModelInfo(drafter_pb2.DrafterServiceGetModelInfoRequest(), timeout=timeout).model_info


class ServedVerifier:
    """Base of a gateway-side `Verifier` over a served model (the VerifierService, Triton): the
    interface's vocabulary, special ids and length limits read from the model's ModelInfo, and how
    many AR steps one round trip may run, for a request and for a streaming one (0: no limit)."""

    def __init__(self, info: common_pb2.ModelInfo, greedy_chunk: int, stream_greedy_chunk: int) -> None:
        self.info = info
        self.vocab_size = info.vocab_size
        self.source_vocab_size = source_vocab_from_wire(info.source_vocab_size, info.vocab_size)
        self.bos_id = info.bos_id
        self.eos_id = info.eos_id
        self.max_source_len = source_len_from_wire(info.max_source_len)
        self.max_target_len = target_len_from_wire(info.max_target_len)
        self.greedy_chunk = greedy_chunk
        self.stream_greedy_chunk = stream_greedy_chunk


class RemoteVerifier(ServedVerifier):
    """`core.interfaces.Verifier` over a VerifierService; one instance per request (options)."""

    def __init__(
        self, channel: Channel, info: common_pb2.ModelInfo, options: CallOptions | None = None,
        greedy_chunk: int = 1, stream_greedy_chunk: int = 1,
    ) -> None:
        # AR steps per round trip at most: VerifyStep.greedy_steps (options.streaming picks which).
        super().__init__(info, greedy_chunk, stream_greedy_chunk)
        self._channel = channel
        # Made per request: what the gateway learns about the verifier's load (adaptive
        # speculation's `LoadModel`) is kept per channel, i.e. per gateway process and peer.
        self.load_key = channel
        self._method = channel.verify if isinstance(channel, PeerChannel) else (
            verifier_pb2_grpc.VerifierServiceStub(channel).Verify
        )
        self.options = options or CallOptions()

    def open(self, source_ids: list[int], processors: Processors | None = None) -> RemoteVerifierSession:
        """A session (one Verify stream) whose scores the verifier processes with `processors`."""
        opening = verifier_pb2.VerifyOpen(source_ids=source_ids)
        if processors is not None and processors.active:
            opening.processors.CopyFrom(processors_to_wire(processors))
        first = verifier_pb2.VerifyRequest(open=opening)
        stream = _open_stream("verifier", self._channel, self._method, self.options, None, first)
        runs = greedy_runs(self.options, self.greedy_chunk, self.stream_greedy_chunk, self.max_target_len)
        return RemoteVerifierSession(stream, *runs, max_draft_len=self.info.max_draft_len)


def greedy_runs(
    options: CallOptions, greedy_chunk: int, stream_greedy_chunk: int, max_target_len: int
) -> tuple[int, tuple[int, ...]]:
    """A request's AR runs (`GreedySession`): the most steps per call, and its first runs' sizes. A
    streaming request gets its first token alone and the next few soon, then runs of
    `stream_greedy_chunk`; another request runs of `greedy_chunk`, 0 being no limit (every step
    the output may still take: the session's room, and one past it)."""
    if options.streaming:
        return stream_greedy_chunk, STREAM_FIRST_RUNS
    return greedy_chunk or max_target_len + 1, ()


class RemoteVerifierSession:
    """One Verify stream: single-row steps (`step`), runs of AR steps in one round trip
    (`step_greedy`, `core.interfaces.GreedySession`), IAD's copy-drafted runs (`step_copy`,
    `core.interfaces.CopyRunSession`) and multi-row beam steps (`step_rows`,
    `core.interfaces.MultiRowSession`). Every result carries the forward's load figures
    (`batch_rows`, `batch_tokens`, `forward_s`) as the verifier reports them (0: not reported,
    an older verifier)."""

    def __init__(
        self, stream: _Stream | AioStream, greedy_chunk: int = 1, first_runs: tuple[int, ...] = (),
        max_draft_len: int = 0,
    ) -> None:
        self._stream = stream
        self.max_greedy_steps = greedy_chunk
        self.first_greedy_runs = first_runs
        self.max_draft_len = max_draft_len  # the verifier's (ModelInfo; 0: unknown)

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

    def step_greedy(self, committed_len: int, append_ids: list[int], steps: int, top_k: int) -> VerifyResult:
        step = verifier_pb2.VerifyStep(
            committed_len=committed_len, append_ids=append_ids, top_k=top_k, greedy_steps=steps
        )
        return _greedy_result(self._exchange(step), steps)

    def step_copy(self, committed_len: int, append_ids: list[int], steps: int, top_k: int, k: int) -> VerifyResult:
        """`core.interfaces.CopyRunSession.step_copy`: the verifier's greedy run with copy drafts of at
        most `k` tokens (`VerifyStep.copy_draft`): one round trip for what IAD's loop takes an
        iteration each."""
        if self.max_draft_len:
            k = min(k, self.max_draft_len)  # a block the verifier takes: a request's k may be larger
        step = verifier_pb2.VerifyStep(
            committed_len=committed_len, append_ids=append_ids, top_k=top_k, greedy_steps=steps, copy_draft=k
        )
        return _greedy_result(self._exchange(step), steps)

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
        return self._stream.exchange(verifier_pb2.VerifyRequest(step=step)).step


def _greedy_result(res: verifier_pb2.VerifyStepResult, steps: int) -> VerifyResult:
    """A greedy run's answer (one position per greedy token; a copy run's blocks too), checked."""
    positions = res.positions
    if not 1 <= len(positions) <= max(steps, 1):
        # A peer's fault: e.g. a verifier that does not know greedy_steps answers one position
        # (accepted: a run of one), but never none or more than asked.
        raise RemoteCallError(
            "verifier", grpc.StatusCode.INTERNAL, f"answered {len(positions)} positions to {steps} greedy steps"
        )
    return VerifyResult(
        top1=[p.top1 for p in positions],
        topk_ids=[list(p.topk_ids) for p in positions],
        topk_logprobs=[list(p.topk_logprobs) for p in positions],
        draft_logprobs=[],
        blocks=[(b.drafted, b.accepted) for b in res.blocks],
        **_load(res),
    )


def _load(res: verifier_pb2.VerifyStepResult) -> dict:
    """The forward a step ran in, as `VerifyResult` fields."""
    return {"batch_rows": res.batch_rows, "batch_tokens": res.batch_tokens, "forward_s": res.forward_ms / 1000.0}


class RemoteDrafter:
    """`core.interfaces.Drafter` over a DrafterService; errors surface as `DrafterFailure`."""

    def __init__(
        self,
        channel: Channel,
        info: common_pb2.ModelInfo,
        options: CallOptions | None = None,
        timeout_cap: float | None = None,
    ) -> None:
        self._channel = channel
        self._method = channel.draft if isinstance(channel, PeerChannel) else (
            drafter_pb2_grpc.DrafterServiceStub(channel).Draft
        )
        self.info = info
        self.options = options or CallOptions()
        self.timeout_cap = timeout_cap
        self.vocab_size = info.vocab_size
        # Tokens one drafter call may ask for (None: not reported).
        self.max_draft_len = info.max_draft_len or None

    def open(self, source_ids: list[int], seed: int = 0) -> RemoteDrafterSession:
        first = drafter_pb2.DraftRequest(open=drafter_pb2.DraftOpen(source_ids=source_ids, seed=seed))
        try:
            stream = _open_stream("drafter", self._channel, self._method, self.options, self.timeout_cap, first)
        except RequestCancelled:
            raise
        except Exception as exc:  # a broken channel must not fail the request: the gateway falls back
            raise DrafterFailure(exc) from exc
        return RemoteDrafterSession(stream)


class RemoteDrafterSession:
    def __init__(self, stream: _Stream | AioStream) -> None:
        self._stream = stream

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
            res = self._stream.exchange(drafter_pb2.DraftRequest(step=step)).result
        except RequestDeadlineExceeded:
            raise  # the request's deadline, not the drafter's fault (no fallback, no retry window)
        except (SpecdecError, RemoteCallError) as exc:
            raise DrafterFailure(exc) from exc
        return Draft(
            ids=list(res.ids),
            cum_logq=list(res.cum_logq),
            q_rows=[(list(row.ids), list(row.probs)) for row in res.q_rows],
            batch_rows=max(res.batch_rows, 1), batch_tokens=res.batch_tokens, forward_s=res.forward_ms / 1000.0,
        )


def _open_stream(peer: str, channel: Channel, method, options: CallOptions, cap: float | None, first):
    """A session stream on `channel` whose first message, `first` (the `open`), is sent at once."""
    if isinstance(channel, PeerChannel):
        return AioStream(peer, channel, method, options, cap, first)
    return _Stream(peer, method, options, cap, first)


class _Stream:
    """One synchronous bidi call driven message by message, under the request's deadline (or the
    peer's `cap`, when that is shorter) and cancel switch, for callers without an event loop: grpc
    consumes the request queue on a thread of its own, one per stream."""

    def __init__(self, peer: str, method, options: CallOptions, cap: float | None, first) -> None:
        self.peer = peer
        self._cancellation = options.cancellation
        if self._cancellation is not None:
            self._cancellation.check()  # cancelled before this session was opened: open nothing
        # A DEADLINE_EXCEEDED on a stream that runs to the request's deadline is the request's own.
        self._own_deadline = not options.capped(cap)
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._call = method(_drain(self._requests), timeout=options.timeout(cap), metadata=options.metadata())
        self._closed = False
        self._opened = False  # whether the `opened` answer was read (at the first step)
        if self._cancellation is not None:
            try:
                self._cancellation.track(self._call)
            except RequestCancelled:
                self._requests.put(None)
                raise
        self._requests.put(first)

    def exchange(self, request):
        # The first step is queued behind the `open` before its answer comes (the peer reads its
        # stream in order), so its round trip overlaps the peer's encoder run.
        self._requests.put(request)
        if not self._opened:
            self._opened = True
            self._receive()  # `opened` (raises what opening raised)
        return self._receive()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._requests.put(None)  # half-close
            self._call.cancel()
            if self._cancellation is not None:
                self._cancellation.untrack(self._call)

    def _receive(self):
        try:
            return next(self._call)
        except StopIteration:
            raise SpecdecError(StatusCode.UNAVAILABLE, f"the {self.peer} ended the stream early") from None
        except grpc.RpcError as exc:
            if self._cancellation is not None and self._cancellation.cancelled:
                raise RequestCancelled() from None
            if self._own_deadline and exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise RequestDeadlineExceeded(self.peer, exc.details() or "") from None
            raise peer_error(self.peer, exc) from None


def _drain(requests: queue.SimpleQueue) -> Iterator:
    while (item := requests.get()) is not None:
        yield item
