"""The drafter service's batching, in process: NAR blocks of many decode threads in one forward.

`ScheduledDrafter` wraps a `LocalDrafter` with the scheduler the DrafterService runs: block drafts of
concurrent sessions are queued and drafted as one `draft_batch` forward; AR drafts (beam, sample)
run one at a time on the same model worker. The verifier's in-process twin is
`verifier_service.scheduled`.
"""

from __future__ import annotations

import time
from typing import Any

from core.interfaces import BlockCall, Draft
from core.sampling import SamplingParams
from drafter_service.session import DrafterSession, LocalDrafter
from serving.batching import BatchLimits, BatchScheduler, StepExecutor, with_batch_load


class ScheduledDrafter:
    """`core.interfaces.Drafter` whose sessions' block drafts are batched across threads."""

    def __init__(self, drafter: LocalDrafter, executor: StepExecutor, limits: BatchLimits) -> None:
        self.inner = drafter
        self.vocab_size = drafter.vocab_size
        self.executor = executor
        self.blocks = BatchScheduler(executor, self._draft_batch, limits)

    def open(self, source_ids: list[int], seed: int = 0) -> ScheduledDrafterSession:
        return ScheduledDrafterSession(self, self.inner.open(source_ids, seed))

    def _draft_batch(self, items: list[tuple[DrafterSession, BlockCall]]) -> list:
        """Worker: the blocks as one forward, each draft stamped with the batch it ran in."""
        started = time.perf_counter()
        results = self.inner.draft_batch(items)
        tokens = sum(call.n_tokens for _, call in items)
        return with_batch_load(results, len(items), tokens, time.perf_counter() - started)


class ScheduledDrafterSession:
    def __init__(self, drafter: ScheduledDrafter, session: DrafterSession) -> None:
        self._drafter = drafter
        self._session = session

    def draft_block(self, committed_len: int, append_ids: list[int], k: int) -> Draft:
        call = BlockCall(committed_len, list(append_ids), k)
        return self._drafter.blocks.queue_sync(self._session, call).result()

    def draft_beam(self, committed_len: int, append_ids: list[int], gamma: int, num_beams: int) -> Draft:
        return self._on_worker(self._session.draft_beam, committed_len, list(append_ids), gamma, num_beams)

    def draft_sample(self, committed_len: int, append_ids: list[int], gamma: int, params: SamplingParams) -> Draft:
        return self._on_worker(self._session.draft_sample, committed_len, list(append_ids), gamma, params)

    def close(self) -> None:
        self._drafter.executor.submit(self._session.close)

    def _on_worker(self, fn: Any, *args: Any) -> Draft:
        return self._drafter.executor.run_sync(fn, *args)
