"""The draft-verify loop every non-beam policy runs, and its bookkeeping.

One iteration: propose a draft, let the verifier score `append + draft` in one step, apply the
policy's accept rule, commit the accepted tokens plus the verifier's token, cut at EOS or
max_new_tokens. AR greedy is the same loop with an empty draft.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Protocol, cast

from core.interfaces import CopyRunSession, Draft, GreedySession, VerifierSession, VerifyResult, greedy_run_limit

# propose(output so far, most tokens worth drafting) -> Draft
Propose = Callable[[list[int], int], Draft]
# accept(draft ids actually sent, the Draft, the verifier's answer) -> (accepted count, next token)
Accept = Callable[[list[int], Draft, VerifyResult], tuple[int, int]]
# Called with every block of newly committed tokens (streaming); the draft-verify loop passes a `Block`.
OnTokens = Callable[[list[int]], None]


class Block(list):
    """A block of committed tokens as the draft-verify loop hands it to `on_tokens`: a list of ids
    whose first `drafted` came from the accepted draft (the drafter's, or the input's under IAD) and
    the rest from the verifier, and each one's log-prob (`logprobs`, the verifier's processed
    distribution). Callers that only want the ids use it as the list it is; a stream that shows
    where tokens came from reads `drafted` (`drafted_count`)."""

    def __init__(self, ids: list[int], drafted: int = 0, logprobs: list[float] | None = None) -> None:
        super().__init__(ids)
        self.logprobs = logprobs if logprobs is not None else [math.nan] * len(ids)
        self.drafted = drafted


def block_logprobs(block: list[int]) -> list[float]:
    """Each of `block`'s tokens' log-probs (0 for a plain list: forced first tokens)."""
    return list(block.logprobs) if isinstance(block, Block) else [0.0] * len(block)


def drafted_count(block: list[int]) -> int:
    """How many of `block`'s first tokens came from an accepted draft (0 for a plain list: a run of
    AR steps, beam search's output, forced first tokens)."""
    return block.drafted if isinstance(block, Block) else 0


class Overlap(Protocol):
    """Drafting ahead while the verifier works (`decoding.policies.overlap.OverlappedSync`)."""

    def predraft(self, output: list[int], draft_ids: list[int], room: int) -> None:
        """`draft_ids` goes to the verifier now: draft what would follow its full acceptance,
        `room` being the loop's room after it."""

    def holds(self, output: list[int]) -> bool:
        """Whether the next draft after `output` is known to be one already drafted ahead."""

    def settle(self) -> None:
        """The loop ends: wait for drafting in flight (its outcome is moot)."""


class PreVerifyStep(Protocol):
    """Drafting while the verifier checks the block's first position (`decoding.policies.preverify.PreVerify`)."""

    def draft_and_first(
        self, propose: Propose, out: list[int], room: int, session: VerifierSession, sync: PrefixSync,
        top_k: int, stats: DecodeStats,
    ) -> tuple[Draft, VerifyResult]:
        """The next draft, and the verifier's answer to a plain AR step after `out`, made meanwhile."""
        ...

    def first_passes(self, token: int, first: VerifyResult) -> bool:
        """Whether draft token `token` passes the mode's rule at the AR step's position."""
        ...


@dataclass
class DecodeStats:
    iterations: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    # steps_per_draft_length[n] = the iterations that drafted n tokens (n = 0: a plain AR step);
    # with adaptive speculation, how often each block length ran.
    steps_per_draft_length: list[int] = field(default_factory=list)
    output_tokens: int = 0
    drafter_time_s: float = 0.0
    # Of drafter_time_s, the wait for the first iteration's draft (with the drafter's encoder run):
    # nothing is verified beside it, so overlapped drafting cannot hide it.
    first_draft_time_s: float = 0.0
    verifier_time_s: float = 0.0
    degraded: bool = False
    finish_reason: str = ""
    # Overlapped drafting: blocks pre-drafted while the verifier worked, those the loop then used
    # (the guess of full acceptance and the verifier's token held), and the time the loop waited
    # for pre-drafts to be used or collected.
    predrafts: int = 0
    predrafts_used: int = 0
    predraft_wait_s: float = 0.0
    # Pre-verify: iterations whose first position the verifier checked while the drafter drafted,
    # and those whose block was cut there (committed the verifier's token, never verified).
    preverified: int = 0
    preverify_cuts: int = 0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per iteration (accepted drafts plus the verifier's own token), the EOS that
        ended the output included, so plain AR is exactly 1.0."""
        committed = self.output_tokens + (self.finish_reason == "eos")
        return committed / self.iterations if self.iterations else 0.0

    @property
    def predraft_hit_rate(self) -> float:
        """The share of pre-drafted blocks the loop used."""
        return self.predrafts_used / self.predrafts if self.predrafts else 0.0

    @property
    def mean_draft_length(self) -> float:
        """Draft tokens per iteration (the mean block length that ran)."""
        return self.drafted_tokens / self.iterations if self.iterations else 0.0

    def add_drafter_time(self, seconds: float) -> None:
        """The loop waited `seconds` for an iteration's draft (the first one is also kept apart)."""
        if self.iterations == 0:
            self.first_draft_time_s += seconds
        self.drafter_time_s += seconds

    def record_accepts(self, drafted: int, accepted: int) -> None:
        if len(self.steps_per_draft_length) <= drafted:
            self.steps_per_draft_length.extend([0] * (drafted + 1 - len(self.steps_per_draft_length)))
        self.steps_per_draft_length[drafted] += 1
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        if len(self.accepted_per_position) < accepted:
            self.accepted_per_position.extend([0] * (accepted - len(self.accepted_per_position)))
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    def to_dict(self) -> dict:
        out = asdict(self)
        out["mean_accepted_length"] = round(self.mean_accepted_length, 4)
        out["mean_draft_length"] = round(self.mean_draft_length, 4)
        out["drafter_time_s"] = round(self.drafter_time_s, 6)
        out["first_draft_time_s"] = round(self.first_draft_time_s, 6)
        out["verifier_time_s"] = round(self.verifier_time_s, 6)
        out["predraft_wait_s"] = round(self.predraft_wait_s, 6)
        return out


@dataclass(frozen=True)
class Hypothesis:
    """One finished output of a search: its tokens (EOS not included), its sequence score (beam
    search: its tokens' log-probs summed, over its length ** length_penalty, as `generate`'s
    sequences_scores), each token's log-prob (then the EOS's, when one ended it), and why it ended
    ("eos" or "length")."""

    output_ids: list[int]
    score: float
    token_logprobs: list[float]
    finish_reason: str


@dataclass
class DecodeResult:
    output_ids: list[int]
    stats: DecodeStats
    # Beam search: the n best hypotheses, best first (the first is `output_ids`); other modes: none.
    hypotheses: list[Hypothesis] = field(default_factory=list)
    # The log-prob of each output token (forced and prefix tokens: 0), then of the EOS that ended
    # it, if one did: the verifier's distribution after the logits processors (`generate`'s
    # output_scores, normalised).
    token_logprobs: list[float] = field(default_factory=list)


class PrefixSync:
    """What a remote session has seen, so each step sends only the delta of the client's output."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def delta(self, output: list[int]) -> tuple[int, list[int]]:
        n = 0
        limit = min(len(self.seen), len(output))
        while n < limit and self.seen[n] == output[n]:
            n += 1
        return n, output[n:]


@dataclass(frozen=True)
class LoopOptions:
    """What `draft_verify_loop` runs with besides the session and the mode's (propose, accept).

    A `prefix` is output already committed (it is sent to the verifier with the first step and
    counts towards max_new_tokens; `on_tokens` does not see it). With `overlap`, the next block is
    drafted while the verifier verifies this one. With `preverify`, after a block that was cut the
    verifier checks the next block's first position while the drafter drafts it, and a block cut
    there is never verified. `ahead()`, asked every iteration, may hold both back (the load is too
    high for work spent on guesses); None: always on. `on_verdict(ids, accepted, token)` hears every
    block's verdict (of the drafted `ids`, `accepted` kept, then the verifier's `token`), pre-verify's
    cuts included."""

    top_k: int
    max_new_tokens: int
    eos_id: int
    on_tokens: OnTokens | None = None
    prefix: list[int] | None = None
    overlap: Overlap | None = None
    preverify: PreVerifyStep | None = None
    ahead: Callable[[], bool] | None = None
    on_verdict: Callable[[list[int], int, int], None] | None = None
    # The committed tokens' log-probs, the prefix's first: the loop appends each block's (and, when
    # EOS ends the output, the EOS's). None: not kept.
    logprobs: list[float] | None = None


def draft_verify_loop(
    session: VerifierSession, propose: Propose, accept: Accept, stats: DecodeStats, options: LoopOptions
) -> list[int]:
    """Decode until EOS or max_new_tokens (see `LoopOptions`). However the loop ends, it waits for
    an overlapped draft in flight before it returns (the caller closes the sessions next)."""
    top_k, max_new_tokens, eos_id, on_tokens = options.top_k, options.max_new_tokens, options.eos_id, options.on_tokens
    overlap, preverify, ahead, on_verdict = options.overlap, options.preverify, options.ahead, options.on_verdict
    output = Output(list(options.prefix or []), options.logprobs, eos_id, max_new_tokens, stats, on_tokens)
    out = output.ids
    try:
        sync = PrefixSync()
        after_cut = False  # the last block was cut short of its full length
        while True:
            # A block commits at most len(draft) + 1 tokens: never draft past max_new_tokens.
            room = max_new_tokens - len(out) - 1
            t0 = time.perf_counter()
            now = ahead is None or ahead()
            # Pre-verify only after a cut block: cuts come in runs, and a block whose first token
            # passes pays for the AR step on top of its verify (decoding.policies.preverify). A
            # block already drafted ahead (overlap) is verified at once: nothing to pre-verify beside.
            if (preverify is not None and now and room > 0 and after_cut
                    and not (overlap is not None and overlap.holds(out))):
                draft, first = preverify.draft_and_first(propose, out, room, session, sync, top_k, stats)
                ids = draft.ids[:room]
                stats.preverified += 1
                if not ids or not preverify.first_passes(ids[0], first):
                    # The block would be cut at its first token, whose verifier token is known now.
                    stats.iterations += 1
                    stats.record_accepts(len(ids), 0)
                    stats.preverify_cuts += 1
                    if on_verdict is not None:
                        on_verdict(ids, 0, first.top1[0])
                    if output.commit([first.top1[0]], [token_logprob(first, 0, first.top1[0])]):
                        return out
                    continue
                t0 = time.perf_counter()  # draft_and_first counted its own time
            else:
                draft = propose(out, room) if room > 0 else Draft(ids=[])
                ids = draft.ids[:room] if room > 0 else []
            if overlap is not None and now:
                # The room after this block, if it is accepted in full with the verifier's token.
                overlap.predraft(out, ids, room - len(ids) - 1)
            t1 = time.perf_counter()
            if not ids and draft.ar_steps > 1 and greedy_run_limit(session) > 1:
                # The policy commits to several plain AR steps: one verifier call runs them.
                steps = min(draft.ar_steps, session.max_greedy_steps, max_new_tokens - len(out))
                stats.add_drafter_time(t1 - t0)
                result = run_plain_steps(session, out, sync, steps, top_k, stats)
                stats.verifier_time_s += time.perf_counter() - t1
                accept(ids, draft, result)  # for what the policy learns; its token is the run's first
                if output.commit_run(result):
                    return out
                continue
            committed, append = sync.delta(out)
            result = session.step(committed, append, ids, top_k)
            stats.add_drafter_time(t1 - t0)
            stats.verifier_time_s += time.perf_counter() - t1
            sync.seen = out + ids
            accepted, token = accept(ids, draft, result)
            after_cut = accepted < len(ids)
            stats.iterations += 1
            stats.record_accepts(len(ids), accepted)
            if on_verdict is not None:
                on_verdict(ids, accepted, token)
            logprobs = [*result.draft_logprobs[:accepted], token_logprob(result, accepted, token)]
            if output.commit([*ids[:accepted], token], logprobs, drafted=accepted):
                return out
    finally:
        if overlap is not None:
            overlap.settle()


def run_plain_steps(
    session: GreedySession, out: list[int], sync: PrefixSync, steps: int, top_k: int, stats: DecodeStats,
    copy_k: int = 0,
) -> VerifyResult:
    """One verifier call for up to `steps` plain AR steps after `out` (`GreedySession.step_greedy`), or
    with `copy_k` for a run of copy-drafted forwards giving the same tokens (`CopyRunSession.step_copy`):
    its result, one position per greedy token, with `sync` and the stats' step counts brought up to
    date (a forward each: what it drafted and kept)."""
    committed, append = sync.delta(out)
    if copy_k and steps > 1:  # a run of one step has nothing to draft for
        # The caller picked copy runs for a CopyRunSession (`decoding.decode`): no protocol check per run.
        result = cast(CopyRunSession, session).step_copy(committed, append, steps, top_k, copy_k)
    else:
        result = session.step_greedy(committed, append, steps, top_k)
    sync.seen = out + result.top1[:-1]  # the verifier appended all the run's tokens but the last
    # A verifier that predates copy drafts answers a plain run: a forward per token, none drafted.
    for drafted, accepted in result.blocks or [(0, 0)] * len(result.top1):
        stats.iterations += 1
        stats.record_accepts(drafted, accepted)
    return result


def token_logprob(result: VerifyResult, position: int, token: int) -> float:
    """The verifier's log-prob of `token` at `position` of its answer, from the top-k it reported
    (NaN when the token is not among them: a mode that commits only top-1 or drafted tokens never
    asks for one that is not)."""
    ids = result.topk_ids[position] if position < len(result.topk_ids) else []
    return result.topk_logprobs[position][ids.index(token)] if token in ids else math.nan


class Output:
    """The output as blocks are committed: its ids, their log-probs (`logprobs`, when kept: the
    prefix's first, and the EOS's once one ends the output), and `on_tokens`, told of each block."""

    def __init__(self, ids: list[int], logprobs: list[float] | None, eos_id: int, max_new_tokens: int,
                 stats: DecodeStats, on_tokens: OnTokens | None) -> None:
        self.ids = ids
        self.logprobs = logprobs
        self.eos_id = eos_id
        self.max_new_tokens = max_new_tokens
        self.stats = stats
        self.on_tokens = on_tokens

    def commit(self, block: list[int], logprobs: list[float], drafted: int = 0) -> bool:
        """Append a block of final tokens (cut at EOS) and tell `on_tokens` (a `Block` whose first
        `drafted` tokens came from the draft); True when the output is finished (EOS, or
        max_new_tokens reached), with the stats' finish reason set."""
        finish = ""
        kept = len(block)
        if self.eos_id in block:
            kept = block.index(self.eos_id)
            finish = "eos"
        ids = block[:kept]
        self.ids.extend(ids)
        if self.logprobs is not None:
            self.logprobs.extend(logprobs[: kept + (finish == "eos")])
        if self.on_tokens is not None and ids:
            self.on_tokens(Block(ids, min(drafted, kept), logprobs[:kept]))
        if not finish and len(self.ids) >= self.max_new_tokens:
            finish = "length"
        if finish:
            self.stats.finish_reason = finish
            self.stats.output_tokens = len(self.ids)
        return bool(finish)

    def commit_run(self, result: VerifyResult) -> bool:
        """`commit` a run of plain AR steps' tokens (`run_plain_steps`), each the top-1 of its position."""
        return self.commit(list(result.top1), [lps[0] if lps else math.nan for lps in result.topk_logprobs])
