"""The verifier as a Triton Inference Server Python-backend model (`specdec export-triton`).

One Triton sequence (correlation id) is one verifier session, as one `Verify` stream is natively:
the sequence's first request (START) carries `SOURCE_IDS` and opens the session (its rollback KV
cache), every request with `COMMITTED_LEN` is a step with the semantics of `VerifyStep` (keep that
many output tokens, append `APPEND_IDS`, score `DRAFT_IDS`, top `TOP_K`; `core.wire`'s conventions),
and END frees the session. Triton is not told when a sequence times out, so the table expires
sessions idle for `session_idle_s` itself. Errors are `TritonError`s whose message starts with our
status code ("FAILED_PRECONDITION: ..."), since Triton's error codes have no FAILED_PRECONDITION or
OUT_OF_RANGE; `gateway.peers.triton` maps them back.

The exported `model.py` only imports `TritonPythonModel` from here; `SequenceTable` holds the logic
and runs without Triton (the pb_utils module exists only inside Triton's Python-backend stub).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from core.checks import check_draft_len, check_ids, check_length, check_source_ids, check_wire_top_k
from core.errors import SpecdecError, StatusCode, invalid, out_of_step
from core.greedy import check_greedy_steps
from core.interfaces import StepCall, VerifyResult
from core.wire import session_top_k, source_vocab_from_wire

# Outputs, in the config's order; TOPK_* are [positions, top_k], the others [n].
OUTPUTS = ("TOP1", "TOPK_IDS", "TOPK_LOGPROBS", "DRAFT_LOGPROBS", "SESSIONS")


@dataclass(frozen=True)
class TableLimits:
    max_sessions: int
    session_idle_s: float
    max_draft_len: int
    max_source_len: int
    max_output_len: int
    vocab_size: int
    source_vocab_size: int = 0  # 0: the target vocabulary's


@dataclass
class _Entry:
    session: Any
    used: float


class SequenceTable:
    """Verifier sessions by correlation id, expired after `session_idle_s` without a request."""

    def __init__(self, verifier, limits: TableLimits, clock=time.monotonic) -> None:
        self.verifier = verifier
        self.limits = limits
        self.clock = clock
        self.sessions: dict[int, _Entry] = {}

    def handle(
        self,
        corrid: int,
        start: bool,
        end: bool,
        source: list[int] | None,
        step: tuple[int, list[int], list[int], int] | tuple[int, list[int], list[int], int, int] | None,
    ) -> VerifyResult | None:
        """One request of sequence `corrid`: open (start), step (when `step` is given), free (end)."""
        now = self.clock()
        self.expire(now)
        try:
            if start:
                self._open(corrid, source)
            entry = self.sessions.get(corrid)
            if entry is None and end and step is None:
                return None  # ending a sequence whose start failed, or that expired: nothing to free
            if entry is None:
                raise out_of_step(f"sequence {corrid} has no open session (never started, ended or expired)")
            entry.used = now
            return None if step is None else self._step(entry.session, *step)
        except SpecdecError:
            if start:  # a start that failed leaves nothing behind
                self.free(corrid)
            raise
        finally:
            if end:
                self.free(corrid)

    def free(self, corrid: int) -> None:
        entry = self.sessions.pop(corrid, None)
        if entry is not None:
            entry.session.close()

    def expire(self, now: float) -> None:
        idle = [c for c, e in self.sessions.items() if now - e.used > self.limits.session_idle_s]
        for corrid in idle:
            self.free(corrid)

    def _open(self, corrid: int, source: list[int] | None) -> None:
        self.free(corrid)  # a restarted sequence starts over
        if source is None:
            raise invalid("the first request of a sequence (START) must carry SOURCE_IDS")
        vocab = source_vocab_from_wire(self.limits.source_vocab_size, self.limits.vocab_size)
        check_source_ids(source, vocab, self.limits.max_source_len)
        if len(self.sessions) >= self.limits.max_sessions:
            held = len(self.sessions)
            raise SpecdecError(StatusCode.RESOURCE_EXHAUSTED, f"the verifier holds {held} sessions, its limit")
        self.sessions[corrid] = _Entry(self.verifier.open(source), self.clock())

    def _step(
        self, session, committed_len: int, append: list[int], draft: list[int], top_k: int, greedy_steps: int = 0
    ) -> VerifyResult:
        # The checks of the native servicer (verifier_service.server), in its order.
        check_draft_len(len(draft), self.limits.max_draft_len)
        check_length(append, self.limits.max_output_len, "append_ids")
        check_wire_top_k(top_k, self.limits.vocab_size)
        check_ids(append, self.limits.vocab_size, "append_ids")
        check_ids(draft, self.limits.vocab_size, "draft_ids")
        call = StepCall(committed_len, append, draft, session_top_k(top_k))
        check_greedy_steps(greedy_steps, call)
        if greedy_steps > 1:  # VerifyStep.greedy_steps: a run of plain AR steps, answered once
            return session.step_greedy(committed_len, append, greedy_steps, call.top_k)
        return session.step(committed_len, append, draft, call.top_k)


def result_arrays(result: VerifyResult | None, sessions: int) -> dict[str, np.ndarray]:
    """A step's outputs as the config's tensors (empty for a request that only ended its sequence)."""
    if result is None:
        return {
            "TOP1": np.zeros([0], np.int64), "TOPK_IDS": np.zeros([0, 0], np.int64),
            "TOPK_LOGPROBS": np.zeros([0, 0], np.float32), "DRAFT_LOGPROBS": np.zeros([0], np.float32),
            "SESSIONS": np.asarray([sessions], np.int64),
        }
    return {
        "TOP1": np.asarray(result.top1, np.int64),
        "TOPK_IDS": np.asarray(result.topk_ids, np.int64).reshape(len(result.top1), -1),
        "TOPK_LOGPROBS": np.asarray(result.topk_logprobs, np.float32).reshape(len(result.top1), -1),
        "DRAFT_LOGPROBS": np.asarray(result.draft_logprobs, np.float32),
        "SESSIONS": np.asarray([sessions], np.int64),
    }


class TritonPythonModel:
    """The Python-backend entry points (initialize / execute / finalize)."""

    def initialize(self, args: dict[str, str]) -> None:
        import torch

        from seq2seq_models.bundle import load_bundle
        from verifier_service.session import make_verifier

        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        bundle_dir = Path(args["model_repository"]) / args["model_version"] / params.get("bundle_dir", "bundle")
        torch.set_num_threads(int(params.get("threads", "1")))
        bundle = load_bundle(bundle_dir, roles=["verifier"])
        verifier = make_verifier(bundle, params.get("backend", "torch"), device=params.get("device", "cpu"))
        self.table = SequenceTable(
            verifier,
            TableLimits(
                max_sessions=int(params["max_sessions"]),
                session_idle_s=float(params["session_idle_s"]),
                max_draft_len=int(params["max_draft_len"]),
                max_source_len=verifier.max_source_len,
                max_output_len=verifier.max_target_len,
                vocab_size=verifier.vocab_size,
                source_vocab_size=verifier.source_vocab_size,
            ),
        )

    def execute(self, requests: list) -> list:
        import triton_python_backend_utils as pb_utils

        return [self._one(pb_utils, request) for request in requests]

    def finalize(self) -> None:
        for corrid in list(self.table.sessions):
            self.table.free(corrid)

    def _one(self, pb_utils, request):
        def ids(name: str) -> list[int] | None:
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            return None if tensor is None else tensor.as_numpy().reshape(-1).astype(np.int64).tolist()

        def flag(name: str) -> bool:
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            return tensor is not None and bool(tensor.as_numpy().reshape(-1)[0])

        try:
            corrid = int(request.correlation_id())
            committed = ids("COMMITTED_LEN")
            step = None
            if committed is not None:
                top_k = ids("TOP_K")
                if len(committed) != 1 or top_k is None or len(top_k) != 1:
                    raise invalid("a step needs COMMITTED_LEN and TOP_K, one value each")
                greedy = ids("GREEDY_STEPS") or [0]
                step = (committed[0], ids("APPEND_IDS") or [], ids("DRAFT_IDS") or [], top_k[0], greedy[0])
            result = self.table.handle(corrid, flag("START"), flag("END"), ids("SOURCE_IDS"), step)
        except SpecdecError as exc:
            return pb_utils.InferenceResponse(error=_triton_error(pb_utils, exc))
        arrays = result_arrays(result, len(self.table.sessions))
        return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(n, arrays[n]) for n in OUTPUTS])


def _triton_error(pb_utils, exc: SpecdecError):
    """Our status code in the message; Triton's nearest code where this backend version has codes."""
    message = f"{exc.code.value}: {exc.message}"
    error = pb_utils.TritonError
    nearest = {StatusCode.UNAVAILABLE: "UNAVAILABLE"}.get(exc.code, "INVALID_ARG")
    try:
        return error(message, getattr(error, nearest))
    except (AttributeError, TypeError):  # an older backend: message only
        return error(message)
