"""A drafter session seen through the draft-verify loop's `propose(output, room)`."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from core.interfaces import Draft, DrafterSession
from core.sampling import SamplingParams
from decoding.policies.loop import PrefixSync


@dataclass(frozen=True)
class DraftKind:
    """One kind of drafter call with its parameters: everything about a draft but the output and the
    room. `method` is the `DrafterSession` method (`draft_block`: a NAR block of `length` = k tokens;
    `draft_beam`: gamma tokens by beam search, `args` = (num_beams,); `draft_sample`: gamma sampled
    tokens with their q rows, `args` = (SamplingParams,))."""

    method: str
    length: int
    args: tuple[Any, ...] = ()

    @property
    def is_block(self) -> bool:
        return self.method == "draft_block"

    def run(self, session: DrafterSession, committed: int, append: list[int], room: int) -> Draft:
        return getattr(session, self.method)(committed, append, min(self.length, room), *self.args)


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


# A block call (the output it drafted after, the tokens it asked for) and its draft; None: none yet.
LastBlock = tuple[tuple[list[int], int], Draft] | None

# How many drafted positions a block may skip (drafter behind the output after deletions).
MAX_LEAD = 3


class DrafterSync:
    """Sends the drafter only the delta of the committed output at every step; one method per
    DrafterMethod, each capped at the room left before max_new_tokens. A later call with a shorter
    common prefix is the rollback (the session protocol's `committed_len`).

    With `realign`, block drafts may be drafted after the output less its last token (`shift` 1),
    or skip drafted positions after the whole output (`shift` below 0), standing for the positions
    after the whole output. Why: the NAR drafter aligns its output with the source by position, so
    after the verifier inserts a token (a comma, a word) every block it drafts is one token ahead of
    the output, and after it deletes one (a stray quote, a letter) one token behind; GAD's blocks
    are then cut at their first token until the sentence ends (BENCHMARKS.md, "GAD verdicts (what
    overlap can hit)"). `observe` reads each verdict:

    - the verifier's token is the draft's next one (the correction dropped the drafted token): the
      next blocks skip one drafted position more;
    - any other cut at the first token: the drafter's guess of the position was wrong; from shift 0
      or below, guess an insertion (one more), and from an insertion guess, take it back.

    On UA-GEC realigning both insertions and deletions takes GAD's iterations a sentence down most
    (BENCHMARKS.md, "Realigned drafts (GAD)"). A skip is drafted within the block's own k (asking for
    k + skip could pass what the drafter allows, for no fewer iterations): a block of k - skip
    tokens. Any draft is verified, so the output is the same either way. A block call that repeats
    the last one (after a guessed insertion, the same output and size) is answered from memory, not
    asked again.

    With `lookahead`, a block is drafted one position longer than it is verified when the room and
    the drafter's `max_block` allow: the extra token is `Draft.lookahead`, overlapped drafting's
    guess of the verifier's token (decoding.policies.overlap)."""

    def __init__(
        self, session: DrafterSession, realign: bool = False, lookahead: bool = False, max_block: int | None = None,
    ) -> None:
        self.session = session
        self.sync = PrefixSync()
        self.realign = realign
        # Block drafts come after the output less this many tokens; below 0, they skip as many
        # drafted positions after the whole output.
        self.shift = 0
        # Blocks drafted one position longer than verified (`Draft.lookahead`), within the
        # drafter's `max_block` tokens a call (None: no limit).
        self.lookahead = lookahead
        self.max_block = max_block
        # The last block call made (what it drafted after, tokens asked) and its draft: after a
        # guessed insertion (shift 1) the next call is often the very same one.
        self.last_block: LastBlock = None

    def observe(self, ids: list[int], accepted: int, token: int) -> None:
        """A block's verdict: `accepted` of the drafted `ids` kept, then the verifier's `token`."""
        if not self.realign or not ids:
            return
        if accepted + 1 < len(ids) and token == ids[accepted + 1]:
            # The verifier's token is the draft's next one: the output dropped a drafted token and
            # the drafter's positions are one behind it from here on.
            self.shift = max(self.shift - 1, -MAX_LEAD)
        elif accepted == 0:
            # Cut at the first token for no reason the block shows: guess the verifier inserted a
            # token (one more), and once that guess is cut there too, take it back.
            self.shift = 0 if self.shift == 1 else self.shift + 1

    def block(self, output: list[int], room: int, k: int) -> Draft:
        return self.draft(DraftKind("draft_block", k), output, room)

    def beam(self, output: list[int], room: int, gamma: int, num_beams: int) -> Draft:
        return self.draft(DraftKind("draft_beam", gamma, (num_beams,)), output, room)

    def sample(self, output: list[int], room: int, gamma: int, params: SamplingParams) -> Draft:
        return self.draft(DraftKind("draft_sample", gamma, (params,)), output, room)

    def draft(self, kind: DraftKind, output: list[int], room: int) -> Draft:
        """Every draft the modes ask for comes through here (`OverlappedSync` overrides it)."""
        return self.call(kind, output, room)

    def call(self, kind: DraftKind, output: list[int], room: int, shift: int | None = None) -> Draft:
        """One drafter call, now, on the calling thread: a block drafted after `output` less `shift`
        tokens (None: this sync's `shift`), which stands for the positions after `output`."""
        shift = self.shift if shift is None else shift
        if not kind.is_block:
            return kind.run(self.session, *self._sent(output), room)
        if shift > 0:
            output = output[: len(output) - min(shift, len(output))]
        size = min(kind.length, room)
        # Positions -shift further on: the block's k after the output, its first -shift dropped
        # (a shorter block: asking for more could pass the drafter's max_draft_len).
        skip = -shift if shift < 0 and size > -shift else 0
        # One more position when the output may go on past the block (and the drafter allows it).
        more = self.lookahead and size < room and (self.max_block is None or size < self.max_block)
        ask = size + 1 if more else size
        if self.last_block is not None and self.last_block[0] == (output, ask):
            # A cut at the block's first token guessed an insertion: the block is drafted after
            # the same output again. The drafter would answer what it answered.
            draft = self.last_block[1]
        else:
            draft = self.session.draft_block(*self._sent(output), ask)
            if self.realign:
                self.last_block = ((list(output), ask), draft)
        if not skip and ask == size:
            return draft
        lookahead = draft.ids[size] if ask > size and len(draft.ids) > size else None
        return dataclasses.replace(draft, ids=draft.ids[skip:size], lookahead=lookahead)

    def _sent(self, output: list[int]) -> tuple[int, list[int]]:
        """The delta of `output` against what the session has seen, which it sees next."""
        committed, append = self.sync.delta(output)
        self.sync.seen = list(output)
        return committed, append
