"""Pre-verify: the verifier checks a block's first position while the drafter drafts the block.

In the spirit of PEARL's pre-verify. A large share of GAD's blocks on UA-GEC are cut at their
first token (BENCHMARKS.md, "GAD verdicts (what overlap can hit)"): the verifier scores k+1
positions to keep one token of its own.
With pre-verify, an iteration that follows a cut block sends the drafter its call and, at the same
time, the verifier a plain AR step after the output so far, whose top-1 is the verifier's token at
the block's first position. When the draft comes back:

- its first token fails the mode's rule at that position (`FirstPasses`): the block would have
  been cut there and the verifier's token is already known. It is committed and the block is never
  verified: the iteration cost the longer of the two calls instead of both one after the other,
  and a one-token verifier step instead of a block of k+1;
- it passes: the block is verified as without pre-verify (the AR step was spent).

Only after a cut block (the loop decides, `decoding.policies.loop`): cuts come in runs, so the block
after one cut at its first token is likely cut there too, while a sentence's first block and the
block after one accepted in full rarely are (BENCHMARKS.md, "GAD verdicts (what overlap can hit)").
A block whose first token passes pays for the AR step on top of its verify, and on a CPU that step
costs a large fraction of a block's verify (a batch-1 step reads every weight once either way), so
pre-verifying every block gains less than pre-verifying only after cuts. Realigned drafts
(decoding.policies.drafter_sync) break most runs of cuts, which leaves GAD little to gain from it
(BENCHMARKS.md, "Overlapped drafting and pre-verify: notes").

The blocks drafted, and which of their tokens are kept, are those of the plain loop, so the output
is the plain loop's, token for token (the first token of a cut block comes from the same verifier's
one-token step, the shape the AR baseline runs). The rule at one position must decide that
position alone (GAD's exact match, GAD++'s top-beta and tau; not MJSD's joint ratio, which a later
position can rescue): `ModeSpec.preverify`.

It pays when the drafter and the verifier work at the same time and the request is alone on its
verifier (the loop holds it back otherwise: decoding.decode.AHEAD_MAX_IN_FLIGHT); under load the
second verifier call of a block whose first token passes costs a turn of the batch. Its gains with
and without overlap: BENCHMARKS.md, "Overlapped drafting". Not with adaptive speculation, which
picks a block length before drafting.

With overlapped drafting (`decoding.policies.overlap`) as well, each covers the other's case: a block
drafted ahead that is known to hold (the block before accepted in full, the verifier's token
guessed right) is verified at once, with no AR step beside it; any other iteration after a cut
block is pre-verified.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass

from core.interfaces import Draft, VerifierSession, VerifyResult
from decoding.policies.loop import DecodeStats, PrefixSync, Propose

# first_passes(d0, result) -> whether draft token d0 passes the mode's rule at `result`'s first position.
FirstPasses = Callable[[int, VerifyResult], bool]


@dataclass
class PreVerify:
    """The loop's pre-verify step: the draft on a pool thread, the verifier's AR step on this one."""

    first_passes: FirstPasses
    executor: Executor

    def draft_and_first(
        self, propose: Propose, out: list[int], room: int, session: VerifierSession, sync: PrefixSync,
        top_k: int, stats: DecodeStats,
    ) -> tuple[Draft, VerifyResult]:
        """Draft the next block and, meanwhile, step the verifier once after `out`; both answers.
        Whatever fails, no drafter call of this request is left in flight on return."""
        t0 = time.perf_counter()
        pending = self.executor.submit(propose, out, room)
        try:
            committed, append = sync.delta(out)
            first = session.step(committed, append, [], top_k)
            sync.seen = list(out)
        except BaseException:
            if not pending.cancel():  # in its call: the caller closes the sessions next
                with contextlib.suppress(Exception):
                    pending.result()
            raise
        t1 = time.perf_counter()
        # Still queued behind other requests' drafter calls (a busy pool): draft here, now.
        draft = propose(out, room) if pending.cancel() else pending.result()
        t2 = time.perf_counter()
        stats.verifier_time_s += t1 - t0
        stats.drafter_time_s += t2 - t1  # only what the loop waited for beyond the verifier's step
        return draft, first
