"""The DrafterService: `Draft` bidi streams, one stream = one `DrafterSession` (ARCHITECTURE.md, "Wire contracts").

Hosts the bundle's NAR block drafter and/or small AR drafter. Model work runs on a worker thread;
NAR block drafts of concurrent sessions are batched into one forward (serving/batching.py).
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from core.backends import DEFAULT_PRECISION
from core.checks import check_bounded, check_draft_len, check_ids, check_length, check_positive
from core.errors import invalid
from core.interfaces import BlockCall, Draft
from core.sampling import check_sampling
from core.wire import sampling_from_wire
from drafter_service.session import DRAFTER_ROLES, DrafterSession, make_drafter
from protos.specdec.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc
from seq2seq_models.bundle import ModelBundle, bundle_roles, load_bundle
from serving.batching import BatchStats, one_by_one, with_batch_load
from serving.model_service import ModelService, SessionLimits, make_model_info

SERVICE = drafter_pb2.DESCRIPTOR.services_by_name["DrafterService"]

_ROLE_ENUM = {"nar_drafter": common_pb2.MODEL_ROLE_NAR_DRAFTER, "ar_drafter": common_pb2.MODEL_ROLE_AR_DRAFTER}


@dataclass(frozen=True)
class DrafterLimits(SessionLimits):
    section = "drafter"
    max_draft_len: int = 64  # k / gamma per step; more is OUT_OF_RANGE
    # Beams per AR beam draft; more is OUT_OF_RANGE. A step's cost grows with beams x vocabulary,
    # and it holds the one model worker every session shares (RELIABILITY.md, "Input limits and fuzzing").
    max_beams: int = 16


class DrafterServer(ModelService, drafter_pb2_grpc.DrafterServiceServicer):
    limits_type = DrafterLimits

    @staticmethod
    def load_models(bundle: str | Path | ModelBundle) -> ModelBundle:
        """The bundle's NAR and/or AR drafter (whichever it has)."""
        return bundle if isinstance(bundle, ModelBundle) else _load_drafters(Path(bundle))

    def __init__(
        self, bundle: ModelBundle, limits: DrafterLimits, backend: str = "torch", device: str | None = None,
        precision: str = DEFAULT_PRECISION, intra_op_threads: int = 0,
    ) -> None:
        drafter = make_drafter(
            bundle, backend, device=device, precision=precision, intra_op_threads=intra_op_threads or None
        )
        if drafter is None:
            raise ValueError(f"bundle {bundle.path} has no drafter model")
        super().__init__(
            "drafter", SERVICE, bundle, limits, drafter_pb2_grpc.add_DrafterServiceServicer_to_server,
            metric_help=("time spent drafting, by kind", "draft tokens made, by kind"),
        )
        self.drafter = drafter
        self.models = drafter.models
        first = next(iter(self.models.values()))
        # Sessions hold max_len - 1 source tokens (plus EOS) and output tokens (plus BOS).
        self.max_source_len = self.max_output_len = min(m.config.max_len for m in self.models.values()) - 1
        self.m_drafts = self.registry.counter("drafter_drafts", "drafts made, by kind")
        if drafter.nar is not None:  # the NAR drafter encodes its new sessions' sources in their first draft
            drafter.nar.on_encode = self.encoder_metrics()
        # NAR block drafts of concurrent sessions gathered into one forward (serving/batching.py).
        self.scheduler = self.make_scheduler(self._run_batch, limits)
        self.model_info = make_model_info(
            first.config,
            tokenizer_fingerprint=bundle.tokenizer.fingerprint,
            bundle_fingerprint=bundle.fingerprint,
            max_source_len=self.max_source_len,
            max_target_len=self.max_output_len,
            backend=drafter.backend_name,
            roles=[_ROLE_ENUM[r] for r in self.models],
            max_draft_len=limits.max_draft_len,
            max_top_k=0,
            max_sessions=limits.max_sessions,
        )

    async def warm_up(self) -> None:
        eos = self.model_info.eos_id

        def run() -> None:
            for role in self.models:
                session = self.drafter.open([eos], seed=0)
                if role == "nar_drafter":  # through the batch path blocks take (draft_batch if any)
                    for result in self._run_batch([(session, BlockCall(0, [], 1))]):
                        if isinstance(result, BaseException):
                            raise result
                else:
                    session.draft_beam(0, [], 1, 1)
                session.close()

        await self.executor.run(run)

    # ---- RPCs ----------------------------------------------------------------------------------

    Draft = ModelService.serve_sessions

    def open_session(self, source: list[int], request: drafter_pb2.DraftOpen) -> DrafterSession:
        seed = request.seed if request.HasField("seed") else secrets.randbits(63)
        return self.drafter.open(source, seed)

    async def _step(self, session: DrafterSession, step: drafter_pb2.DraftStep) -> drafter_pb2.DraftResponse:
        method = step.WhichOneof("method")
        committed = step.committed_len
        check_length(step.append_ids, self.max_output_len, "append_ids")
        append = list(step.append_ids)
        check_ids(append, self.model_info.vocab_size, "append_ids")
        if method == "block":
            n = step.block.k
            check_positive(n, "k")
            check_draft_len(n, self.limits.max_draft_len)
            # NAR blocks of concurrent sessions share a forward (the scheduler's batch).
            draft: Draft = await self.scheduler.submit(session, BlockCall(committed, append, n))
        else:
            # AR drafts (beam, sample) run one at a time on the same worker.
            started = time.perf_counter()
            draft = await self.executor.run(self._ar_call(session, step, method, committed, append))
            self.m_step_s.inc(time.perf_counter() - started, kind=method)
        self.m_drafts.inc(kind=method)
        self.m_draft_tokens.inc(len(draft.ids), kind=method)
        result = drafter_pb2.DraftResult(
            committed_len=committed + len(append), ids=draft.ids, cum_logq=draft.cum_logq,
            batch_rows=draft.batch_rows if draft.batch_tokens else 0, batch_tokens=draft.batch_tokens,
            forward_ms=draft.forward_s * 1000.0,
        )
        for ids, probs in draft.q_rows:
            result.q_rows.add(ids=ids, probs=probs)
        return drafter_pb2.DraftResponse(result=result)

    def _ar_call(self, session: DrafterSession, step: drafter_pb2.DraftStep, method: str | None, committed, append):
        """An AR draft step, checked, as a call for the worker."""
        if method == "beam":
            n, num_beams = step.beam.gamma, step.beam.num_beams
            check_positive(n, "gamma")
            check_bounded("num_beams", num_beams, 1, self.limits.max_beams)
            call = partial(session.draft_beam, committed, append, n, num_beams)
        elif method == "sample":
            s = step.sample
            n, params = s.gamma, sampling_from_wire(s.temperature, s.top_k, s.top_p)
            check_positive(n, "gamma")
            check_sampling(params, self.model_info.vocab_size)
            call = partial(session.draft_sample, committed, append, n, params)
        else:
            raise invalid("a DraftStep needs one of block, beam or sample")
        check_draft_len(n, self.limits.max_draft_len)
        return call

    def _run_batch(self, items: list[tuple[DrafterSession, BlockCall]]) -> list:
        """Worker thread: NAR blocks as one forward (the backend's `draft_batch`), or one by one;
        each draft stamped with the batch it ran in (the cost a client's adaptive speculation reads)."""
        started = time.perf_counter()
        draft_batch = getattr(self.drafter, "draft_batch", None)
        results = draft_batch(items) if draft_batch is not None else one_by_one(items, _draft_block)
        tokens = sum(call.n_tokens for _, call in items)
        return with_batch_load(results, len(items), tokens, time.perf_counter() - started)

    def observe_batch(self, stats: BatchStats) -> None:
        super().observe_batch(stats)
        self.m_step_s.inc(stats.forward_s, kind="block")


def _draft_block(session: DrafterSession, call: BlockCall) -> Draft:
    return session.draft_block(call.committed_len, call.append_ids, call.k)


def _load_drafters(path: Path) -> ModelBundle:
    available = bundle_roles(path)
    wanted = [r for r in DRAFTER_ROLES if r in available]
    if not wanted:
        raise ValueError(f"bundle {path} has no drafter model")
    return load_bundle(path, roles=wanted)
