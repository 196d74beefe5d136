"""The two small interfaces the accept loop is written against (ARCHITECTURE.md, "The parts and the flow").

The same policy code runs over in-process implementations (tests, offline jobs) and over gRPC
(serving). Nothing here is a tensor: only token ids, log-probs and probability rows.

Session protocol (verifier and drafter alike): the session holds the tokens it has seen after
BOS. Each step says `committed_len`, how many of those the client keeps (the rest are rolled
back), and `append_ids`, final tokens the session has not seen yet. Rolling back below an
earlier commit is allowed (beam search re-targets sessions that way); keeping more than it has
seen is out of step (FAILED_PRECONDITION).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from core.logits_processors import Processors
from core.sampling import SamplingParams


@dataclass(frozen=True)
class VerifyResult:
    """The verifier's view of `draft_ids` d_1..d_n: n + 1 positions, the last one past the draft."""

    top1: list[int]  # v_i = argmax p(. | o, d_<i), i = 1..n+1
    topk_ids: list[list[int]]  # top-k ids per position, best first
    topk_logprobs: list[list[float]]
    draft_logprobs: list[float]  # log p(d_i | o, d_<i), i = 1..n
    # The forward this step ran in (the batching scheduler's load signal, for adaptive
    # speculation): rows and tokens in it, and its duration. In-process: this step alone.
    batch_rows: int = 1
    batch_tokens: int = 0
    forward_s: float = 0.0
    # A copy-drafted greedy run's forwards (`CopyRunSession.step_copy`): (drafted, accepted) each.
    blocks: list[tuple[int, int]] = field(default_factory=list)


@dataclass(frozen=True)
class BeamRow:
    """One row of a multi-row (beam search) step: a copy of the session's row `parent` (its index
    before this step) cut to its first `committed_len` tokens, then `append_ids` appended. The
    prefix's KV cache is reused, never recomputed."""

    parent: int
    committed_len: int
    append_ids: list[int]


@dataclass(frozen=True)
class StepCall:
    """One session's step as the batching scheduler hands it to the model: a single-row step
    (`committed_len`, `append_ids`, `draft_ids`) or, with `rows`, a multi-row step (beam search)."""

    committed_len: int = 0
    append_ids: list[int] = field(default_factory=list)
    draft_ids: list[int] = field(default_factory=list)
    top_k: int = 1
    rows: list[BeamRow] | None = None

    @property
    def n_rows(self) -> int:
        return 1 if self.rows is None else len(self.rows)

    @property
    def n_tokens(self) -> int:
        """Tokens this step feeds the forward (a lower bound: a row that appends nothing re-feeds one)."""
        if self.rows is None:
            return max(1, len(self.append_ids) + len(self.draft_ids))
        return sum(max(1, len(r.append_ids)) for r in self.rows)


@dataclass(frozen=True)
class BlockCall:
    """One session's NAR block draft as the batching scheduler hands it to the drafter: keep
    `committed_len` tokens, append `append_ids`, draft `k` tokens (`draft_block`'s arguments)."""

    committed_len: int
    append_ids: list[int]
    k: int

    @property
    def n_rows(self) -> int:
        return 1

    @property
    def n_tokens(self) -> int:
        """The appended tokens plus the k mask positions the block fills."""
        return len(self.append_ids) + self.k


@dataclass(frozen=True)
class Draft:
    ids: list[int]
    # Beam drafts: log q(d_1..d_i) for every i.
    cum_logq: list[float] = field(default_factory=list)
    # Sampled drafts: the warped q the token at each position was drawn from, as (ids, probs).
    q_rows: list[tuple[list[int], list[float]]] = field(default_factory=list)
    # An empty draft whose policy commits to this many plain AR steps before it proposes again
    # (adaptive speculation under load): the loop may take them as one run of greedy steps
    # (`GreedySession.step_greedy`). Only for policies whose token after an empty draft is top-1.
    ar_steps: int = 1
    # The drafter forward this block ran in, as `VerifyResult`'s fields (batch_tokens 0: not
    # reported, e.g. an in-process drafter without a scheduler): what adaptive speculation learns
    # the drafter's cost from.
    batch_rows: int = 1
    batch_tokens: int = 0
    forward_s: float = 0.0
    # The drafter's token for the position after `ids`, when the block was drafted one position
    # longer than it is verified (GAD, decoding.policies.drafter_sync): overlapped drafting's guess
    # of the verifier's token after the block is accepted in full. None: not drafted.
    lookahead: int | None = None


class VerifierSession(Protocol):
    def step(
        self, committed_len: int, append_ids: list[int], draft_ids: list[int], top_k: int
    ) -> VerifyResult: ...

    def close(self) -> None: ...


# Optional capabilities: a session, verifier or drafter may have them; each is a runtime-checkable
# protocol with a function below that answers for any object (the callers never probe attributes).


@runtime_checkable
class GreedySession(VerifierSession, Protocol):
    """A verifier session that runs several plain AR steps per call (`core.greedy`).

    `step_greedy(committed_len, append_ids, steps, top_k)` is `step` with no draft, then, while
    fewer than `steps` ran, its top1 appended (not EOS, room left) and another step: one
    `VerifyResult` with one position per step run. The session then holds every greedy token but
    the last, as after `steps` single steps. `max_greedy_steps` is how many one call should ask
    for at most (a remote session's chunk: tokens reach a streaming client a chunk at a time);
    `first_greedy_runs`, the sizes of the first calls' runs (short, for a streaming client's first
    tokens), if any."""

    max_greedy_steps: int
    first_greedy_runs: tuple[int, ...]

    def step_greedy(self, committed_len: int, append_ids: list[int], steps: int, top_k: int) -> VerifyResult: ...


@runtime_checkable
class CopyRunSession(GreedySession, Protocol):
    """A greedy session that runs IAD where the model is (`VerifyStep.copy_draft`, `core.copy_draft`).

    `step_copy(committed_len, append_ids, steps, top_k, k)` is `step_greedy` whose forwards each
    verify a draft of at most `k` tokens copied from the source: the same tokens, one position per
    greedy token, in fewer forwards (`VerifyResult.blocks`: what each one drafted and kept)."""

    def step_copy(self, committed_len: int, append_ids: list[int], steps: int, top_k: int, k: int) -> VerifyResult: ...


@runtime_checkable
class MultiRowSession(VerifierSession, Protocol):
    """A verifier session holding several rows over one source (the beams of one request).

    After `open` the session has one empty row. `step_rows(rows, top_k)` replaces the session's
    rows by `rows` (each forked from a current row, `BeamRow`) and scores the next token of each:
    one `VerifyResult` with one position per row, in order. Rows not named as a parent are freed."""

    def step_rows(self, rows: list[BeamRow], top_k: int) -> list[VerifyResult]: ...


class Verifier(Protocol):
    vocab_size: int
    source_vocab_size: int  # source ids lie in [0, source_vocab_size); the target's unless separate
    bos_id: int
    eos_id: int
    max_source_len: int  # source tokens, excluding the EOS the verifier adds
    max_target_len: int  # output tokens, excluding BOS

    def open(self, source_ids: list[int], processors: Processors | None = None) -> VerifierSession:
        """A session over `source_ids`, its scores processed by `processors` (core.logits_processors)."""
        ...


class DrafterSession(Protocol):
    def draft_block(self, committed_len: int, append_ids: list[int], k: int) -> Draft: ...

    def draft_beam(self, committed_len: int, append_ids: list[int], gamma: int, num_beams: int) -> Draft: ...

    def draft_sample(
        self, committed_len: int, append_ids: list[int], gamma: int, params: SamplingParams
    ) -> Draft: ...

    def close(self) -> None: ...


class Drafter(Protocol):
    vocab_size: int

    def open(self, source_ids: list[int], seed: int = 0) -> DrafterSession: ...


@runtime_checkable
class BoundedDrafter(Drafter, Protocol):
    """A drafter whose blocks have a length limit (a remote drafter's `max_draft_len`; None: none)."""

    max_draft_len: int | None


@runtime_checkable
class SharedLoad(Protocol):
    """A verifier made per request over a shared peer (a channel, a client): `load_key` names that
    peer, so adaptive speculation learns one load per peer, not per object."""

    load_key: object


def open_session(verifier: Verifier, source_ids: list[int], processors: Processors | None) -> VerifierSession:
    """`verifier.open`, passing the logits processors only when any is on (a verifier of its own, in
    a test, may take the source alone)."""
    if processors is not None and processors.active:
        return verifier.open(source_ids, processors)
    return verifier.open(source_ids)


def greedy_run_limit(session: VerifierSession) -> int:
    """How many plain AR steps one call of `session` may run: a GreedySession's `max_greedy_steps`, else 1."""
    return session.max_greedy_steps if isinstance(session, GreedySession) else 1


def draft_limit(drafter: Drafter) -> int | None:
    """The longest block `drafter` drafts (None: no limit of its own)."""
    return drafter.max_draft_len if isinstance(drafter, BoundedDrafter) else None


def load_key_of(verifier: object) -> object:
    """What a verifier's load is learnt per: its SharedLoad key when it has one, else itself."""
    if isinstance(verifier, SharedLoad) and verifier.load_key is not None:
        return verifier.load_key
    return verifier
