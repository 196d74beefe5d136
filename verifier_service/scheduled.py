"""The verifier service's batching, in process: many decode threads, one batched forward per step.

`ScheduledVerifier` wraps a `BatchVerifier` (either backend) with the same `serving.batching`
scheduler the VerifierService runs: every session's step is queued, and the model worker runs the
pending steps of all sessions as one `step_batch` forward. Threads decoding side by side (the Python
API's batch call, `specdec decode --batch-size`) thus share forwards exactly as concurrent gRPC
clients of the service do; a run of AR steps (`step_greedy`) is one submission that the worker
continues itself (`core.greedy`), as the service does for `greedy_steps`. Sources of new sessions
are queued for the encoder at open, so those opened while the worker is busy are encoded in one run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from core.greedy import greedy_next, merge_greedy
from core.interfaces import BeamRow, StepCall, VerifyResult
from core.logits_processors import Processors
from serving.batching import BatchLimits, BatchScheduler, StepExecutor
from verifier_service.batch_session import BatchSession, BatchVerifier

# Source tokens one encoder run may hold (as the service's).
ENCODE_TOKENS = 8192
# How much longer than a step an encoding waits for company.
ENCODE_WAIT_FACTOR = 4


@dataclass(frozen=True)
class _Encode:
    """A new session's source, as the encoder's scheduler sizes it: one row of its tokens."""

    n_tokens: int
    n_rows: int = 1


class ScheduledVerifier:
    """`core.interfaces.Verifier` whose sessions' steps are batched across threads (see the module
    docstring). `executor`: the model worker (shared with a drafter's, so that one model runs at a
    time on the cores); `limits`: how much one forward may hold."""

    def __init__(self, verifier: BatchVerifier, executor: StepExecutor, limits: BatchLimits) -> None:
        self.inner = verifier
        self.vocab_size = verifier.vocab_size
        self.source_vocab_size = verifier.source_vocab_size
        self.bos_id = verifier.bos_id
        self.eos_id = verifier.eos_id
        self.max_source_len = verifier.max_source_len
        self.max_target_len = verifier.max_target_len
        self.load_key = self  # adaptive speculation learns this verifier's load (`load_key_of`)
        self.executor = executor
        self.steps = BatchScheduler(executor, verifier.step_batch, limits)
        # New sources wait for company longer than steps do: the rows a bulk run admits together open
        # together, but each on a thread that is only starting (the wait ends once all are queued).
        encode_limits = BatchLimits(limits.max_rows, ENCODE_TOKENS, ENCODE_WAIT_FACTOR * limits.wait_s)
        self.encoder = BatchScheduler(executor, self._encode, encode_limits)

    def open(self, source_ids: list[int], processors: Processors | None = None) -> ScheduledSession:
        session = self.inner.open(source_ids, processors)
        self.encoder.queue_sync(session, _Encode(len(source_ids)))  # not waited for: the first step finds it
        return ScheduledSession(self, session)

    def _encode(self, items: list[tuple[BatchSession, _Encode]]) -> list[None]:
        self.inner.encode([session for session, _ in items])
        return [None] * len(items)


class ScheduledSession:
    """A `BatchSession` driven through the scheduler: single-row steps, runs of AR steps in one
    submission (`core.interfaces.GreedySession`) and multi-row (beam) steps."""

    # The whole output in one run (the caller is in process, nothing is streamed between runs).
    first_greedy_runs: tuple[int, ...] = ()

    def __init__(self, verifier: ScheduledVerifier, session: BatchSession) -> None:
        self._verifier = verifier
        self._session = session
        self.max_greedy_steps = verifier.max_target_len + 1

    def step(self, committed_len: int, append_ids: list[int], draft_ids: list[int], top_k: int) -> VerifyResult:
        return self._wait(StepCall(committed_len, list(append_ids), list(draft_ids), top_k))

    def step_greedy(self, committed_len: int, append_ids: list[int], steps: int, top_k: int) -> VerifyResult:
        eos, room = self._verifier.eos_id, self._verifier.max_target_len

        def then(done: StepCall, result: VerifyResult, steps_run: int) -> StepCall | None:
            return greedy_next(done, result, steps_run, steps, eos, room)

        return merge_greedy(self._wait(StepCall(committed_len, list(append_ids), [], top_k), then))

    def step_rows(self, rows: list[BeamRow], top_k: int) -> list[VerifyResult]:
        return self._wait(StepCall(top_k=top_k, rows=list(rows)))

    def close(self) -> None:
        # On the worker, behind this session's queued work (an encode it may still have pending).
        self._verifier.executor.submit(self._session.close)

    def _wait(self, call: StepCall, then: Any = None) -> Any:
        return self._verifier.steps.queue_sync(self._session, call, then).result()
