"""A drafter session seen through the draft-verify loop's `propose(output, room)`."""

from __future__ import annotations

from core.interfaces import Draft, DrafterSession
from core.sampling import SamplingParams
from gateway.policies.loop import PrefixSync


class DrafterSync:
    """Sends the drafter only the delta of the committed output at every step; one method per
    DrafterMethod, each capped at the room left before max_new_tokens."""

    def __init__(self, session: DrafterSession) -> None:
        self.session = session
        self.sync = PrefixSync()

    def block(self, output: list[int], room: int, k: int) -> Draft:
        return self.session.draft_block(*self._delta(output), min(k, room))

    def beam(self, output: list[int], room: int, gamma: int, num_beams: int) -> Draft:
        return self.session.draft_beam(*self._delta(output), min(gamma, room), num_beams)

    def sample(self, output: list[int], room: int, gamma: int, params: SamplingParams) -> Draft:
        return self.session.draft_sample(*self._delta(output), min(gamma, room), params)

    def _delta(self, output: list[int]) -> tuple[int, list[int]]:
        committed, append = self.sync.delta(output)
        self.sync.seen = list(output)
        return committed, append
