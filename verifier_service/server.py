"""The VerifierService: `Verify` bidi streams, one stream = one `VerifierSession` (ARCHITECTURE.md section 4).

Model work runs on `StepExecutor` (a worker thread), never on the event loop. The executor is the
seam for the batching scheduler of ARCHITECTURE.md section 8; today it runs one session's step at a time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from core.checks import check_draft_len, check_ids, check_length, check_wire_top_k
from core.wire import sends_candidates, session_top_k
from protos.specdec.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from seq2seq_models.bundle import ModelBundle, load_bundle
from serving.model_service import ModelService, SessionLimits, make_model_info
from verifier_service.session import VerifierSession, make_verifier

SERVICE = verifier_pb2.DESCRIPTOR.services_by_name["VerifierService"]


@dataclass(frozen=True)
class VerifierLimits(SessionLimits):
    section = "verifier"
    max_draft_len: int = 128  # draft_ids per step; more is OUT_OF_RANGE
    max_source_len: int | None = None  # None: the model's own limit


class VerifierServer(ModelService, verifier_pb2_grpc.VerifierServiceServicer):
    step_seconds_help = "time spent in verify steps"
    draft_tokens_help = "draft tokens scored"
    limits_type = VerifierLimits

    @staticmethod
    def load_models(bundle: str | Path | ModelBundle) -> ModelBundle:
        return bundle if isinstance(bundle, ModelBundle) else load_bundle(bundle, roles=["verifier"])

    def __init__(
        self, bundle: ModelBundle, limits: VerifierLimits, backend: str = "torch", device: str | None = None
    ) -> None:
        add_to_server = verifier_pb2_grpc.add_VerifierServiceServicer_to_server
        super().__init__("verifier", SERVICE, limits.max_sessions, add_to_server, limits.session_idle_s)
        self.bundle = bundle
        self.limits = limits
        self.verifier = make_verifier(bundle, backend, device=device)
        cfg = bundle.verifier.config
        self.max_source_len = min(limits.max_source_len or self.verifier.max_source_len, self.verifier.max_source_len)
        self.max_output_len = self.verifier.max_target_len
        r = self.registry
        self.m_steps = r.counter("verifier_steps", "verify steps (one forward each)")
        self.m_scored = r.counter("verifier_scored_tokens", "tokens scored (append + draft)")
        self.m_queue_s = r.counter("verifier_queue_seconds", "time steps waited for the model worker")
        self.m_batch = r.gauge("verifier_batch_size", "sessions in the last forward")
        self.model_info = make_model_info(
            cfg,
            tokenizer_fingerprint=bundle.tokenizer.fingerprint,
            bundle_fingerprint=bundle.fingerprint,
            max_source_len=self.max_source_len,
            max_target_len=self.max_output_len,
            backend=f"{backend}-{self.verifier.device}",  # e.g. "onnxruntime-cuda:1", "torch-cpu"
            roles=[common_pb2.MODEL_ROLE_VERIFIER],
            max_draft_len=limits.max_draft_len,
            # Speculative sampling asks for the whole distribution (top_k = vocab).
            max_top_k=cfg.vocab_size,
            max_sessions=limits.max_sessions,
        )

    async def warm_up(self) -> None:
        eos = self.model_info.eos_id

        def run() -> None:
            session = self.verifier.open([eos])
            session.step(0, [], [eos], 1)
            session.close()

        await self.executor.run(run)

    # ---- RPCs ----------------------------------------------------------------------------------

    Verify = ModelService.serve_sessions

    def open_session(self, source: list[int], request: verifier_pb2.VerifyOpen) -> VerifierSession:
        return self.verifier.open(source)

    async def _step(self, session: VerifierSession, step: verifier_pb2.VerifyStep) -> verifier_pb2.VerifyResponse:
        vocab = self.model_info.vocab_size
        # Lengths before per-id work: a 16 MiB message holds millions of ids.
        check_draft_len(len(step.draft_ids), self.limits.max_draft_len)
        check_length(step.append_ids, self.max_output_len, "append_ids")
        append, draft = list(step.append_ids), list(step.draft_ids)
        check_wire_top_k(step.top_k, vocab)
        check_ids(append, vocab, "append_ids")
        check_ids(draft, vocab, "draft_ids")
        queued = time.perf_counter()

        def run():
            started = time.perf_counter()
            return started, session.step(step.committed_len, append, draft, session_top_k(step.top_k))

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
            if sends_candidates(step.top_k):
                pos.topk_ids.extend(result.topk_ids[i])
                pos.topk_logprobs.extend(result.topk_logprobs[i])
            if i < len(draft):
                pos.draft_logprob = result.draft_logprobs[i]
            positions.append(pos)
        return verifier_pb2.VerifyResponse(
            step=verifier_pb2.VerifyStepResult(committed_len=step.committed_len + len(append), positions=positions)
        )
