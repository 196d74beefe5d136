"""The VerifierService: `Verify` bidi streams, one stream = one `VerifierSession` (DESIGN section 2).

Model work runs on `StepExecutor` (a worker thread), never on the event loop. The executor is the
seam for the batching scheduler of DESIGN section 4; today it runs one session's step at a time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from core.errors import invalid, out_of_range
from protos.specdec.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from seq2seq_models.bundle import ModelBundle, load_bundle
from serving.host import ServiceHost
from serving.metrics import Registry
from serving.sessions import SessionStreams, StepExecutor
from verifier_service.session import VerifierSession, make_verifier

SERVICE_NAME = verifier_pb2.DESCRIPTOR.services_by_name["VerifierService"].full_name


@dataclass(frozen=True)
class VerifierLimits:
    max_sessions: int = 64  # concurrent Verify streams; more is RESOURCE_EXHAUSTED
    max_draft_len: int = 128  # draft_ids per step; more is OUT_OF_RANGE
    max_source_len: int | None = None  # None: the model's own limit


async def start_verifier(
    bundle: str | Path | ModelBundle,
    address: str = "127.0.0.1:0",
    limits: VerifierLimits | None = None,
    metrics_address: str | None = None,
    backend: str = "torch",
) -> VerifierServer:
    """Load the bundle's verifier on `backend`, start serving on `address`, warm up, then report SERVING."""
    if not isinstance(bundle, ModelBundle):
        bundle = load_bundle(bundle, roles=["verifier"])
    server = VerifierServer(bundle, limits or VerifierLimits(), backend)
    await server.host.start(address, metrics_address)
    await server.warm_up()
    await server.host.set_serving(backend=server.model_info.backend, bundle=server.model_info.bundle_fingerprint[:16])
    return server


class VerifierServer(verifier_pb2_grpc.VerifierServiceServicer):
    def __init__(self, bundle: ModelBundle, limits: VerifierLimits, backend: str = "torch") -> None:
        self.bundle = bundle
        self.limits = limits
        self.verifier = make_verifier(bundle, backend)
        cfg = bundle.verifier.config
        self.max_source_len = min(limits.max_source_len or self.verifier.max_source_len, self.verifier.max_source_len)
        # The seam for the batching scheduler (DESIGN section 4): every model call goes through it.
        self.executor = StepExecutor("verifier")
        self.registry = Registry()
        self.host = ServiceHost("verifier", [SERVICE_NAME], self.registry)
        self.streams = SessionStreams(self.host, self.executor, self.registry, "Verify", limits.max_sessions)
        self._define_metrics()
        verifier_pb2_grpc.add_VerifierServiceServicer_to_server(self, self.host.server)
        device = bundle.verifier.embed.weight.device
        self.model_info = common_pb2.ModelInfo(
            vocab_size=cfg.vocab_size,
            pad_id=cfg.pad_id,
            unk_id=cfg.unk_id,
            bos_id=cfg.bos_id,
            eos_id=cfg.eos_id,
            mask_id=cfg.mask_id,
            tokenizer_fingerprint=bundle.tokenizer.fingerprint,
            bundle_fingerprint=bundle.fingerprint,
            max_source_len=self.max_source_len + 1,  # the wire counts the source's EOS
            max_target_len=cfg.max_len,  # the wire counts the decoder start token
            backend=f"{backend}-{device.type}",
            roles=[common_pb2.MODEL_ROLE_VERIFIER],
            max_draft_len=limits.max_draft_len,
            # Speculative sampling asks for the whole distribution (top_k = vocab).
            max_top_k=cfg.vocab_size,
        )

    @property
    def active_sessions(self) -> int:
        return len(self.streams.sessions)

    async def warm_up(self) -> None:
        """One session and one step, so the first real request does not pay for lazy init."""

        def run() -> None:
            session = self.verifier.open([self.bundle.verifier.config.eos_id])
            session.step(0, [], [self.bundle.verifier.config.eos_id], 1)
            session.close()

        await self.executor.run(run)

    async def stop(self, grace: float = 10.0) -> None:
        await self.host.drain(grace)
        self.executor.shutdown()

    # ---- RPCs ----------------------------------------------------------------------------------

    async def GetModelInfo(self, request, context):
        return verifier_pb2.VerifierServiceGetModelInfoResponse(model_info=self.model_info)

    async def Verify(self, request_iterator, context):
        async for response in self.streams.serve(request_iterator, context, self._open, self._step):
            yield response

    async def _open(self, request: verifier_pb2.VerifyOpen) -> tuple[VerifierSession, verifier_pb2.VerifyResponse]:
        source = list(request.source_ids)
        if len(source) > self.max_source_len:
            raise out_of_range(f"source has {len(source)} tokens; the limit is {self.max_source_len}")
        session = await self.executor.run(self.verifier.open, source)
        opened = verifier_pb2.VerifyOpened(source_len=len(source), max_output_len=self.verifier.max_target_len)
        return session, verifier_pb2.VerifyResponse(opened=opened)

    async def _step(self, session: VerifierSession, step: verifier_pb2.VerifyStep) -> verifier_pb2.VerifyResponse:
        vocab = self.model_info.vocab_size
        if len(step.draft_ids) > self.limits.max_draft_len:
            raise out_of_range(f"draft has {len(step.draft_ids)} tokens; the limit is {self.limits.max_draft_len}")
        if not 0 <= step.top_k <= vocab:
            raise invalid(f"top_k must be in [0, {vocab}], got {step.top_k}")
        queued = time.perf_counter()
        append, draft = list(step.append_ids), list(step.draft_ids)

        def run():
            started = time.perf_counter()
            return started, session.step(step.committed_len, append, draft, max(step.top_k, 1))

        started, result = await self.executor.run(run)
        done = time.perf_counter()
        self.m_steps.inc()
        self.m_batch.set(1)  # no batching scheduler yet: every forward is one session's step
        self.m_queue_s.inc(started - queued)
        self.m_step_s.inc(done - started)
        self.m_scored.inc(len(append) + len(draft))
        self.m_draft_tokens.inc(len(draft))
        positions = []
        for i, top1 in enumerate(result.top1):
            pos = verifier_pb2.Position(top1=top1)
            if step.top_k:
                pos.topk_ids.extend(result.topk_ids[i])
                pos.topk_logprobs.extend(result.topk_logprobs[i])
            if i < len(draft):
                pos.draft_logprob = result.draft_logprobs[i]
            positions.append(pos)
        return verifier_pb2.VerifyResponse(
            step=verifier_pb2.VerifyStepResult(committed_len=step.committed_len + len(append), positions=positions)
        )

    def _define_metrics(self) -> None:
        r = self.registry
        self.m_steps = r.counter("verifier_steps", "verify steps (one forward each)")
        self.m_scored = r.counter("verifier_scored_tokens", "tokens scored (append + draft)")
        self.m_draft_tokens = r.counter("verifier_draft_tokens", "draft tokens scored")
        self.m_queue_s = r.counter("verifier_queue_seconds", "time steps waited for the model worker")
        self.m_step_s = r.counter("verifier_step_seconds", "time spent in verify steps")
        self.m_batch = r.gauge("verifier_batch_size", "sessions in the last forward")
        self.m_kv = r.gauge("verifier_kv_cache_bytes", "KV cache bytes held by open sessions")
        r.on_collect(lambda: self.m_kv.set(sum(_cache_bytes(s) for s in list(self.streams.sessions))))


def _cache_bytes(session: VerifierSession) -> int:
    try:
        return session.cache_bytes
    except AttributeError:  # closed meanwhile
        return 0
