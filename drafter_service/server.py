"""The DrafterService: `Draft` bidi streams, one stream = one `DrafterSession` (DESIGN section 2).

Hosts the bundle's NAR block drafter and/or small AR drafter. Model work runs on a worker thread.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from core.errors import invalid, out_of_range
from core.interfaces import Draft
from core.sampling import SamplingParams
from drafter_service.session import DRAFTER_ROLES, DrafterSession, LocalDrafter, make_drafter
from protos.specdec.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc
from seq2seq_models.bundle import ModelBundle, bundle_roles, load_bundle
from serving.host import ServiceHost
from serving.metrics import Registry
from serving.sessions import SessionStreams, StepExecutor

SERVICE_NAME = drafter_pb2.DESCRIPTOR.services_by_name["DrafterService"].full_name

_ROLE_ENUM = {"nar_drafter": common_pb2.MODEL_ROLE_NAR_DRAFTER, "ar_drafter": common_pb2.MODEL_ROLE_AR_DRAFTER}


@dataclass(frozen=True)
class DrafterLimits:
    max_sessions: int = 64  # concurrent Draft streams; more is RESOURCE_EXHAUSTED
    max_draft_len: int = 64  # k / gamma per step; more is OUT_OF_RANGE


async def start_drafter(
    bundle: str | Path | ModelBundle,
    address: str = "127.0.0.1:0",
    limits: DrafterLimits | None = None,
    metrics_address: str | None = None,
    roles: Iterable[str] | None = None,
    backend: str = "torch",
) -> DrafterServer:
    """Load the bundle's drafter(s), the NAR one on `backend`, start serving on `address`, warm up,
    then report SERVING."""
    if not isinstance(bundle, ModelBundle):
        bundle = _load_drafters(Path(bundle), roles)
    server = DrafterServer(bundle, limits or DrafterLimits(), backend)
    await server.host.start(address, metrics_address)
    await server.warm_up()
    await server.host.set_serving(backend=server.model_info.backend, bundle=server.model_info.bundle_fingerprint[:16])
    return server


class DrafterServer(drafter_pb2_grpc.DrafterServiceServicer):
    def __init__(self, bundle: ModelBundle, limits: DrafterLimits, backend: str = "torch") -> None:
        self.bundle = bundle
        self.limits = limits
        drafter = make_drafter(bundle, backend)
        if drafter is None:
            raise ValueError(f"bundle {bundle.path} has no drafter model")
        self.drafter = drafter
        self.models = drafter.models
        cfg = next(iter(self.models.values())).config
        self.max_len = min(m.config.max_len for m in self.models.values())
        self.executor = StepExecutor("drafter")
        self.registry = Registry()
        self.host = ServiceHost("drafter", [SERVICE_NAME], self.registry)
        self.streams = SessionStreams(self.host, self.executor, self.registry, "Draft", limits.max_sessions)
        self._define_metrics()
        drafter_pb2_grpc.add_DrafterServiceServicer_to_server(self, self.host.server)
        device = next(iter(self.models.values())).embed.weight.device
        self.model_info = common_pb2.ModelInfo(
            vocab_size=cfg.vocab_size,
            pad_id=cfg.pad_id,
            unk_id=cfg.unk_id,
            bos_id=cfg.bos_id,
            eos_id=cfg.eos_id,
            mask_id=cfg.mask_id,
            tokenizer_fingerprint=bundle.tokenizer.fingerprint,
            bundle_fingerprint=bundle.fingerprint,
            max_source_len=self.max_len,
            max_target_len=self.max_len,
            backend=_backend_name(self.drafter, device.type),
            roles=[_ROLE_ENUM[r] for r in self.models],
            max_draft_len=limits.max_draft_len,
            max_top_k=0,
        )

    @property
    def active_sessions(self) -> int:
        return len(self.streams.sessions)

    async def warm_up(self) -> None:
        eos = self.model_info.eos_id

        def run() -> None:
            for role in self.models:
                session = self.drafter.open([eos], seed=0)
                if role == "nar_drafter":
                    session.draft_block(0, [], 1)
                else:
                    session.draft_beam(0, [], 1, 1)
                session.close()

        await self.executor.run(run)

    async def stop(self, grace: float = 10.0) -> None:
        await self.host.drain(grace)
        self.executor.shutdown()

    # ---- RPCs ----------------------------------------------------------------------------------

    async def GetModelInfo(self, request, context):
        return drafter_pb2.DrafterServiceGetModelInfoResponse(model_info=self.model_info)

    async def Draft(self, request_iterator, context):
        async for response in self.streams.serve(request_iterator, context, self._open, self._step):
            yield response

    async def _open(self, request: drafter_pb2.DraftOpen) -> tuple[DrafterSession, drafter_pb2.DraftResponse]:
        source = list(request.source_ids)
        if len(source) >= self.max_len:
            raise out_of_range(f"source has {len(source)} tokens; the limit is {self.max_len - 1}")
        seed = request.seed if request.HasField("seed") else secrets.randbits(63)
        session = await self.executor.run(self.drafter.open, source, seed)
        opened = drafter_pb2.DraftOpened(source_len=len(source), max_output_len=self.max_len - 1)
        return session, drafter_pb2.DraftResponse(opened=opened)

    async def _step(self, session: DrafterSession, step: drafter_pb2.DraftStep) -> drafter_pb2.DraftResponse:
        method = step.WhichOneof("method")
        committed, append = step.committed_len, list(step.append_ids)
        if method == "block":
            n, call = step.block.k, lambda: session.draft_block(committed, append, step.block.k)
        elif method == "beam":
            beam = step.beam
            n, call = beam.gamma, lambda: session.draft_beam(committed, append, beam.gamma, beam.num_beams)
        elif method == "sample":
            s = step.sample
            params = SamplingParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p or 1.0)
            _check_sampling(params)
            n, call = s.gamma, lambda: session.draft_sample(committed, append, s.gamma, params)
        else:
            raise invalid("a DraftStep needs one of block, beam or sample")
        if n > self.limits.max_draft_len:
            raise out_of_range(f"draft length {n} is over the limit {self.limits.max_draft_len}")
        started = time.perf_counter()
        draft: Draft = await self.executor.run(call)
        self.m_step_s.inc(time.perf_counter() - started, kind=method)
        self.m_drafts.inc(kind=method)
        self.m_draft_tokens.inc(len(draft.ids), kind=method)
        result = drafter_pb2.DraftResult(committed_len=committed + len(append), ids=draft.ids, cum_logq=draft.cum_logq)
        for ids, probs in draft.q_rows:
            result.q_rows.add(ids=ids, probs=probs)
        return drafter_pb2.DraftResponse(result=result)

    def _define_metrics(self) -> None:
        r = self.registry
        self.m_drafts = r.counter("drafter_drafts", "drafts made, by kind")
        self.m_draft_tokens = r.counter("drafter_draft_tokens", "draft tokens made, by kind")
        self.m_step_s = r.counter("drafter_step_seconds", "time spent drafting, by kind")
        self.m_kv = r.gauge("drafter_kv_cache_bytes", "KV cache bytes held by open sessions")
        r.on_collect(lambda: self.m_kv.set(sum(_cache_bytes(s) for s in list(self.streams.sessions))))


def _load_drafters(path: Path, roles: Iterable[str] | None) -> ModelBundle:
    available = bundle_roles(path)
    wanted = [r for r in (roles or DRAFTER_ROLES) if r in available]
    if not wanted:
        raise ValueError(f"bundle {path} has no drafter model")
    return load_bundle(path, roles=wanted)


def _backend_name(drafter: LocalDrafter, device: str) -> str:
    """ "torch-cpu", or per role when they differ: "nar_drafter:onnxruntime-cpu,ar_drafter:torch-cpu"."""
    names = {r: "onnxruntime-cpu" if r == "nar_drafter" and drafter.onnx_nar else f"torch-{device}"
             for r in drafter.models}
    if len(set(names.values())) == 1:
        return next(iter(names.values()))
    return ",".join(f"{r}:{n}" for r, n in names.items())


def _check_sampling(params: SamplingParams) -> None:
    if not params.temperature >= 0:
        raise invalid(f"temperature must be >= 0, got {params.temperature}")
    if params.top_k < 0:
        raise invalid(f"top_k must be >= 0, got {params.top_k}")
    if not 0 < params.top_p <= 1:
        raise invalid(f"top_p must be in (0, 1], got {params.top_p}")


def _cache_bytes(session: DrafterSession) -> int:
    try:
        return session.cache_bytes
    except AttributeError:
        return 0
