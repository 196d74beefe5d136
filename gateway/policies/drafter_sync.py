"""A drafter session seen through the draft-verify loop's `propose(output, room)`."""

from __future__ import annotations

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


# One kind of drafter call with its parameters: everything about a draft but the output and the room.
DraftKind = BlockDraft | BeamDraft | SampleDraft


class DrafterSync:
    """Sends the drafter only the delta of the committed output at every step; one method per
    DrafterMethod, each capped at the room left before max_new_tokens. A later call with a shorter
    common prefix is the rollback (the session protocol's `committed_len`)."""

    def __init__(self, session: DrafterSession) -> None:
        self.session = session
        self.sync = PrefixSync()

    def block(self, output: list[int], room: int, k: int) -> Draft:
        return self.draft(BlockDraft(k), output, room)

    def beam(self, output: list[int], room: int, gamma: int, num_beams: int) -> Draft:
        return self.draft(BeamDraft(gamma, num_beams), output, room)

    def sample(self, output: list[int], room: int, gamma: int, params: SamplingParams) -> Draft:
        return self.draft(SampleDraft(gamma, params), output, room)

    def draft(self, kind: DraftKind, output: list[int], room: int) -> Draft:
        """Every draft the modes ask for comes through here (`OverlappedSync` overrides it)."""
        return self.call(kind, output, room)

    def call(self, kind: DraftKind, output: list[int], room: int) -> Draft:
        """One drafter call, now, on the calling thread."""
        committed, append = self.sync.delta(output)
        self.sync.seen = list(output)
        return kind.run(self.session, committed, append, room)
