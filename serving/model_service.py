"""What the verifier and the drafter services share: one host, one model worker, the session
streams, the ModelInfo they report, the KV-cache gauge, and the start / warm-up / drain order.

This layer sits below the model packages, so it takes what it needs from them as plain values: a
model config is anything with the token ids and `vocab_size` (`ModelIds`), limits are numbers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, Self

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message_factory import GetMessageClass

from core.checks import check_source_ids
from core.config import ServiceSection
from core.wire import SPECIAL_ID_FIELDS, source_len_to_wire, source_vocab_from_wire, target_len_to_wire
from protos.specdec.v1 import common_pb2
from serving.batching import BatchLimits, BatchScheduler, BatchStats, RunBatch
from serving.host import ServiceHost
from serving.metrics import Registry
from serving.sessions import SessionStreams, StepExecutor
from serving.tls import ServerTLS


class ModelIds(Protocol):
    """The part of a model config that ModelInfo reports (seq2seq_models.config.ModelConfig):
    the vocabularies' sizes and core.wire.SPECIAL_ID_FIELDS."""

    vocab_size: int
    source_vocab_size: int
    pad_id: int
    unk_id: int
    bos_id: int
    eos_id: int
    mask_id: int


class ModelService:
    """Base of a servicer that hosts model sessions behind one bidi "one stream = one session" RPC.

    A subclass also derives from its generated servicer, passes its service's descriptor, bundle and
    limits, sets `model_info` (`make_model_info`), and implements `warm_up`, `open_session` and
    `_step(session, step_msg)`, validating what the client controls there, at the RPC boundary.
    Its stream RPC is `serve_sessions`, e.g. `Verify = ModelService.serve_sessions`.
    """

    model_info: common_pb2.ModelInfo
    limits_type: ClassVar[type[SessionLimits]]
    # Interface limits (without the source's EOS / the decoder start token; core.wire converts).
    max_source_len: int
    max_output_len: int

    def __init__(
        self,
        name: str,
        service: ServiceDescriptor,
        bundle: Any,
        limits: SessionLimits,
        add_to_server: Callable[[Any, grpc.aio.Server], None],
        metric_help: tuple[str, str] = ("time spent in steps", "draft tokens"),
    ) -> None:
        """`metric_help`: the help texts of the step-seconds and draft-token counters every model
        service has, saying what its steps are."""
        self.bundle = bundle
        self.limits = limits
        # The messages come from the proto: GetModelInfo's response, and the one bidi RPC's response
        # message with its `opened` variant.
        stream = next(m for m in service.methods if m.client_streaming and m.server_streaming)
        self._info_response = GetMessageClass(service.methods_by_name["GetModelInfo"].output_type)
        self._response = GetMessageClass(stream.output_type)
        self._opened = GetMessageClass(stream.output_type.fields_by_name["opened"].message_type)
        # The seam for the batching scheduler (ARCHITECTURE.md, "Performance design"): every model call goes through it.
        self.executor = StepExecutor(name)
        self.registry = Registry()
        self.host = ServiceHost(name, [service.full_name], self.registry)
        self.streams = SessionStreams(
            self.host, self.executor, self.registry, stream.name, limits.max_sessions, limits.session_idle_s
        )
        r = self.registry
        step_seconds_help, draft_tokens_help = metric_help
        self.m_draft_tokens = r.counter(f"{name}_draft_tokens", draft_tokens_help)
        self.m_step_s = r.counter(f"{name}_step_seconds", step_seconds_help)
        self.m_kv = r.gauge(f"{name}_kv_cache_bytes", "KV cache bytes held by open sessions")
        # The batching scheduler's view of load (`make_scheduler`): one observation per forward,
        # and the queue wait once per step.
        self.m_forwards = r.counter(f"{name}_forwards", "batched forwards run (each holds one or more steps)")
        self.m_batch = r.gauge(f"{name}_batch_size", "rows in the last forward")
        self.m_batch_rows = r.histogram(f"{name}_batch_rows", "rows per forward", ROW_BUCKETS)
        self.m_batch_tokens = r.histogram(f"{name}_batch_tokens", "tokens per forward", TOKEN_BUCKETS)
        self.m_forward_s = r.histogram(f"{name}_forward_seconds", "duration of a forward", SECONDS_BUCKETS)
        self.m_wait_s = r.histogram(
            f"{name}_queue_wait_seconds", "time a step waited for the model worker", SECONDS_BUCKETS
        )
        self.m_dropped = r.counter(f"{name}_dropped_steps", "steps dropped unrun: their stream ended while queued")
        r.on_collect(lambda: self.m_kv.set(sum(_cache_bytes(s) for s in list(self.streams.sessions))))
        add_to_server(self, self.host.server)

    def encoder_metrics(self) -> Callable[[int], None]:
        """Counters of the service's encoder runs and the sources they encoded; the returned
        callback (`row_cache.encode_new`'s `on_run`) counts one run of n sources."""
        runs = self.registry.counter(f"{self.host.name}_encoder_runs", "encoder runs (each over one or more sources)")
        encoded = self.registry.counter(f"{self.host.name}_encoded_sources", "sources encoded")

        def counted(n: int) -> None:
            runs.inc()
            encoded.inc(n)

        return counted

    def make_scheduler(
        self, run_batch: RunBatch, limits: SessionLimits, executor: StepExecutor | None = None
    ) -> BatchScheduler:
        """The batching scheduler of this service's steps, on its worker (or `executor`), with the
        limits' batch keys; every forward it runs is observed by `observe_batch`."""
        return BatchScheduler(executor or self.executor, run_batch, BatchLimits.of(limits), on_batch=self.observe_batch)

    def observe_batch(self, stats: BatchStats) -> None:
        """Worker thread, after each forward: the load metrics. Subclasses add their own."""
        self.m_forwards.inc()
        self.m_batch.set(stats.rows)
        self.m_batch_rows.observe(stats.rows)
        self.m_batch_tokens.observe(stats.tokens)
        self.m_forward_s.observe(stats.forward_s)
        for wait in stats.waits_s:
            self.m_wait_s.observe(wait)
        if stats.dropped:
            self.m_dropped.inc(stats.dropped)

    @classmethod
    async def start(cls, bundle: Any, section: ServiceSection, limits: SessionLimits | None = None) -> Self:
        """Load the service's models from `bundle` (a directory, or a loaded bundle), on the section's
        backend, device, precision and intra-op threads; serve them as the section says; warm up; report SERVING."""
        server = cls(
            cls.load_models(bundle), limits or cls.limits_type(), section.backend, section.device, section.precision,
            intra_op_threads=section.intra_op_threads,
        )
        return await server.serve(section)

    @staticmethod
    def load_models(bundle: Any) -> Any:
        """The bundle with the models this service hosts loaded (`bundle` may be loaded already)."""
        raise NotImplementedError

    async def serve(self, section: ServiceSection) -> Self:
        """Listen where the config section says (address, metrics endpoint, TLS), warm up, then report
        SERVING (health says NOT_SERVING until the model is warm)."""
        await self.host.start(section.address, section.metrics_address, ServerTLS.of(section))
        await self.warm_up()
        await self.host.set_serving(backend=self.model_info.backend, bundle=self.model_info.bundle_fingerprint[:16])
        return self

    async def warm_up(self) -> None:
        """One session and one step, so the first real request does not pay for lazy init."""
        raise NotImplementedError

    async def stop(self, grace: float = 10.0) -> None:
        await self.host.drain(grace)
        self.executor.shutdown()

    @property
    def active_sessions(self) -> int:
        return len(self.streams.sessions)

    # ---- RPCs ----------------------------------------------------------------------------------

    async def GetModelInfo(self, request, context):
        return self._info_response(model_info=self.model_info)

    async def serve_sessions(self, request_iterator, context):
        async for response in self.streams.serve(request_iterator, context, self._open, self._step):
            yield response

    async def _open(self, request) -> tuple[Any, Any]:
        """The `open` message: the source checked here, at the edge, then a session on the worker."""
        source = list(request.source_ids)
        info = self.model_info
        check_source_ids(source, source_vocab_from_wire(info.source_vocab_size, info.vocab_size), self.max_source_len)
        session = await self.open_on_worker(source, request)
        opened = self._opened(source_len=len(source), max_output_len=self.max_output_len)
        return session, self._response(opened=opened)

    async def open_on_worker(self, source: list[int], request) -> Any:
        """`open_session` on the model worker (a service with several picks one)."""
        # A stream cancelled while its session is being made must not leak it: close it once made.
        return await self.executor.run_owned(self.open_session, close, source, request)

    def open_session(self, source: list[int], request) -> Any:
        """Worker thread: a session over a checked source; `request` is the `open` message."""
        raise NotImplementedError

    async def _step(self, session, step) -> Any:
        raise NotImplementedError


def make_model_info(
    config: ModelIds,
    *,
    tokenizer_fingerprint: str,
    bundle_fingerprint: str,
    max_source_len: int,
    max_target_len: int,
    backend: str,
    roles: Iterable[int],
    max_draft_len: int,
    max_top_k: int,
    max_sessions: int,
) -> common_pb2.ModelInfo:
    """ModelInfo for a service; the lengths are the interface's (without EOS / BOS, core.wire)."""
    return common_pb2.ModelInfo(
        vocab_size=config.vocab_size,
        source_vocab_size=config.source_vocab_size if config.source_vocab_size != config.vocab_size else 0,
        **{name: getattr(config, name) for name in SPECIAL_ID_FIELDS},
        tokenizer_fingerprint=tokenizer_fingerprint,
        bundle_fingerprint=bundle_fingerprint,
        max_source_len=source_len_to_wire(max_source_len),
        max_target_len=target_len_to_wire(max_target_len),
        backend=backend,
        roles=list(roles),
        max_draft_len=max_draft_len,
        max_top_k=max_top_k,
        max_sessions=max_sessions,
    )


# Histogram buckets of the load metrics: rows and tokens per forward, seconds (queue wait, forward).
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def _cache_bytes(session: Any) -> int:
    try:
        return session.cache_bytes
    except AttributeError:  # closed meanwhile
        return 0


@dataclass(frozen=True)
class SessionLimits:
    """The admission limits every model service has (its config section's keys), checked as the
    config is read (ValueError naming `[section] key`)."""

    section: ClassVar[str]  # the config section: "verifier" or "drafter"
    max_sessions: int = 64  # concurrent session streams; more is RESOURCE_EXHAUSTED
    # A stream with no message for this long is ended (DEADLINE_EXCEEDED) and its session freed, so
    # idle clients cannot hold every session; 0: never.
    session_idle_s: float = 60.0
    # The batching scheduler (serving/batching.py): the rows and tokens one forward may hold (a step
    # bigger than that runs alone), and how long a step may wait for company when the forward is not
    # full (0: never). max_batch_rows = 1 turns batching off: one step per forward.
    max_batch_rows: int = 32
    max_batch_tokens: int = 512
    batch_wait_ms: float = 0.0

    def __post_init__(self) -> None:
        if self.max_sessions < 1:
            raise ValueError(f"[{self.section}] max_sessions: must be at least 1; got {self.max_sessions}")
        if self.session_idle_s < 0:
            raise ValueError(
                f"[{self.section}] session_idle_s: must be positive, or 0 for never; got {self.session_idle_s}"
            )
        for key in ("max_batch_rows", "max_batch_tokens"):
            if getattr(self, key) < 1:
                raise ValueError(f"[{self.section}] {key}: must be at least 1; got {getattr(self, key)}")
        if self.batch_wait_ms < 0:
            raise ValueError(
                f"[{self.section}] batch_wait_ms: must be positive, or 0 for never; got {self.batch_wait_ms}"
            )


def close(session: Any) -> None:
    """A made session released (`StepExecutor.run_owned`'s release)."""
    session.close()
