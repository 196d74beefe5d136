"""The VerifierService: `Verify` bidi streams, one stream = one `VerifierSession` (ARCHITECTURE.md, "Wire contracts").

Model work runs on `StepExecutor` (a worker thread), never on the event loop. Steps go through its
batching scheduler (serving/batching.py, ARCHITECTURE.md, "Performance design"): the steps of concurrent
sessions run as one forward (`step_batch`), up to [verifier] max_batch_rows / max_batch_tokens.

With [verifier] model_workers = N the service holds N copies of the model, each on a worker thread of
its own with its share of the intra-op threads: a session is opened on the worker `placement` picks
(by default by its source's length, `verifier_service.lanes`) and stays there, and the workers'
forwards run side by side. On a CPU, N one-thread
forwards outrun one N-thread forward under load (BENCHMARKS.md, "Bulk decoding"), as they do in
process (`specdec decode --workers`).
"""

from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from core.backends import DEFAULT_PRECISION, backend_label
from core.checks import check_draft_len, check_ids, check_length, check_wire_top_k
from core.copy_draft import CopyDrafter, CopyRun, check_copy_draft
from core.errors import invalid, out_of_range, out_of_step
from core.greedy import check_greedy_steps, greedy_next
from core.interfaces import BeamRow, StepCall, VerifyResult
from core.threads import worker_threads
from core.wire import sends_candidates, session_top_k
from protos.specdec.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from seq2seq_models.bundle import ModelBundle, load_bundle
from serving.batching import BatchLimits, BatchScheduler, BatchStats, StepExecutor, one_by_one, with_batch_load
from serving.model_service import SECONDS_BUCKETS, ModelService, SessionLimits, close, make_model_info
from serving.processors_wire import processors_from_wire
from verifier_service.lanes import pick_lane
from verifier_service.session import VerifierSession, make_verifier

SERVICE = verifier_pb2.DESCRIPTOR.services_by_name["VerifierService"]
# [verifier] placement: how a new session picks its model worker.
PLACEMENTS = ("length", "sessions")
# Source tokens one encoder run may hold (its rows are [verifier] max_batch_rows).
ENCODE_TOKENS = 8192


@dataclass(frozen=True)
class _Encode:
    """A new session's source, as the encoder's `BatchScheduler` sizes it: one row of its tokens."""

    n_tokens: int
    n_rows: int = 1


@dataclass(frozen=True)
class VerifierLimits(SessionLimits):
    section = "verifier"
    max_draft_len: int = 128  # draft_ids per step; more is OUT_OF_RANGE
    max_source_len: int | None = None  # None: the model's own limit
    # Copies of the model, each on its own worker thread with intra_op_threads / model_workers threads.
    model_workers: int = 1
    # Which worker a new session goes to: "length", by its source's length, short and long sources on
    # different workers with the workers kept about even (`verifier_service.lanes`); "sessions", the
    # worker with the fewest sessions.
    placement: str = field(default="length", metadata={"choices": PLACEMENTS})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.model_workers < 1:
            raise ValueError(f"[verifier] model_workers: must be at least 1; got {self.model_workers}")


@dataclass
class _Lane:
    """One model worker: a copy of the verifier, the thread it runs on, and the batching schedulers of
    its sessions' steps and new sources."""

    verifier: Any
    executor: StepExecutor
    scheduler: BatchScheduler | None = None
    encoder: BatchScheduler | None = None
    sources: list[int] = field(default_factory=list)  # the source lengths of the open sessions placed here

    @property
    def sessions(self) -> int:
        return len(self.sources)


class VerifierServer(ModelService, verifier_pb2_grpc.VerifierServiceServicer):
    limits_type = VerifierLimits

    @staticmethod
    def load_models(bundle: str | Path | ModelBundle) -> ModelBundle:
        return bundle if isinstance(bundle, ModelBundle) else load_bundle(bundle, roles=["verifier"])

    def __init__(
        self, bundle: ModelBundle, limits: VerifierLimits, backend: str = "torch", device: str | None = None,
        precision: str = DEFAULT_PRECISION, intra_op_threads: int = 0,
    ) -> None:
        super().__init__(
            "verifier", SERVICE, bundle, limits, verifier_pb2_grpc.add_VerifierServiceServicer_to_server,
            metric_help=("time the model worker spent in verify forwards", "draft tokens scored"),
        )
        workers = limits.model_workers
        self.placement = limits.placement
        threads = intra_op_threads or None
        if workers > 1:  # the threads shared out: each worker's forwards get their own cores
            threads = worker_threads(intra_op_threads, workers)
        first = make_verifier(bundle, backend, device=device, precision=precision, intra_op_threads=threads)
        # One copy of the model: each further worker is a twin with sessions and a pool of its own.
        self.lanes = [
            _Lane(first if i == 0 else first.twin(), self.executor if i == 0 else StepExecutor(f"verifier-{i}"))
            for i in range(workers)
        ]
        # id(session) -> its worker and its source's length, while it is open.
        self._lane_of: dict[int, tuple[_Lane, int]] = {}
        self.streams.close_soon = self._close_soon
        self.verifier = self.lanes[0].verifier
        cfg = bundle.config("verifier")  # from the bundle config: no torch model is loaded for ONNX Runtime
        self.max_source_len = min(limits.max_source_len or self.verifier.max_source_len, self.verifier.max_source_len)
        self.max_output_len = self.verifier.max_target_len
        r = self.registry
        self.m_steps = r.counter("verifier_steps", "verify steps (several share a forward when batched)")
        self.m_scored = r.counter("verifier_scored_tokens", "tokens scored (append + draft)")
        self.m_queue_s = r.counter("verifier_queue_seconds", "time steps waited for the model worker")
        # The worker's other busy time besides `forward_seconds`: the encoder runs queued at open
        # (`_encode_soon`); a first step that comes sooner encodes inside its forward.
        self.m_encode_s = r.histogram("verifier_encode_seconds", "duration of an encoder run of new sessions' "
                                      "sources queued at open", SECONDS_BUCKETS)
        # Their ratio is the padding the forwards' attention pays for (placement, BENCHMARKS.md "Bulk decoding: notes").
        self.m_attended = r.counter("verifier_attended_positions", "key positions the forwards' attention ran over, "
                                    "every row's past and source padded to the forward's longest")
        self.m_held = r.counter("verifier_held_positions",
                                "key positions of the rows' own pasts and sources in those forwards")
        on_encode = self.encoder_metrics() if hasattr(self.verifier, "on_encode") else None
        for lane in self.lanes:
            # Steps of a worker's concurrent sessions gathered into one forward (serving/batching.py).
            lane.scheduler = self.make_scheduler(partial(_run_batch, lane.verifier), limits, lane.executor)
            # The sources of sessions opened meanwhile, encoded in one run (`_encode_soon`).
            if on_encode is not None:
                lane.verifier.on_encode = on_encode
            if hasattr(lane.verifier, "on_attend"):
                lane.verifier.on_attend = self._attended
            lane.encoder = BatchScheduler(
                lane.executor, partial(_encode_batch, lane.verifier),
                BatchLimits(max_rows=limits.max_batch_rows, max_tokens=ENCODE_TOKENS),
                on_batch=lambda stats: self.m_encode_s.observe(stats.forward_s),
            )
        self.model_info = make_model_info(
            cfg,
            tokenizer_fingerprint=bundle.tokenizer.fingerprint,
            bundle_fingerprint=bundle.fingerprint,
            max_source_len=self.max_source_len,
            max_target_len=self.max_output_len,
            # e.g. "onnxruntime-cuda:1", "torch-cpu", "onnxruntime-cpu-int8"
            backend=backend_label(backend, self.verifier.device, precision),
            roles=[common_pb2.MODEL_ROLE_VERIFIER],
            max_draft_len=limits.max_draft_len,
            # Speculative sampling asks for the whole distribution (top_k = vocab).
            max_top_k=cfg.vocab_size,
            max_sessions=limits.max_sessions,
        )

    async def warm_up(self) -> None:
        for lane in self.lanes:
            await lane.executor.run(self._warm_up, lane.verifier)

    async def stop(self, grace: float = 10.0) -> None:
        await super().stop(grace)
        for lane in self.lanes[1:]:
            lane.executor.shutdown()

    def _warm_up(self, verifier: Any) -> None:
        """Worker thread: one step through the batch path the steps take (step_batch when the backend has it)."""
        eos = self.model_info.eos_id
        session = verifier.open([eos])
        for result in _run_batch(verifier, [(session, StepCall(0, [], [eos], 1))]):
            if isinstance(result, BaseException):
                raise result
        session.close()
        # The most head rows one forward can hold: a full batch, or one step of the longest draft.
        warm_head = getattr(verifier, "warm_up_head", None)
        if warm_head is not None:
            t0 = time.perf_counter()
            launches = warm_head(max(self.limits.max_batch_tokens, self.limits.max_draft_len + 1))
            if launches:
                self.host.log.info("head_kernels_compiled", launches=launches,
                                   seconds=round(time.perf_counter() - t0, 2))

    # ---- RPCs ----------------------------------------------------------------------------------

    Verify = ModelService.serve_sessions

    async def open_on_worker(self, source: list[int], request: verifier_pb2.VerifyOpen) -> VerifierSession:
        """The session on the worker `placement` picks. A verifier whose sessions encode lazily
        (`BatchVerifier`) only records the source at open, so it opens here, not behind the
        worker's forward: the client's first step, read once the session exists, then joins the
        next forward instead of the one after."""
        lane = self._place(len(source))
        lane.sources.append(len(source))
        try:
            if hasattr(lane.verifier, "encode"):
                session = self.open_session(source, request, lane)
            else:
                session = await lane.executor.run_owned(self.open_session, close, source, request, lane)
        except BaseException:
            lane.sources.remove(len(source))
            raise
        self._lane_of[id(session)] = (lane, len(source))
        return session

    def _place(self, length: int) -> _Lane:
        """The worker for a new session of `length` source tokens ([verifier] placement)."""
        if self.placement == "sessions":
            return min(self.lanes, key=lambda lane: lane.sessions)
        return self.lanes[pick_lane([lane.sources for lane in self.lanes], length)]

    def open_session(
        self, source: list[int], request: verifier_pb2.VerifyOpen, lane: _Lane | None = None
    ) -> VerifierSession:
        verifier = (lane or self.lanes[0]).verifier
        if request.HasField("processors"):
            return verifier.open(source, processors_from_wire(request.processors))
        return verifier.open(source)

    def _close_soon(self, session: VerifierSession) -> None:
        """Close `session` on its worker (after any step of it queued there)."""
        placed = self._lane_of.pop(id(session), None)
        if placed is None:
            self.executor.submit(session.close)
            return
        lane, length = placed
        lane.sources.remove(length)
        lane.executor.submit(session.close)

    def _attended(self, attended: int, held: int) -> None:
        """Worker: one forward's attention positions (`BatchVerifier.on_attend`)."""
        self.m_attended.inc(attended)
        self.m_held.inc(held)

    def _lane(self, session: VerifierSession) -> _Lane:
        placed = self._lane_of.get(id(session))
        return self.lanes[0] if placed is None else placed[0]

    async def _open(self, request):
        session, response = await super()._open(request)
        if hasattr(self.verifier, "encode"):  # a backend whose sessions encode lazily (BatchVerifier)
            self._encode_soon(session)
        return session, response

    def _encode_soon(self, session: VerifierSession) -> None:
        """Queue the new session's source for the encoder, not waiting for it: the sources of the
        sessions opened while the worker was busy go in one run (`BatchVerifier.encode`). It runs
        as soon as the worker is free, while a speculative client's drafter makes its first block,
        so the first step finds it encoded; a first step that comes sooner encodes it in its own
        forward (the sessions' sources are encoded lazily too), and a session closed first never."""
        # Queued now, before the client hears `opened` (and can send a first step behind it).
        encoder = self._lane(session).encoder
        assert encoder is not None
        # A future the worker settles itself: nobody awaits the encoding, so the event loop is not
        # woken for it (`_encoded` runs on the worker).
        encoder.queue_sync(session, _Encode(len(session.source.ids))).add_done_callback(self._encoded)

    def _encoded(self, encoding: concurrent.futures.Future) -> None:
        if not encoding.cancelled() and encoding.exception() is not None:  # the first step will retry and say
            self.host.log.warning("encoder_failed", error=repr(encoding.exception()))

    async def _step(self, session: VerifierSession, step: verifier_pb2.VerifyStep) -> verifier_pb2.VerifyResponse:
        call = self._checked_call(session, step)
        candidates = sends_candidates(step.top_k)
        if step.copy_draft:
            return await self._copy_run(session, call, step.greedy_steps, step.copy_draft, candidates)
        if step.greedy_steps > 1:
            return await self._greedy(session, call, step.greedy_steps, candidates)
        result = await self._scheduler(session).submit(session, call)
        self.m_steps.inc()
        appended = sum(len(r.append_ids) for r in call.rows) if call.rows else len(call.append_ids)
        self.m_scored.inc(appended + len(call.draft_ids))
        self.m_draft_tokens.inc(len(call.draft_ids))
        if call.rows is None:
            positions = [_position(result, i, candidates, i < len(call.draft_ids)) for i in range(len(result.top1))]
            load = result
            committed = step.committed_len + len(call.append_ids)
        else:  # one position per row, each row's result holding its one position
            positions = [_position(row, 0, candidates, False) for row in result]
            load = result[0]
            committed = 0
        return verifier_pb2.VerifyResponse(
            step=verifier_pb2.VerifyStepResult(
                committed_len=committed,
                positions=positions,
                batch_rows=load.batch_rows,
                batch_tokens=load.batch_tokens,
                forward_ms=load.forward_s * 1000.0,
            )
        )

    async def _greedy(
        self, session: VerifierSession, call: StepCall, steps: int, candidates: bool
    ) -> verifier_pb2.VerifyResponse:
        """`greedy_steps`: the steps run back to back on the model worker (core.greedy), each
        batched with other sessions' steps, answered once."""
        eos, room = self.model_info.eos_id, self.max_output_len

        def then(done: StepCall, result: VerifyResult, steps_run: int) -> StepCall | None:
            return greedy_next(done, result, steps_run, steps, eos, room)

        results = await self._scheduler(session).submit(session, call, then)
        self.m_steps.inc(len(results))
        self.m_scored.inc(len(call.append_ids) + len(results) - 1)
        return _run_answer(call, [_position(r, 0, candidates, False) for r in results], results[-1])

    async def _copy_run(
        self, session: VerifierSession, call: StepCall, steps: int, k: int, candidates: bool
    ) -> verifier_pb2.VerifyResponse:
        """`copy_draft`: a greedy run whose forwards verify copy drafts (IAD, `core.copy_draft.CopyRun`),
        run on the model worker like `greedy_steps`' steps, answered once: a position per greedy token."""
        eos, bos = self.model_info.eos_id, self.model_info.bos_id
        # What the session holds as final before the run (a committed_len past its tokens fails the
        # first step, FAILED_PRECONDITION, as any step's does).
        output = [*session.tokens[: call.committed_len], *call.append_ids]
        run = CopyRun(CopyDrafter(session.source.ids, bos, eos, k), output, steps, eos, self.max_output_len)

        def then(done: StepCall, result: VerifyResult, steps_run: int) -> StepCall | None:
            return run.next(done, result)

        results = await self._scheduler(session).submit(session, run.first(call), then)
        self.m_steps.inc(len(results))
        drafted = sum(d for d, _ in run.blocks)
        self.m_scored.inc(len(call.append_ids) + len(results) + drafted - 1)
        self.m_draft_tokens.inc(drafted)
        positions = [_position(r, i, candidates, False) for r, n in run.positions for i in range(n)]
        return _run_answer(call, positions, results[-1],
                           [verifier_pb2.CopyBlock(drafted=d, accepted=a) for d, a in run.blocks])

    def _checked_call(self, session: VerifierSession, step: verifier_pb2.VerifyStep) -> StepCall:
        """The step as the scheduler takes it, after the checks of what the client controls."""
        vocab = self.model_info.vocab_size
        if step.rows:
            check_greedy_steps(step.greedy_steps, StepCall(rows=[]))
            check_copy_draft(step.copy_draft, step.greedy_steps, self.limits.max_draft_len)
            return StepCall(top_k=session_top_k(step.top_k), rows=self._checked_rows(session, step))
        # Lengths before per-id work: a 16 MiB message holds millions of ids.
        check_draft_len(len(step.draft_ids), self.limits.max_draft_len)
        check_length(step.append_ids, self.max_output_len, "append_ids")
        append, draft = list(step.append_ids), list(step.draft_ids)
        check_wire_top_k(step.top_k, vocab)
        check_ids(append, vocab, "append_ids")
        check_ids(draft, vocab, "draft_ids")
        call = StepCall(step.committed_len, append, draft, session_top_k(step.top_k))
        check_greedy_steps(step.greedy_steps, call)
        check_copy_draft(step.copy_draft, step.greedy_steps, self.limits.max_draft_len)
        return call

    def _checked_rows(self, session: VerifierSession, step: verifier_pb2.VerifyStep) -> list[BeamRow]:
        """A multi-row (beam) step's rows. Whether each parent and committed_len fit the session's
        rows is the backend's check (FAILED_PRECONDITION), the one that knows them."""
        if len(step.rows) > self.limits.max_draft_len:
            raise out_of_range(f"step has {len(step.rows)} rows; the limit is {self.limits.max_draft_len}")
        if step.committed_len or step.append_ids or step.draft_ids:
            raise invalid("a step with rows must leave committed_len, append_ids and draft_ids empty")
        check_wire_top_k(step.top_k, self.model_info.vocab_size)
        rows = []
        for i, row in enumerate(step.rows):
            check_length(row.append_ids, self.max_output_len, f"rows[{i}].append_ids")
            append = list(row.append_ids)
            check_ids(append, self.model_info.vocab_size, f"rows[{i}].append_ids")
            if row.parent < 0 or row.committed_len < 0:
                raise out_of_step(f"rows[{i}]: parent {row.parent} and committed_len {row.committed_len} must be >= 0")
            rows.append(BeamRow(row.parent, row.committed_len, append))
        if not hasattr(session, "step_rows"):
            raise invalid(f"the {self.model_info.backend} verifier has no multi-row steps")
        return rows

    def _scheduler(self, session: VerifierSession) -> BatchScheduler:
        scheduler = self._lane(session).scheduler
        assert scheduler is not None
        return scheduler

    def observe_batch(self, stats: BatchStats) -> None:
        super().observe_batch(stats)
        self.m_queue_s.inc(sum(stats.waits_s))
        self.m_step_s.inc(stats.forward_s)


def _run_batch(verifier: Any, items: list[tuple[VerifierSession, StepCall]]) -> list:
    """Worker thread: a scheduler's batch as one forward (the backend's `step_batch`), or, on a
    backend without one, each step in turn, stamped with the batch they ran in together."""
    step_batch = getattr(verifier, "step_batch", None)
    if step_batch is not None:
        return step_batch(items)
    started = time.perf_counter()
    results = one_by_one(items, _step_one)
    rows, tokens = sum(c.n_rows for _, c in items), sum(c.n_tokens for _, c in items)
    return with_batch_load(results, rows, tokens, time.perf_counter() - started)


def _encode_batch(verifier: Any, items: list[tuple[VerifierSession, _Encode]]) -> list[None]:
    """Worker thread: the items' sessions' sources in one encoder run (on a CPU, one per group of lengths)."""
    verifier.encode([session for session, _ in items])
    return [None] * len(items)


def _step_one(session: VerifierSession, call: StepCall):
    if call.rows is None:
        return session.step(call.committed_len, call.append_ids, call.draft_ids, call.top_k)
    return session.step_rows(call.rows, call.top_k)


def _run_answer(
    call: StepCall, positions: list[verifier_pb2.Position], last: VerifyResult,
    blocks: list[verifier_pb2.CopyBlock] | None = None,
) -> verifier_pb2.VerifyResponse:
    """A run's answer (`greedy_steps`, `copy_draft`): a position per greedy token, all but the last
    appended in the session; the load figures of the run's last forward."""
    return verifier_pb2.VerifyResponse(
        step=verifier_pb2.VerifyStepResult(
            committed_len=call.committed_len + len(call.append_ids) + len(positions) - 1,
            positions=positions,
            batch_rows=last.batch_rows,
            batch_tokens=last.batch_tokens,
            forward_ms=last.forward_s * 1000.0,
            blocks=blocks or [],
        )
    )


def _position(result: VerifyResult, i: int, candidates: bool, drafted: bool) -> verifier_pb2.Position:
    pos = verifier_pb2.Position(top1=result.top1[i])
    if candidates:
        pos.topk_ids.extend(result.topk_ids[i])
        pos.topk_logprobs.extend(result.topk_logprobs[i])
    if drafted:
        pos.draft_logprob = result.draft_logprobs[i]
    return pos
