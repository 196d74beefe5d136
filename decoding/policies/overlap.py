"""Overlapped drafting: the drafter drafts block t+1 while the verifier verifies block t.

In the spirit of PEARL's post-verify and AMUSD. Once the loop has block t's draft `d` and before
it sends it to the verifier, `OverlappedSync.predraft` hands the drafter session to one thread of
a small shared pool, which

1. guesses the verifier's bonus token: g = the drafter's own next token after `out + d`: the
   block's lookahead token when it has one (GAD drafts each block one position longer than it
   verifies, `Draft.lookahead`), else a 1-token draft of the same kind after `out + d`, then
2. drafts `out + d + [g]` with the room the loop will give it: exactly the call the plain loop
   makes next when block t is accepted in full and the verifier's token is g.

With the lookahead a pre-draft is one drafter call, as long as the plain loop's, and it is used
more often than with the 1-token guess call (BENCHMARKS.md, "Overlapped drafting and pre-verify:
notes").

When the loop asks for its next draft, the pre-draft is used if that call is exactly the one
pre-drafted (same kind, output and room): no drafter call on the critical path. Otherwise the
guess was wrong: the pre-draft is abandoned (not started: cancelled; between the two calls:
stopped; in its call: waited for, so no call is ever left in flight on the session) and the
draft is made as without overlap; the delta protocol rolls the drafter session back. Since a used
pre-draft is the very call the plain loop would have made, every mode's output equals the plain
loop's token for token (up to the drafter's float rounding when its cache is filled in other
chunks; exact for the lossless modes, whose output is the verifier's greedy output whatever the
drafts are).

Only for modes whose drafter call is a deterministic function of the output (GAD, GAD++, MJSD;
`ModeSpec.overlap`): a sampled draft (speculative sampling) would consume the drafter session's
random stream on guesses. With adaptive speculation the pre-draft asks for the block length of the
last call: it is used when the policy chooses that length again.

A pre-draft's failure surfaces where the plain loop's next draft would have failed: at the next
draft (a `DrafterFailure` reaches the gateway's AR fallback the same way). `settle()` (the loop's
exit, however it exits) waits for a pre-draft in flight before the sessions close.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

from core.interfaces import Draft, DrafterSession
from decoding.policies.drafter_sync import DrafterSync, DraftKind, LastBlock
from decoding.policies.loop import DecodeStats

# Pre-draft threads shared by every request of the process (a request has at most one pre-draft in
# flight). A pre-draft that finds no free thread waits in the queue; if the loop gets there first it
# is cancelled and the draft made as without overlap, so a busy pool costs hits, never latency.
PREDRAFT_THREADS = 16

_EXECUTOR: ThreadPoolExecutor | None = None
_EXECUTOR_LOCK = threading.Lock()


def predraft_executor() -> ThreadPoolExecutor:
    """The process's pre-draft pool (threads start lazily, up to PREDRAFT_THREADS, and are reused)."""
    global _EXECUTOR
    with _EXECUTOR_LOCK:
        if _EXECUTOR is None:
            _EXECUTOR = ThreadPoolExecutor(max_workers=max(PREDRAFT_THREADS, 1), thread_name_prefix="specdec-predraft")
        return _EXECUTOR


class OverlappedSync(DrafterSync):
    """A `DrafterSync` whose next draft may already be under way (module docstring). The loop calls
    `predraft` after each draft and `settle` when it ends; the modes use it like any DrafterSync.
    All methods but the pool's work run on the decode thread."""

    def __init__(
        self,
        session: DrafterSession,
        stats: DecodeStats,
        eos_id: int,
        realign: bool = False,
        lookahead: bool = False,
        max_block: int | None = None,
        executor: ThreadPoolExecutor | None = None,
    ) -> None:
        super().__init__(session, realign, lookahead, max_block)
        self.stats = stats
        self.eos_id = eos_id
        self.executor = executor or predraft_executor()
        self._pending: _Predraft | None = None
        # This iteration's draft: its kind, the room it was asked with, and its lookahead token.
        self._last: tuple[DraftKind, int, int | None] | None = None

    def draft(self, kind: DraftKind, output: list[int], room: int) -> Draft:
        pending, self._pending = self._pending, None
        draft = None
        if pending is not None:
            t0 = time.perf_counter()
            try:
                draft = pending.claim(kind, output, room)
            finally:
                self.stats.predraft_wait_s += time.perf_counter() - t0
            if draft is not None:
                self.stats.predrafts_used += 1
        if draft is None:
            draft = self.call(kind, output, room)
        self._last = (kind, room, draft.lookahead)
        return draft

    def predraft(self, output: list[int], draft_ids: list[int], room: int) -> None:
        """Start drafting what follows `output + draft_ids + [guess]`, the loop's next call when the
        block is accepted in full; `room` is the loop's room after that block."""
        last, self._last = self._last, None
        if last is None or self._pending is not None:
            return  # no drafter call this iteration (adaptive chose a plain AR step)
        kind, asked, lookahead = last
        size = min(asked, room)
        if size <= 0 or self.eos_id in draft_ids or lookahead == self.eos_id:
            return  # the guessed block ends the output: nothing to draft after it
        pending = _Predraft(self, kind, [*output, *draft_ids], size, self.shift, lookahead)
        pending.future = self.executor.submit(pending.work)
        self._pending = pending
        self.stats.predrafts += 1

    def holds(self, output: list[int]) -> bool:
        """Whether the next draft after `output` is known to be the pending pre-draft (its block was
        accepted in full and its guess of the verifier's token came true), without waiting for it:
        pre-verify then has nothing to overlap and the loop verifies the block at once."""
        pending = self._pending
        if pending is None or not pending.guessed():
            return False
        n = len(pending.base)
        return len(output) == n + 1 and output[:n] == pending.base and output[n] == pending.guess

    def settle(self) -> None:
        """Collect a pre-draft in flight (the loop is ending: its result and its failure are moot)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.abandon()


class _Predraft:
    """One pre-draft: the guess, then the draft after it, on a pool thread."""

    def __init__(
        self, owner: OverlappedSync, kind: DraftKind, base: list[int], size: int, shift: int, guess: int | None,
    ) -> None:
        self.owner = owner
        self.kind = kind
        self.base = base  # output + the draft sent for verification
        self.size = size  # the room the pre-draft asks for
        # The sync's shift when the block went to the verifier: a full acceptance leaves it as it
        # is, and any other verdict discards the pre-draft (the loop may move it meanwhile).
        self.shift = shift
        self.future: Future[Draft | None] | None = None
        # The block's lookahead token, when it has one, is the guess: one drafter call, not two.
        self.guess = guess
        self._guessed = threading.Event()  # set once `guess` is final (None: no pre-draft)
        if guess is not None:
            self._guessed.set()
        self._lock = threading.Lock()
        self._abandoned = False
        self.made: LastBlock = None  # the last block call the work made

    def work(self) -> Draft | None:
        # The sync repeats its last block call from memory (DrafterSync.call); a pre-draft's calls
        # become the loop's only once it is used, so the plain loop's calls are made either way.
        kept = self.owner.last_block
        try:
            return self._draft()
        finally:
            self.made, self.owner.last_block = self.owner.last_block, kept

    def _draft(self) -> Draft | None:
        if self.guess is not None:
            return self.owner.call(self.kind, [*self.base, self.guess], self.size, self.shift)
        try:
            guess = self.owner.call(self.kind, self.base, 1, self.shift).ids
            with self._lock:
                if self._abandoned or not guess or guess[0] == self.owner.eos_id:
                    return None  # the guess ends the output, or the verdict came first and missed
                self.guess = guess[0]
        finally:
            self._guessed.set()
        return self.owner.call(self.kind, [*self.base, self.guess], self.size, self.shift)

    def guessed(self) -> bool:
        """The guess is final (`guess`; None when nothing is drafted after it)."""
        return self._guessed.is_set()

    def claim(self, kind: DraftKind, output: list[int], room: int) -> Draft | None:
        """The pre-draft if the loop's call is the one pre-drafted, else None after collecting it.
        A failure of the pre-draft is raised here, as the plain loop's draft would have raised it."""
        n = len(self.base)
        if kind != self.kind or room != self.size or len(output) != n + 1 or output[:n] != self.base:
            self.abandon(reraise=True)
            return None
        assert self.future is not None
        if self.future.cancel():  # still queued behind other requests' pre-drafts: draft now instead
            return None
        self._guessed.wait()
        if self.guess != output[n]:
            self.abandon(reraise=True)
            return None
        draft = self.future.result()
        self.owner.last_block = self.made
        return draft

    def abandon(self, reraise: bool = False) -> None:
        """Stop the pre-draft where it can be stopped and wait for the rest: afterwards no call of
        it is in flight on the drafter session."""
        with self._lock:
            self._abandoned = True
        assert self.future is not None
        if self.future.cancel():
            return
        try:
            self.future.result()
        except BaseException:
            if reraise:
                raise
