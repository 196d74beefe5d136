"""A drafter session seen through the draft-verify loop's `propose(output, room)`."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from core.interfaces import Draft, DrafterSession
from core.sampling import SamplingParams
from gateway.policies.loop import PrefixSync


@dataclass(frozen=True)
class BlockDraft:
    """A NAR block of k tokens (`draft_block`)."""

    k: int

    def run(self, session: DrafterSession, committed: int, append: list[int], room: int) -> Draft:
        return session.draft_block(committed, append, min(self.k, room))


@dataclass(frozen=True)
class BeamDraft:
    """gamma tokens by beam search (`draft_beam`)."""

    gamma: int
    num_beams: int

    def run(self, session: DrafterSession, committed: int, append: list[int], room: int) -> Draft:
        return session.draft_beam(committed, append, min(self.gamma, room), self.num_beams)


@dataclass(frozen=True)
class SampleDraft:
    """gamma sampled tokens with their q rows (`draft_sample`)."""

    gamma: int
    params: SamplingParams

    def run(self, session: DrafterSession, committed: int, append: list[int], room: int) -> Draft:
        return session.draft_sample(committed, append, min(self.gamma, room), self.params)


class LazyDrafterSession:
    """A `DrafterSession` opened on its first call (`open_session()`). An adaptive request may
    choose k = 0 at every step of a loaded server and never draft; it then pays neither the
    drafter's encoder run nor its stream. Thread-safe (a pre-draft may make the first call)."""

    def __init__(self, open_session: Callable[[], DrafterSession]) -> None:
        self._open_session = open_session
        self._session: DrafterSession | None = None
        self._closed = False
        self._lock = threading.Lock()

    def draft_block(self, committed_len: int, append_ids: list[int], k: int) -> Draft:
        return self._opened().draft_block(committed_len, append_ids, k)

    def draft_beam(self, committed_len: int, append_ids: list[int], gamma: int, num_beams: int) -> Draft:
        return self._opened().draft_beam(committed_len, append_ids, gamma, num_beams)

    def draft_sample(self, committed_len: int, append_ids: list[int], gamma: int, params: SamplingParams) -> Draft:
        return self._opened().draft_sample(committed_len, append_ids, gamma, params)

    def close(self) -> None:
        with self._lock:
            session, self._session, self._closed = self._session, None, True
        if session is not None:
            session.close()

    def _opened(self) -> DrafterSession:
        with self._lock:
            if self._closed:
                raise RuntimeError("the drafter session is closed")
            if self._session is None:
                self._session = self._open_session()
            return self._session


# One kind of drafter call with its parameters: everything about a draft but the output and the room.
DraftKind = BlockDraft | BeamDraft | SampleDraft


class DrafterSync:
    """Sends the drafter only the delta of the committed output at every step; one method per
    DrafterMethod, each capped at the room left before max_new_tokens. A later call with a shorter
    common prefix is the rollback (the session protocol's `committed_len`).

    With `realign`, block drafts may be drafted after the output less its last token (`shift`),
    standing for the positions after the whole output. Why: the NAR drafter aligns its output with
    the source by position, so after the verifier inserts a token (a comma, a word) every block it
    drafts is one token ahead of the output, and GAD's blocks are cut at their first token until the
    sentence ends (on UA-GEC 95% of the blocks after one cut at its first token were cut there too,
    half of all blocks). Drafted after one token less, those blocks kept 5.6 tokens on average
    instead of 0.08. The shift flips at every block cut at its first token (`observe`): the
    drafter's guess of the position was wrong, whichever it was. Any draft is verified, so the
    output is the same either way."""

    def __init__(self, session: DrafterSession, realign: bool = False) -> None:
        self.session = session
        self.sync = PrefixSync()
        self.realign = realign
        self.shift = 0  # block drafts come after the output less this many tokens (0 or 1)

    def observe(self, drafted: int, accepted: int) -> None:
        """A block's verdict: `accepted` of its `drafted` tokens kept."""
        if self.realign and drafted and accepted == 0:
            self.shift = 1 - self.shift

    def block(self, output: list[int], room: int, k: int) -> Draft:
        return self.draft(BlockDraft(k), output, room)

    def beam(self, output: list[int], room: int, gamma: int, num_beams: int) -> Draft:
        return self.draft(BeamDraft(gamma, num_beams), output, room)

    def sample(self, output: list[int], room: int, gamma: int, params: SamplingParams) -> Draft:
        return self.draft(SampleDraft(gamma, params), output, room)

    def draft(self, kind: DraftKind, output: list[int], room: int) -> Draft:
        """Every draft the modes ask for comes through here (`OverlappedSync` overrides it)."""
        return self.call(kind, output, room)

    def call(self, kind: DraftKind, output: list[int], room: int, shift: int | None = None) -> Draft:
        """One drafter call, now, on the calling thread: a block drafted after `output` less `shift`
        tokens (None: this sync's `shift`), which stands for the positions after `output`."""
        if isinstance(kind, BlockDraft):
            output = output[: len(output) - min(self.shift if shift is None else shift, len(output))]
        committed, append = self.sync.delta(output)
        self.sync.seen = list(output)
        return kind.run(self.session, committed, append, room)
