"""`core.interfaces.Verifier` over a Triton Inference Server (`verifier_url = "triton://HOST:PORT/MODEL"`).

The model is the one `specdec export-triton` writes (verifier_service.triton_model): one Triton
sequence per verifier session, under a correlation id unique to this gateway process. The first
step carries START and the source (so opening costs no round trip of its own, as with the native
stream, whose `open` answer is read at the first step); `close()` sends END, which frees the
session's KV cache in the model. A step is an `async_infer` tracked by the request's cancel switch,
so a cancelled request stops at once; its session is then ended by `close()` as usual.

The verifier's ModelInfo (vocabulary, special ids, fingerprints, limits) is read from the model
config's `parameters`, written there by the export. Errors come back as `SpecdecError`s with the
status code the model put at the start of its message ("FAILED_PRECONDITION: ..."), so the policies
and the gateway see what they see from the native verifier.
"""

from __future__ import annotations

import contextlib
import itertools
import secrets
import threading

import grpc
import numpy as np
import tritonclient.grpc as triton_grpc
from tritonclient.utils import InferenceServerException

from core.errors import SpecdecError, StatusCode, invalid
from core.interfaces import VerifyResult
from core.logits_processors import Processors
from core.wire import SPECIAL_ID_FIELDS, sends_candidates
from gateway.peers.remote import (
    CallOptions,
    RemoteCallError,
    RequestCancelled,
    RequestDeadlineExceeded,
    ServedVerifier,
    greedy_runs,
)
from protos.specdec.v1 import common_pb2

PEER = "verifier (triton)"
_OUTPUTS = ("TOP1", "TOPK_IDS", "TOPK_LOGPROBS", "DRAFT_LOGPROBS")
# How long close() waits for the END request (best effort: the model also expires idle sessions).
_END_TIMEOUT_S = 5.0
# Correlation ids: a random 32-bit prefix per process and a counter, so two gateways on one Triton
# server, or one restarted, do not reuse each other's ids.
_PREFIX = secrets.randbits(31) << 32
_COUNTER = itertools.count(1)
_COUNTER_LOCK = threading.Lock()


def next_correlation_id() -> int:
    with _COUNTER_LOCK:
        return _PREFIX | (next(_COUNTER) & 0xFFFFFFFF)


class TritonVerifierClient:
    """One gateway's connection to the Triton-hosted verifier: its ModelInfo and per-request verifiers."""

    def __init__(self, address: str, model: str) -> None:
        self.address = address
        self.model = model
        self.client = triton_grpc.InferenceServerClient(address)

    def fetch_info(self, timeout: float) -> common_pb2.ModelInfo:
        """The ModelInfo the export put in the model config; raises while the server or model is not ready."""
        try:
            if not self.client.is_model_ready(self.model, client_timeout=timeout):
                message = f"triton model {self.model!r} at {self.address} is not ready"
                raise SpecdecError(StatusCode.UNAVAILABLE, message)
            config = self.client.get_model_config(self.model, client_timeout=timeout).config
        except InferenceServerException as exc:
            raise SpecdecError(StatusCode.UNAVAILABLE, f"triton at {self.address}: {exc.message()}") from None
        return model_info(config.parameters, self.model)

    def verifier(
        self, info: common_pb2.ModelInfo, options: CallOptions, greedy_chunk: int = 1, stream_greedy_chunk: int = 1
    ) -> TritonVerifier:
        return TritonVerifier(self.client, self.model, info, options, greedy_chunk, stream_greedy_chunk)

    def close(self) -> None:
        self.client.close()


def model_info(parameters, model: str) -> common_pb2.ModelInfo:
    def get(key: str) -> str:
        if key not in parameters:
            raise SpecdecError(StatusCode.UNAVAILABLE, f"triton model {model!r} is not a specdec verifier (no {key!r})")
        return parameters[key].string_value

    ints = ("vocab_size", *SPECIAL_ID_FIELDS, "max_source_len", "max_target_len", "max_draft_len",
            "max_top_k", "max_sessions")
    return common_pb2.ModelInfo(
        **{k: int(get(k)) for k in ints},
        # A repository exported before separate source vocabularies has none: the target's.
        source_vocab_size=int(parameters["source_vocab_size"].string_value) if "source_vocab_size" in parameters else 0,
        tokenizer_fingerprint=get("tokenizer_fingerprint"),
        bundle_fingerprint=get("bundle_fingerprint"),
        backend=f"triton-{get('backend')}-{get('device')}",
        roles=[common_pb2.MODEL_ROLE_VERIFIER],
    )


class TritonVerifier(ServedVerifier):
    """`core.interfaces.Verifier` for one request (its deadline, request id and cancel switch)."""

    def __init__(
        self, client, model: str, info: common_pb2.ModelInfo, options: CallOptions,
        greedy_chunk: int = 1, stream_greedy_chunk: int = 1,
    ) -> None:
        super().__init__(info, greedy_chunk, stream_greedy_chunk)  # as RemoteVerifier's
        self.client = client
        self.load_key = client  # per request, as RemoteVerifier: the load is learnt per shared client
        self.model = model
        self.options = options

    def open(self, source_ids: list[int], processors: Processors | None = None) -> TritonVerifierSession:
        if processors is not None and processors.active:
            raise invalid("the Triton-hosted verifier applies no logits processors (repetition_penalty, "
                          "no_repeat_ngram_size, bad_words_ids, ...): serve the verifier with specdec's own service")
        if self.options.cancellation is not None:
            self.options.cancellation.check()
        session = TritonVerifierSession(self, list(source_ids))
        # Runs of AR steps (the model's GREEDY_STEPS input), as on the native verifier.
        session.max_greedy_steps, session.first_greedy_runs = greedy_runs(
            self.options, self.greedy_chunk, self.stream_greedy_chunk, self.max_target_len
        )
        return session


class TritonVerifierSession:
    def __init__(self, verifier: TritonVerifier, source_ids: list[int]) -> None:
        self._v = verifier
        self._source = source_ids
        self.sequence_id = next_correlation_id()
        self._started = False
        self._ended = False

    max_greedy_steps = 1  # `core.interfaces.GreedySession`: set by TritonVerifier.open
    first_greedy_runs: tuple[int, ...] = ()

    def step_greedy(self, committed_len: int, append_ids: list[int], steps: int, top_k: int) -> VerifyResult:
        return self.step(committed_len, append_ids, [], top_k, greedy_steps=steps)

    def step(
        self, committed_len: int, append_ids: list[int], draft_ids: list[int], top_k: int, greedy_steps: int = 0
    ) -> VerifyResult:
        inputs = [
            _int64("COMMITTED_LEN", [committed_len]),
            _int64("TOP_K", [top_k]),
        ]
        if greedy_steps > 1:
            inputs.append(_int64("GREEDY_STEPS", [greedy_steps]))
        if append_ids:
            inputs.append(_int64("APPEND_IDS", append_ids))
        if draft_ids:
            inputs.append(_int64("DRAFT_IDS", draft_ids))
        start = not self._started
        if start:
            inputs.append(_int64("SOURCE_IDS", self._source))
        # Started once sent: even when it fails, Triton holds the sequence's slot until END.
        self._started = True
        result = self._infer(inputs, start=start, end=False)
        top1 = result.as_numpy("TOP1").tolist()
        if sends_candidates(top_k):
            topk_ids = result.as_numpy("TOPK_IDS").tolist()
            topk_logprobs = result.as_numpy("TOPK_LOGPROBS").astype(np.float64).tolist()
        else:  # as the native verifier: no candidate lists for TOP1_ONLY
            topk_ids, topk_logprobs = [[] for _ in top1], [[] for _ in top1]
        return VerifyResult(
            top1=top1,
            topk_ids=topk_ids,
            topk_logprobs=topk_logprobs,
            draft_logprobs=result.as_numpy("DRAFT_LOGPROBS").astype(np.float64).tolist()[: len(draft_ids)],
        )

    def close(self) -> None:
        """END the sequence, so the model frees its cache now (not when it expires)."""
        if self._ended or not self._started:
            self._ended = True
            return
        self._ended = True
        # Best effort: when END does not arrive, the model expires the session after its idle time.
        with contextlib.suppress(InferenceServerException):
            self._v.client.infer(
                self._v.model, [], outputs=[triton_grpc.InferRequestedOutput("SESSIONS")],
                sequence_id=self.sequence_id, sequence_end=True, client_timeout=_END_TIMEOUT_S,
            )

    def _infer(self, inputs: list, start: bool, end: bool):
        v = self._v
        done = threading.Event()
        box: dict = {}

        def callback(result, error) -> None:
            box["result"], box["error"] = result, error
            done.set()

        cancellation = v.options.cancellation
        call = v.client.async_infer(
            v.model, inputs, callback,
            outputs=[triton_grpc.InferRequestedOutput(name) for name in _OUTPUTS],
            request_id=v.options.request_id, sequence_id=self.sequence_id,
            sequence_start=start, sequence_end=end, client_timeout=v.options.timeout(),
        )
        if cancellation is not None:
            cancellation.track(call)
        try:
            done.wait()
        finally:
            if cancellation is not None:
                cancellation.untrack(call)
        error = box["error"]
        if error is None:
            return box["result"]
        if cancellation is not None and cancellation.cancelled:
            raise RequestCancelled()
        raise _error(error)


def _int64(name: str, values: list[int]) -> triton_grpc.InferInput:
    tensor = triton_grpc.InferInput(name, [len(values)], "INT64")
    tensor.set_data_from_numpy(np.asarray(values, dtype=np.int64))
    return tensor


def _error(error: InferenceServerException) -> Exception:
    """The model's "CODE: message" back to a SpecdecError; Triton's own failures by their gRPC code."""
    message = error.message() or str(error)
    # Triton prefixes the model's message ("in ensemble ...", "[request id: ...] "); find our code in it.
    for code in StatusCode:
        marker = f"{code.value}: "
        if marker in message:
            return SpecdecError(code, message[message.index(marker) + len(marker) :])
    status = (error.status() or "").removeprefix("StatusCode.")
    grpc_status = getattr(grpc.StatusCode, status, grpc.StatusCode.UNKNOWN)
    if grpc_status == grpc.StatusCode.DEADLINE_EXCEEDED:
        return RequestDeadlineExceeded(PEER, message)
    if grpc_status == grpc.StatusCode.UNAVAILABLE:
        return SpecdecError(StatusCode.UNAVAILABLE, f"{PEER} unavailable: {message}")
    return RemoteCallError(PEER, grpc_status, message)
