"""A drafter session: the NAR block drafter or the small AR drafter over one source.

This is the in-process `core.interfaces.Drafter`; the gRPC servicer hosts the same sessions.
A session drafts with one model (the first step picks it), so its prefix bookkeeping is single.
The NAR drafter runs on torch or, with the "onnxruntime" backend, on ONNX Runtime
(`drafter_service.onnx_nar`); the AR drafter's beam search and sampling always run on torch.
"""

from __future__ import annotations

import numpy as np

from core.backends import BACKENDS
from core.errors import SpecdecError, StatusCode, invalid, out_of_step
from core.interfaces import Draft
from core.sampling import SamplingParams
from drafter_service.onnx_nar import OnnxNarDrafter, OnnxNarState
from seq2seq_models.drafting import beam_draft, nar_block_draft, sample_draft
from seq2seq_models.prefix_state import PrefixState
from seq2seq_models.transformer import Seq2SeqTransformer

DRAFTER_ROLES = ("nar_drafter", "ar_drafter")


class DrafterSession:
    def __init__(
        self,
        models: dict[str, Seq2SeqTransformer],
        source_ids: list[int],
        seed: int = 0,
        onnx_nar: OnnxNarDrafter | None = None,
    ) -> None:
        self._models = models
        self._onnx_nar = onnx_nar
        self._source = list(source_ids)
        self._rng = np.random.default_rng(seed)
        self._role: str | None = None
        self._state: PrefixState | OnnxNarState | None = None
        if not models:
            raise SpecdecError(StatusCode.FAILED_PRECONDITION, "this drafter hosts no model")

    @property
    def cache_bytes(self) -> int:
        return self._state.cache_bytes if self._state is not None else 0

    def draft_block(self, committed_len: int, append_ids: list[int], k: int) -> Draft:
        state, room = self._sync("nar_drafter", committed_len, append_ids)
        k = min(k, room)
        if not k:
            return Draft(ids=[])
        if isinstance(state, OnnxNarState):
            return Draft(ids=state.draft_block(k))
        return Draft(ids=nar_block_draft(state.model, state.cache, k))

    def draft_beam(self, committed_len: int, append_ids: list[int], gamma: int, num_beams: int) -> Draft:
        state, room = self._sync("ar_drafter", committed_len, append_ids)
        if min(gamma, room) == 0:
            return Draft(ids=[])
        ids, cum = beam_draft(state.model, state.cache, min(gamma, room), num_beams)
        return Draft(ids=ids, cum_logq=cum)

    def draft_sample(
        self, committed_len: int, append_ids: list[int], gamma: int, params: SamplingParams
    ) -> Draft:
        state, room = self._sync("ar_drafter", committed_len, append_ids)
        if min(gamma, room) == 0:
            return Draft(ids=[])
        ids, rows = sample_draft(state.model, state.cache, min(gamma, room), params, self._rng)
        q_rows = []
        for q in rows:
            support = np.flatnonzero(q)
            q_rows.append((support.tolist(), q[support].tolist()))
        return Draft(ids=ids, q_rows=q_rows)

    def close(self) -> None:
        self._state = None

    def _sync(self, role: str, committed_len: int, append_ids: list[int]) -> tuple[PrefixState | OnnxNarState, int]:
        """Bring the role's state to the client's prefix; returns it and how many tokens still fit."""
        if role not in self._models:
            raise SpecdecError(StatusCode.FAILED_PRECONDITION, f"this drafter does not host a {role}")
        if self._state is None:
            self._role = role
            if role == "nar_drafter" and self._onnx_nar is not None:
                self._state = self._onnx_nar.open(self._source)
            else:
                self._state = PrefixState(self._models[role], self._source)
        elif role != self._role:
            raise out_of_step(f"this session drafts with the {self._role}; open a new one for the {role}")
        self._state.sync(committed_len, append_ids)
        # Drafts past the model's length limit are cut rather than refused: a draft is a guess.
        return self._state, self._state.max_tokens - len(self._state.tokens)


class LocalDrafter:
    """In-process drafter over a bundle's NAR and/or small AR drafter; `onnx_nar` (the NAR drafter
    exported to ONNX Runtime) replaces the torch NAR drafter when given."""

    def __init__(self, models: dict[str, Seq2SeqTransformer], onnx_nar: OnnxNarDrafter | None = None) -> None:
        if not models:
            raise ValueError("a drafter needs at least one model")
        self.models = models
        self.onnx_nar = onnx_nar
        self.vocab_size = next(iter(models.values())).config.vocab_size

    @property
    def backend(self) -> str:
        """The NAR drafter's backend (the AR drafter always runs on torch)."""
        return "onnxruntime" if self.onnx_nar is not None else "torch"

    def open(self, source_ids: list[int], seed: int = 0) -> DrafterSession:
        return DrafterSession(self.models, source_ids, seed, self.onnx_nar)


def make_drafter(bundle, backend: str = "torch", device: str | None = None, **onnx_options) -> LocalDrafter | None:
    """The bundle's drafter models (None when it has none), the NAR one on `backend`: "torch", or
    "onnxruntime" (exported on first use and cached by bundle fingerprint, like the verifier's;
    `onnx_options` go to `OnnxNarDrafter.from_bundle`: cache_root, intra_op_threads). `device`
    ("auto", "cpu", "cuda", "cuda:N"; None: the CPU): where every drafter model runs, the torch ones
    moved there and the ONNX one on that GPU's CUDA provider; a missing GPU is a ValueError."""
    if backend not in BACKENDS:
        raise invalid(f"unknown drafter backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    models = {r: bundle.models[r] for r in DRAFTER_ROLES if r in bundle.models}
    if not models:
        return None
    if device is not None:
        from seq2seq_models.ort_runner import resolve_device

        torch_device = resolve_device(device)
        models = {r: m.to(torch_device) for r, m in models.items()}
    onnx_nar = None
    if backend == "onnxruntime" and "nar_drafter" in models:
        onnx_nar = OnnxNarDrafter.from_bundle(bundle, device=device, **onnx_options)
    return LocalDrafter(models, onnx_nar)
