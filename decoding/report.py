"""A request's stats as every door reports them, and the text of a stream as it grows.

`Stats` has the fields of gateway.proto's `DecodingStats`, in its order and under its names (times in
ms, the mode by name), so `specdec decode`'s JSON, `specdec generate --json`, the KServe response
parameters and the Python API's `Output.stats` name them alike; `gateway.wire` converts it to and from
the message.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from decoding.config import Mode
from decoding.policies.loop import DecodeStats


@dataclass(frozen=True)
class Stats:
    """One request's decoding stats (docs/metrics.md, "Per-request stats")."""

    iterations: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    mean_accepted_length: float = 0.0
    drafter_time_ms: float = 0.0
    verifier_time_ms: float = 0.0
    gateway_time_ms: float = 0.0  # the rest of total_time_ms: the loop itself (and, served, the gateway)
    degraded: bool = False
    finish_reason: str = ""
    mode: str = ""
    steps_per_draft_length: list[int] = field(default_factory=list)
    predrafts: int = 0
    predrafts_used: int = 0
    predraft_wait_ms: float = 0.0
    preverified: int = 0
    preverify_cuts: int = 0
    first_draft_ms: float = 0.0
    total_time_ms: float = 0.0
    output_tokens: int = 0
    mean_draft_length: float = 0.0

    def record(self) -> dict[str, Any]:
        """The stats as a JSON object: every field, floats rounded to 4 places."""
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in asdict(self).items()}


def request_stats(stats: DecodeStats, mode: Mode, total_s: float) -> Stats:
    """The loop's stats of a request that took `total_s` seconds in all, as reported."""
    other_s = max(total_s - stats.drafter_time_s - stats.verifier_time_s, 0.0)
    return Stats(
        iterations=stats.iterations,
        drafted_tokens=stats.drafted_tokens,
        accepted_tokens=stats.accepted_tokens,
        accepted_per_position=list(stats.accepted_per_position),
        mean_accepted_length=stats.mean_accepted_length,
        drafter_time_ms=stats.drafter_time_s * 1e3,
        verifier_time_ms=stats.verifier_time_s * 1e3,
        gateway_time_ms=other_s * 1e3,
        degraded=stats.degraded,
        finish_reason=stats.finish_reason,
        mode=mode.value,
        steps_per_draft_length=list(stats.steps_per_draft_length),
        predrafts=stats.predrafts,
        predrafts_used=stats.predrafts_used,
        predraft_wait_ms=stats.predraft_wait_s * 1e3,
        preverified=stats.preverified,
        preverify_cuts=stats.preverify_cuts,
        first_draft_ms=stats.first_draft_time_s * 1e3,
        total_time_ms=total_s * 1e3,
        output_tokens=stats.output_tokens,
        mean_draft_length=stats.mean_draft_length,
    )


class TextStream:
    """The text of a streamed output, a piece at a time: only text that later tokens cannot change
    (a prefix of the text so far) goes out, and `finish` gives what is left once the output is whole."""

    def __init__(self, decode: Any) -> None:
        self._decode = decode  # ids -> text (the tokenizer's decode)
        self.ids: list[int] = []
        self.sent = ""

    def add(self, block: list[int]) -> str:
        """The new text `block` adds, or "" while it may still change."""
        self.ids.extend(block)
        text = self._decode(self.ids)
        piece = text[len(self.sent) :] if text.startswith(self.sent) else ""
        self.sent += piece
        return piece

    def finish(self, output_ids: list[int]) -> tuple[str, list[int]]:
        """The text and the ids of `output_ids` not yet sent (the whole output at the end)."""
        full = self._decode(output_ids)
        rest = list(output_ids[len(self.ids) :])
        tail = full[len(self.sent) :] if full.startswith(self.sent) else ""
        self.ids = list(output_ids)
        self.sent += tail
        return tail, rest
