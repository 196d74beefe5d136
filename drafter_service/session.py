"""A drafter session: the NAR block drafter or the small AR drafter over one source.

This is the in-process `core.interfaces.Drafter`; the gRPC servicer hosts the same sessions.
A session drafts with one model (the first step picks it), so its prefix bookkeeping is single.
The NAR drafter's rows are `drafter_service.nar_batch`'s, on eager torch or, with the
"onnxruntime" backend, on ONNX Runtime (`drafter_service.onnx_nar`): `LocalDrafter.draft_batch`
drafts the NAR blocks of many sessions in one forward, and `draft_block` is a batch of one. The
AR drafter's beam search and sampling run one session at a time, on torch (`drafter_service.torch_ar`)
or on ONNX Runtime (`drafter_service.onnx_ar`), behind one small interface (`ArDrafter`).

This module imports no torch: with the "onnxruntime" backend and the graphs exported, a drafter runs
on an install without it (the runtime image).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np

from core.backends import BACKENDS, DEFAULT_PRECISION, check_backend_installed, check_precision
from core.errors import SpecdecError, StatusCode, invalid, out_of_step
from core.interfaces import BlockCall, Draft
from core.sampling import SamplingParams
from drafter_service.nar_batch import BatchNarDrafter, NarRow
from drafter_service.onnx_ar import OnnxArDrafter
from drafter_service.onnx_nar import OnnxNarDrafter
from seq2seq_models.torch_threads import set_torch_threads

DRAFTER_ROLES = ("nar_drafter", "ar_drafter")


class ArDrafter(Protocol):
    """The small AR drafter on one backend; a row is one session's prefix state (`tokens`,
    `max_tokens`, `cache_bytes`, `sync`)."""

    backend_label: str

    def open(self, source_ids: list[int]) -> Any: ...

    def beam(self, row: Any, gamma: int, num_beams: int) -> tuple[list[int], list[float]]: ...

    def sample(
        self, row: Any, gamma: int, params: SamplingParams, rng: np.random.Generator
    ) -> tuple[list[int], list[np.ndarray]]: ...


class DrafterSession:
    def __init__(
        self,
        models: Mapping[str, Any],
        source_ids: list[int],
        seed: int = 0,
        nar: BatchNarDrafter | None = None,
        ar: ArDrafter | None = None,
    ) -> None:
        self._models = models  # role -> its model (torch, or ONNX Runtime): which roles this drafter hosts
        self.nar = nar  # the NAR drafter's rows (None: this drafter has no NAR model)
        self.ar = ar  # the AR drafter (None: this drafter has no AR model)
        self._source = list(source_ids)
        self._rng = np.random.default_rng(seed)
        self._role: str | None = None
        self._state: Any = None  # a NarRow, or the AR drafter's row
        self.closed = False
        if not models:
            raise SpecdecError(StatusCode.FAILED_PRECONDITION, "this drafter hosts no model")

    @property
    def cache_bytes(self) -> int:
        return self._state.cache_bytes if self._state is not None else 0

    def draft_block(self, committed_len: int, append_ids: list[int], k: int) -> Draft:
        result = draft_blocks([(self, BlockCall(committed_len, append_ids, k))])[0]
        if isinstance(result, BaseException):
            raise result
        return result

    def block_row(self, call: BlockCall) -> tuple[NarRow, int]:
        """Bring the NAR row to the call's prefix; returns it and the draft's k, cut to what fits."""
        state, room = self._sync("nar_drafter", call.committed_len, call.append_ids)
        assert isinstance(state, NarRow)
        return state, min(call.k, room)

    def draft_greedy_block(self, call: BlockCall) -> Draft:
        """A block drafted greedily by the AR drafter: GAD's draft where the bundle has no NAR
        drafter (an imported checkpoint with a smaller one of its vocabulary), one token a step."""
        state, room = self._sync("ar_drafter", call.committed_len, call.append_ids)
        k = min(call.k, room)
        if k == 0:
            return Draft(ids=[])
        assert self.ar is not None
        ids, _ = self.ar.beam(state, k, 1)
        return Draft(ids=ids)

    def draft_beam(self, committed_len: int, append_ids: list[int], gamma: int, num_beams: int) -> Draft:
        state, room = self._sync("ar_drafter", committed_len, append_ids)
        if min(gamma, room) == 0:
            return Draft(ids=[])
        assert self.ar is not None
        ids, cum = self.ar.beam(state, min(gamma, room), num_beams)
        return Draft(ids=ids, cum_logq=cum)

    def draft_sample(
        self, committed_len: int, append_ids: list[int], gamma: int, params: SamplingParams
    ) -> Draft:
        state, room = self._sync("ar_drafter", committed_len, append_ids)
        if min(gamma, room) == 0:
            return Draft(ids=[])
        assert self.ar is not None
        ids, rows = self.ar.sample(state, min(gamma, room), params, self._rng)
        q_rows = []
        for q in rows:
            support = np.flatnonzero(q)
            q_rows.append((support.tolist(), q[support].tolist()))
        return Draft(ids=ids, q_rows=q_rows)

    def close(self) -> None:
        self.closed = True
        if isinstance(self._state, NarRow):
            self._state.close()  # a draft of it running now is refused when its forward ends
        self._state = None

    def _sync(self, role: str, committed_len: int, append_ids: list[int]) -> tuple[Any, int]:
        """Bring the role's state to the client's prefix; returns it and how many tokens still fit."""
        if self.closed:
            raise out_of_step("the session is closed")
        if role not in self._models:
            raise SpecdecError(StatusCode.FAILED_PRECONDITION, f"this drafter does not host a {role}")
        if self._state is None:
            self._role = role
            if role == "nar_drafter" and self.nar is not None:
                self._state = self.nar.open(self._source)
            elif role == "ar_drafter" and self.ar is not None:
                self._state = self.ar.open(self._source)
            else:
                raise SpecdecError(StatusCode.FAILED_PRECONDITION, f"this drafter has no backend for its {role}")
        elif role != self._role:
            raise out_of_step(f"this session drafts with the {self._role}; open a new one for the {role}")
        self._state.sync(committed_len, append_ids)
        # Drafts past the model's length limit are cut rather than refused: a draft is a guess.
        return self._state, self._state.max_tokens - len(self._state.tokens)


def draft_blocks(items: list[tuple[DrafterSession, BlockCall]]) -> list[Draft | BaseException]:
    """The NAR blocks of `items` (sessions of one drafter) in one forward; one outcome per item, in
    order: its `Draft`, or the exception it raised (a closed session, a step out of step, ...)
    without failing the others. A drafter with only an AR model drafts each block greedily."""
    outcomes: list[Draft | BaseException | None] = [None] * len(items)
    rows: list[tuple[NarRow, int]] = []
    slots: list[int] = []
    nar: BatchNarDrafter | None = None
    seen: set[int] = set()
    for slot, (session, call) in enumerate(items):
        try:
            if id(session) in seen:  # checked before syncing, so the first call's prefix stands
                raise out_of_step("the session already has a draft in this batch")
            seen.add(id(session))
            if session.nar is None and session.ar is not None:  # no NAR drafter: AR greedy blocks
                outcomes[slot] = session.draft_greedy_block(call)
                continue
            if nar is not None and session.nar is not nar:
                raise ValueError("the sessions of one batch must belong to one drafter")
            row, k = session.block_row(call)
            nar = session.nar
            if k:
                rows.append((row, k))
                slots.append(slot)
            else:
                outcomes[slot] = Draft(ids=[])  # nothing fits: no forward
        except Exception as e:  # the item's own failure goes in its slot
            outcomes[slot] = e
    if rows:
        assert nar is not None
        for slot, result in zip(slots, nar.draft_rows(rows), strict=True):
            outcomes[slot] = result if isinstance(result, BaseException) else Draft(ids=result)
    return outcomes  # type: ignore[return-value]


class LocalDrafter:
    """In-process drafter over a bundle's NAR and/or small AR drafter. `models` maps each role to its
    torch model; `onnx_nar` / `onnx_ar` (exported to ONNX Runtime) replace the torch ones when given,
    and a role with one needs no torch model (`models` may hold the ONNX model itself)."""

    def __init__(
        self, models: Mapping[str, Any], onnx_nar: OnnxNarDrafter | None = None, onnx_ar: OnnxArDrafter | None = None,
    ) -> None:
        if not models:
            raise ValueError("a drafter needs at least one model")
        self.models = models
        self.onnx_nar = onnx_nar
        self.onnx_ar = onnx_ar
        self.vocab_size = next(iter(models.values())).config.vocab_size
        self.nar: BatchNarDrafter | None = onnx_nar
        if self.nar is None and "nar_drafter" in models:
            from drafter_service.torch_nar import torch_nar_drafter

            self.nar = torch_nar_drafter(models["nar_drafter"])
        self.ar: ArDrafter | None = onnx_ar
        if self.ar is None and "ar_drafter" in models:
            from drafter_service.torch_ar import TorchArDrafter

            self.ar = TorchArDrafter(models["ar_drafter"])

    def twin(self) -> LocalDrafter:
        """A drafter over the same models with NAR rows of its own (`BatchNarDrafter.twin`); the AR
        drafter's sessions keep their own state, so it is shared as it is."""
        other = copy.copy(self)
        if self.nar is not None:
            other.nar = self.nar.twin()
            if self.onnx_nar is not None:
                other.onnx_nar = other.nar  # type: ignore[assignment]
        return other

    def reserve_rows(self, rows: int) -> None:
        """Room for `rows` NAR rows at once (`BatchNarDrafter.reserve_rows`)."""
        if self.nar is not None:
            self.nar.reserve_rows(rows)

    def draft_batch(self, items: list[tuple[DrafterSession, BlockCall]]) -> list[Draft | BaseException]:
        """NAR block drafts of many sessions in one forward (`draft_blocks`), one outcome per item;
        a session of another drafter is refused in its slot. AR steps are not batched."""
        outcomes: list[Draft | BaseException] = [ValueError("the session does not belong to this drafter")] * len(items)
        own = [i for i, (s, _) in enumerate(items) if isinstance(s, DrafterSession) and s.nar is self.nar]
        for i, result in zip(own, draft_blocks([items[i] for i in own]), strict=True):
            outcomes[i] = result
        return outcomes

    @property
    def backend(self) -> str:
        """The NAR drafter's backend, or the AR drafter's when there is no NAR drafter (`backend_name`
        has every role's)."""
        main = self.onnx_nar if "nar_drafter" in self.models else self.onnx_ar
        return "onnxruntime" if main is not None else "torch"

    @property
    def backend_name(self) -> str:
        """GetModelInfo.backend: "torch-cpu", "onnxruntime-cpu", or per role when they differ:
        "nar_drafter:onnxruntime-cpu-int8,ar_drafter:onnxruntime-cpu"."""
        labels = {}
        for role in self.models:
            onnx = self.onnx_nar if role == "nar_drafter" else self.onnx_ar
            labels[role] = onnx.backend_label if onnx is not None else f"torch-{_torch_device(self.models[role])}"
        if len(set(labels.values())) == 1:
            return next(iter(labels.values()))
        return ",".join(f"{r}:{n}" for r, n in labels.items())

    def open(self, source_ids: list[int], seed: int = 0) -> DrafterSession:
        return DrafterSession(self.models, source_ids, seed, self.nar, self.ar)


def make_drafter(
    bundle, backend: str = "torch", device: str | None = None, precision: str = DEFAULT_PRECISION, **onnx_options
) -> LocalDrafter | None:
    """The bundle's drafter models (None when it has none), on `backend`: "torch", or "onnxruntime"
    (both drafters exported on first use and cached by bundle fingerprint, like the verifier's, or
    exported ahead by `specdec export-onnx`, and then no torch model is loaded at all;
    `onnx_options` go to `from_bundle`: cache_root, intra_op_threads, which is also
    torch's process-wide `set_num_threads` for the torch models). `device` ("auto", "cpu",
    "cuda", "cuda:N"; None: the CPU): where every drafter model runs, the torch ones moved there and
    the ONNX ones on that GPU's CUDA provider; a missing GPU is a ValueError. `precision` "int8" runs
    the NAR drafter's int8 export (onnxruntime only; on torch a ValueError); the AR drafter runs fp32."""
    if backend not in BACKENDS:
        raise invalid(f"unknown drafter backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    check_precision(backend, precision)
    roles = [r for r in DRAFTER_ROLES if r in bundle.models]
    if not roles:
        return None
    check_backend_installed("drafter", backend)
    if backend == "onnxruntime":
        onnx_nar = onnx_ar = None
        if "nar_drafter" in roles:
            onnx_nar = OnnxNarDrafter.from_bundle(bundle, device=device, precision=precision, **onnx_options)
        if "ar_drafter" in roles:
            onnx_ar = OnnxArDrafter.from_bundle(bundle, device=device, **onnx_options)
        onnx_models = {r: m for r, m in (("nar_drafter", onnx_nar), ("ar_drafter", onnx_ar)) if m is not None}
        return LocalDrafter(onnx_models, onnx_nar, onnx_ar)
    set_torch_threads(onnx_options.get("intra_op_threads"))
    models = {r: bundle.models[r] for r in roles}
    if device is not None:
        from seq2seq_models.ort_runner import resolve_device

        torch_device = resolve_device(device)
        models = {r: m.to(torch_device) for r, m in models.items()}
    return LocalDrafter(models)


def _torch_device(model: Any) -> str:
    return str(model.embed.weight.device)
