"""Multi-row verifier sessions for beam search (`core.interfaces.MultiRowSession`).

`open_rows` gives the beam policy one code path: a verifier whose sessions hold several rows
(`step_rows`: one forward for every live hypothesis, the prefix's KV cache shared by parent
index) is used as it is; for one whose sessions have a single row (a backend without
`step_rows`), `RowsOverSessions` offers the same `step_rows` over one single-row session per
row, re-targeting idle sessions with the session protocol itself (roll back to the common
prefix, append the rest), which is what beam search did before multi-row sessions existed.

It lives in `core` (it needs only the interfaces) so that a verifier server whose backend has no
`step_rows` can answer multi-row steps with it too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from core.errors import invalid, out_of_step
from core.interfaces import BeamRow, MultiRowSession, Verifier, VerifierSession, VerifyResult, open_session
from core.logits_processors import Processors


def open_rows(
    verifier: Verifier, source_ids: list[int], native: bool = True, processors: Processors | None = None
) -> MultiRowSession:
    """A multi-row session over `source_ids` (its scores processed by `processors`): the verifier's
    own when its sessions have `step_rows` (and `native`), else the adapter over single-row sessions.
    Decided once, at open."""
    session = open_session(verifier, source_ids, processors)
    if native and has_rows(session):
        return session  # type: ignore[return-value]
    return RowsOverSessions(verifier, source_ids, session, processors)


def has_rows(session: VerifierSession) -> bool:
    """Whether a session scores several rows in one step itself."""
    return isinstance(session, MultiRowSession)


@dataclass(eq=False)
class _Slot:
    session: VerifierSession
    seen: list[int] = field(default_factory=list)  # the tokens of the row the session holds

    def delta(self, tokens: list[int]) -> tuple[int, list[int]]:
        """(tokens kept, tokens to append) to re-target the session to `tokens`."""
        n, limit = 0, min(len(self.seen), len(tokens))
        while n < limit and self.seen[n] == tokens[n]:
            n += 1
        return n, tokens[n:]


class RowsOverSessions:
    """`step_rows` over single-row sessions: each row lives in its own session.

    A new row takes its parent's session when no earlier row of the step took it (a one-token
    append), else the idle session sharing the longest prefix with it, else a newly opened one. So
    the adapter holds at most as many sessions as the widest step had rows. A step that raises
    leaves the sessions in an unknown state: close the adapter."""

    def __init__(
        self, verifier: Verifier, source_ids: list[int], first: VerifierSession, processors: Processors | None = None
    ) -> None:
        self._verifier = verifier
        self._source_ids = source_ids
        self._processors = processors
        self._rows: list[_Slot] = [_Slot(first)]  # one per current row, in row order
        self._idle: list[_Slot] = []  # sessions holding no row, kept for re-targeting
        self.sessions_opened = 1

    @property
    def rows(self) -> list[list[int]]:
        """The tokens of every current row."""
        return [list(slot.seen) for slot in self._rows]

    def step_rows(self, rows: list[BeamRow], top_k: int) -> list[VerifyResult]:
        if not rows:
            raise invalid("a multi-row step needs at least one row")
        targets = [self._target(row) for row in rows]
        slots = self._assign(rows, targets)
        results = []
        for slot, tokens in zip(slots, targets, strict=True):
            committed, append = slot.delta(tokens)
            results.append(slot.session.step(committed, append, [], top_k))
            slot.seen = tokens
        taken = {id(slot) for slot in slots}
        self._idle = [slot for slot in self._rows + self._idle if id(slot) not in taken]
        self._rows = slots
        return results

    def step(self, committed_len: int, append_ids: list[int], draft_ids: list[int], top_k: int) -> VerifyResult:
        """A single-row step on row 0 (the only row until a multi-row step forks it)."""
        slot = self._rows[0]
        result = slot.session.step(committed_len, append_ids, draft_ids, top_k)
        slot.seen = [*slot.seen[:committed_len], *append_ids, *draft_ids]
        return result

    def close(self) -> None:
        slots, self._rows, self._idle = self._rows + self._idle, [], []
        for slot in slots:
            slot.session.close()

    def _target(self, row: BeamRow) -> list[int]:
        if not 0 <= row.parent < len(self._rows):
            raise out_of_step(f"row parent {row.parent} is not one of the session's {len(self._rows)} rows")
        parent = self._rows[row.parent].seen
        if not 0 <= row.committed_len <= len(parent):
            raise out_of_step(f"committed_len {row.committed_len} does not fit parent row {row.parent} "
                              f"of {len(parent)} tokens")
        return [*parent[: row.committed_len], *row.append_ids]

    def _assign(self, rows: list[BeamRow], targets: list[list[int]]) -> list[_Slot]:
        """A session for every new row (see the class docstring); the order of preference among
        equally good idle sessions is the previous rows' order, then the older idle ones."""
        chosen: list[_Slot | None] = [None] * len(rows)
        taken: set[int] = set()
        for i, row in enumerate(rows):
            parent = self._rows[row.parent]
            if id(parent) not in taken:
                chosen[i] = parent
                taken.add(id(parent))
        pool = self._rows + self._idle
        for i, tokens in enumerate(targets):
            if chosen[i] is not None:
                continue
            options = [slot for slot in pool if id(slot) not in taken]
            if options:
                slot = max(options, key=lambda s: s.delta(tokens)[0])
            else:
                slot = _Slot(open_session(self._verifier, self._source_ids, self._processors))
                self.sessions_opened += 1
                self._idle.append(slot)  # owned at once: `close` frees it even if this step fails
                pool.append(slot)
            chosen[i] = slot
            taken.add(id(slot))
        return [slot for slot in chosen if slot is not None]
